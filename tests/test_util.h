// Small helpers shared by the test suites: temporary folders, files, running the CLI.
#pragma once
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/data/image.h"
#include "core/errors.h"
#include "models/tokenizer.h"

namespace kvlens::testing {

inline std::string source_dir() { return KVLENS_SOURCE_DIR; }
inline std::string cli() { return KVLENS_BINARY; }

// Where a test names no model, the 4-layer kvlens-scenes-6m: KVLENS_MODEL set for the whole test
// process and the commands it starts, whatever the shell had (a test of the default itself
// unsets it).
inline const bool kSmallModelWhereNoneIsNamed = [] {
  setenv("KVLENS_MODEL", "kvlens-scenes-6m", 1);
  return true;
}();

// Whether this build renders figures (Cairo). A test that also draws figures, run on a build
// without it, checks the CLI's refusal of --figures, checks the rest without them and ends in a
// visible skip that says the figures went unchecked.
#ifdef KVLENS_HAVE_CAIRO
inline constexpr bool kHaveCairo = true;
#else
inline constexpr bool kHaveCairo = false;
#endif

inline std::string make_temp_dir(const std::string& tag) {
  std::string templ = "/tmp/kvlens_test_" + tag + "_XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  const char* d = mkdtemp(buf.data());
  return d ? std::string(d) : std::string();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline std::vector<float> read_f32(const std::string& path) {
  const std::string b = read_file(path);
  std::vector<float> v(b.size() / 4);
  if (!v.empty()) std::copy_n(b.data(), v.size() * 4, reinterpret_cast<char*>(v.data()));
  return v;
}

struct RunResult {
  int code = -1;
  std::string output;  // stdout + stderr
};

// Runs a shell command line and captures its combined output and exit code.
inline RunResult run(const std::string& cmd) {
  RunResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// The message of the InputError `f` throws ("" when it throws none).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const kvlens::InputError& e) {
    return e.what();
  }
  return "";
}

// `figures` (" --figures DIR ...") on a build with Cairo. Without it, runs `cmd + figures`, expects
// the refusal (exit 2, a message naming Cairo) and gives "" so that the caller runs the rest.
inline std::string figures_option(const std::string& cmd, const std::string& figures) {
  if (kHaveCairo) return figures;
  const RunResult r = run(cmd + figures);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("built without Cairo"), std::string::npos) << r.output;
  return "";
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

// The HF parity fixture folders (tests/fixtures/hf/*, those with an expected.json), sorted.
inline std::vector<std::string> hf_fixture_dirs() {
  std::vector<std::string> r;
  const std::string root = source_dir() + "/tests/fixtures/hf";
  if (DIR* d = opendir(root.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string p = root + "/" + e->d_name;
      if (e->d_name[0] != '.' && std::ifstream(p + "/expected.json").good()) r.push_back(p);
    }
    closedir(d);
  }
  std::sort(r.begin(), r.end());
  return r;
}

// How far a pixel value may lie from HF's when the 8-bit pixels agree (the resize is bit-exact
// with PIL, test_image): only the fp32 rescale / normalize arithmetic may differ, a few roundings
// of values of size |x/255 − mean|/std, bounded by 8u·(|ref| + (|mean| + 1)/std). One level of a
// resize difference would be 1/(255·std) ≈ 0.015.
inline double pixel_tolerance(double ref, float mean, float std) {
  constexpr double u = 1.0 / (1 << 24);
  return 8 * u * (ref < 0 ? -ref : ref) + 8 * u * ((mean < 0 ? -mean : mean) + 1.0) / std;
}

// A fixture's input image, or none for a text-only checkpoint (expected.json's "text_only").
inline RGBImage hf_fixture_image(const std::string& dir) {
  return read_json(dir + "/expected.json").value("text_only", false) ? RGBImage{} : load_image(dir + "/image.png");
}
// The template the fixture's prompt was recorded with.
inline std::string hf_fixture_template(const std::string& dir) {
  return read_json(dir + "/expected.json").value("template", std::string(kDefaultTemplate));
}

// 8 little-endian bytes (a safetensors header length).
inline std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file from a header object and a raw data section.
inline std::string safetensors_bytes(const nlohmann::json& header, const std::string& data) {
  const std::string h = header.dump();
  return le64(h.size()) + h + data;
}

}  // namespace kvlens::testing
