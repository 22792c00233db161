// Fixture readers shared by the image suites (tests/core/data/test_image.cpp, the decoder;
// tests/models/preprocess/test_clip_image.cpp, the CLIP processor): the files of
// tests/fixtures/image/ (made by its scripts from PIL, numpy and transformers).
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/image.h"
#include "core/errors.h"

namespace kvlens {
namespace {


inline const std::string kDir = std::string(KVLENS_SOURCE_DIR) + "/tests/fixtures/image/";

inline std::vector<uint8_t> read_bytes(const std::string& name) {
  std::ifstream f(kDir + name, std::ios::binary);
  EXPECT_TRUE(f.good()) << "missing fixture " << name;
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

inline nlohmann::json read_json(const std::string& name) {
  std::ifstream f(kDir + name);
  EXPECT_TRUE(f.good()) << "missing fixture " << name;
  return nlohmann::json::parse(f);
}

// Shape of a raw fixture as MANIFEST.json records it.
inline std::vector<int> shape_of(const std::string& name) {
  static const nlohmann::json manifest = read_json("MANIFEST.json");
  return manifest.at(name).get<std::vector<int>>();
}

// A raw [h][w][3] uint8 fixture as an image.
inline RGBImage raw_image(const std::string& name) {
  const std::vector<int> s = shape_of(name);
  RGBImage img;
  img.height = s.at(0);
  img.width = s.at(1);
  img.data = read_bytes(name);
  EXPECT_EQ(s.at(2), 3);
  EXPECT_EQ(img.data.size(), static_cast<size_t>(img.width) * img.height * 3) << name;
  return img;
}

inline std::vector<float> raw_f32(const std::string& name) {
  const std::vector<uint8_t> b = read_bytes(name);
  std::vector<float> v(b.size() / 4);
  for (size_t i = 0; i < v.size(); ++i) {  // little-endian float32, independent of the host
    const uint32_t u = uint32_t{b[4 * i]} | uint32_t{b[4 * i + 1]} << 8 |
                       uint32_t{b[4 * i + 2]} << 16 | uint32_t{b[4 * i + 3]} << 24;
    std::memcpy(&v[i], &u, 4);
  }
  return v;
}

struct Diff {
  int max = 0;
  size_t mismatches = 0;
  double mean = 0;
};

inline Diff compare(const RGBImage& got, const RGBImage& want) {
  EXPECT_EQ(got.width, want.width);
  EXPECT_EQ(got.height, want.height);
  Diff d;
  if (got.data.size() != want.data.size()) {
    ADD_FAILURE() << "sizes differ";
    d.max = 256;
    return d;
  }
  double sum = 0;
  for (size_t i = 0; i < got.data.size(); ++i) {
    const int e = std::abs(int{got.data[i]} - int{want.data[i]});
    d.max = std::max(d.max, e);
    d.mismatches += e != 0;
    sum += e;
  }
  d.mean = sum / std::max<size_t>(got.data.size(), 1);
  return d;
}

// Runs `fn`, which must throw InputError; checks the message names each of `needles`.
inline void expect_input_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "expected InputError mentioning " << needles.at(0);
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg << " / " << n;
  }
}

}  // namespace
}  // namespace kvlens
