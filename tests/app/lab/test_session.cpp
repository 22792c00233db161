// Session JSON: every example session loads and validates, round-trips, and bad sessions are
// refused with the key or method parameter named.
#include <gtest/gtest.h>

#include <dirent.h>

#include <fstream>

#include "core/errors.h"
#include "core/files.h"
#include "app/lab/session.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {
std::vector<std::string> example_sessions() {
  std::vector<std::string> r;
  const std::string root = kt::source_dir() + "/sessions";
  if (DIR* d = opendir(root.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      if (n.size() > 5 && n.substr(n.size() - 5) == ".json") r.push_back(root + "/" + n);
    }
    closedir(d);
  }
  return r;
}
}  // namespace

TEST(Session, ExamplesLoadAndRoundTrip) {
  const auto files = example_sessions();
  ASSERT_GE(files.size(), 4u);
  for (const auto& f : files) {
    const Session s = load_session(f);
    EXPECT_FALSE(s.methods.empty()) << f;
    EXPECT_FALSE(s.name.empty()) << f;
    const Session back = session_from_json(session_to_json(s), "round trip");
    ASSERT_EQ(back.methods.size(), s.methods.size()) << f;
    for (size_t i = 0; i < s.methods.size(); ++i) EXPECT_EQ(back.methods[i].spec(), s.methods[i].spec()) << f;
    EXPECT_EQ(back.max_new_tokens, s.max_new_tokens);
  }
}

TEST(Session, ObjectAndStringFormsAgree) {
  const auto a = session_from_json(nlohmann::json::parse(R"({"methods": ["calibquant:bits=1,tau2=2"]})"), "a");
  const auto b = session_from_json(
      nlohmann::json::parse(R"({"methods": [{"method": "calibquant", "params": {"bits": 1, "tau2": 2}}]})"), "b");
  EXPECT_EQ(a.methods.at(0).spec(), b.methods.at(0).spec());
  EXPECT_EQ(a.methods.at(0).num("tau2"), 2.0);
}

TEST(Session, PresetInObjectForm) {
  const auto a = session_from_json(nlohmann::json::parse(R"({"methods": ["calibquant:preset=official"]})"), "a");
  const auto b = session_from_json(
      nlohmann::json::parse(R"({"methods": [{"method": "calibquant", "preset": "official"}]})"), "b");
  const auto c = session_from_json(
      nlohmann::json::parse(R"({"methods": [{"method": "calibquant", "params": {"preset": "official"}}]})"), "c");
  EXPECT_EQ(a.methods.at(0).num("k_shrink"), 0.5);
  EXPECT_EQ(a.methods.at(0).spec(), b.methods.at(0).spec());
  EXPECT_EQ(a.methods.at(0).spec(), c.methods.at(0).spec());
}

TEST(Session, BadSessionsNameTheProblem) {
  auto expect = [](const char* text, const std::string& needle) {
    try {
      session_from_json(nlohmann::json::parse(text), "s.json");
      ADD_FAILURE() << text;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect(R"({"methods": ["calibquant:tau2=-1"]})", "methods[0]: calibquant: tau2");
  expect(R"({"methods": [{"method": "vlcache", "params": {"budget": 9}}]})", "budget");
  expect(R"({"methods": [42]})", "methods[0]");
  expect(R"({"method": []})", "unknown key 'method'");
  expect(R"({"max_new_tokens": 0})", "max_new_tokens");
  expect(R"({"max_new_tokens": "many"})", "max_new_tokens must be an integer in [1, 4096], got \"many\"");
  expect(R"({"kv_storage": "bf16"})", "s.json: kv_storage must be fp16 or fp32, got 'bf16'");
  // Integers are integers: no silent truncation or wrap-around.
  expect(R"({"max_new_tokens": 4294967297})", "max_new_tokens must be an integer in [1, 4096], got 4294967297");
  expect(R"({"max_new_tokens": 8.5})", "max_new_tokens must be an integer");
  expect(R"({"max_new_tokens": 1e30})", "max_new_tokens must be an integer");
  expect(R"({"diag_steps": -1})", "diag_steps must be an integer");
  expect(R"({"hit_budget": 0})", "hit_budget must be in");
  expect(R"({"name": 3})", "'name' must be a string");
  // The version field: newer versions are refused naming both, nonsense is refused.
  expect(R"({"kvlens_session": 3})", "session version 3 is newer than this kvlens reads (version 2)");
  expect(R"({"kvlens_session": 999})", "session version 999 is newer");
  expect(R"({"kvlens_session": 0})", "'kvlens_session' must be a version number >= 1, got 0");
  expect(R"({"kvlens_session": "x"})", "'kvlens_session' must be a version number >= 1, got \"x\"");
  expect(R"({"kvlens_session": 1.5})", "'kvlens_session' must be a version number");
  // A parameter value cannot smuggle in other parameters.
  expect(R"({"methods": [{"method": "calibquant", "params": {"bits": "1,tau1=5"}}]})",
         "methods[0]: calibquant: bits must be one of 1|2|4|8, got '1,tau1=5'");
  expect(R"({"methods": [{"method": "vlcache", "params": {"budget": "0.1,p=0.5"}}]})",
         "vlcache: budget must be a finite number");
  expect(R"({"methods": [{"method": "stack", "params": {"tau1": "1,tau2=0"}}]})", "calibquant: tau1 must be a finite number");
  expect(R"({"methods": [{"method": "calibquant", "params": {"tau1": [1]}}]})", "calibquant: tau1 must be a string, number or boolean");
  expect(R"({"methods": [{"method": "calibquant", "params": {}, "extra": 1}]})", "unknown key 'extra'");
  expect(R"({"methods": [{"method": "kivi", "enabled": "yes"}]})", "methods[0]: 'enabled' must be true or false");
  expect(R"({"methods": [{"method": "kivi", "label": 7}]})", "'label' must be a string");
  expect(R"({"views": [1]})", "'views' must be an object");
  expect(R"({"results": "fine"})", "'results' must be an object");
  expect(R"({"model_hash": 12})", "'model_hash' must be a string");
  EXPECT_THROW(load_session("/nonexistent/session.json"), InputError);
}

// A file that is not JSON: the message names the file, the line and column and what was
// expected, in words, without the JSON library's own tags.
TEST(Session, CorruptFileSaysWhereInWords) {
  const std::string dir = kt::make_temp_dir("sessioncorrupt");
  kt::write_file(dir + "/c.json", "{\"methods\": [\n");
  try {
    load_session(dir + "/c.json");
    FAIL() << "a corrupt session loaded";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind(dir + "/c.json: not valid JSON at line 2, column 1: ", 0), 0u) << m;
    EXPECT_EQ(m.find("json.exception"), std::string::npos) << m;
    EXPECT_EQ(m.find("parse_error"), std::string::npos) << m;
    EXPECT_EQ(m.find("syntax error while parsing"), std::string::npos) << m;
    EXPECT_NE(m.find("unexpected end of input (expected "), std::string::npos) << m;
  }
}

TEST(Session, Version2KeepsLabelsEnabledHashesViewsAndResults) {
  Session s;
  s.methods = {parse_method_spec("calibquant:tau2=2"), parse_method_spec("kivi"), parse_method_spec("calibquant:tau2=2")};
  s.labels = {"calib A", "", "calib B"};
  s.enabled = {true, false, true};
  s.model_hash = "fnv1a64:0123456789abcdef";
  s.image_hash = "fnv1a64:fedcba9876543210";
  s.views = {{"layer", 2}, {"plot", "softmax_mse"}};
  s.results = {{"full_caption", "a cat"}};
  const nlohmann::json j = session_to_json(s);
  EXPECT_EQ(j["kvlens_session"], 2);
  const Session b = session_from_json(j, "round trip");
  EXPECT_EQ(b.labels, s.labels);
  EXPECT_EQ(b.enabled, s.enabled);
  EXPECT_FALSE(b.method_enabled(1));
  EXPECT_EQ(b.method_label(2), "calib B");
  EXPECT_EQ(b.model_hash, s.model_hash);
  EXPECT_EQ(b.image_hash, s.image_hash);
  EXPECT_EQ(b.views, s.views);
  EXPECT_EQ(b.results, s.results);
  EXPECT_EQ(session_to_json(b), j);
  // A version 1 file (no new keys) reads with every method enabled.
  const Session v1 = session_from_json(nlohmann::json::parse(R"({"kvlens_session": 1, "methods": ["kivi"]})"), "v1");
  EXPECT_TRUE(v1.method_enabled(0));
  EXPECT_EQ(v1.method_label(0), "");
}

TEST(Session, ContentHashesChangeWithTheBytes) {
  const std::string d = kt::make_temp_dir("hash");
  kt::write_file(d + "/a.bin", "a");
  kt::write_file(d + "/b.bin", "world");
  const std::string fa = file_content_hash(d + "/a.bin", "file"), fd = folder_content_hash(d, "folder");
  EXPECT_EQ(fa, "fnv1a64:af63dc4c8601ec8c");  // FNV-1a 64 of "a", the published test vector
  kt::write_file(d + "/b.bin", "worle");
  EXPECT_NE(folder_content_hash(d, "folder"), fd);
  kt::write_file(d + "/b.bin", "world");
  EXPECT_EQ(folder_content_hash(d, "folder"), fd);
  kt::write_file(d + "/.b.bin.kvlens-tmp-1-1", "junk");  // temporaries do not count
  EXPECT_EQ(folder_content_hash(d, "folder"), fd);
  EXPECT_THROW(file_content_hash(d + "/none", "image"), InputError);
  EXPECT_THROW(folder_content_hash(d + "/a.bin", "model folder"), InputError);
}

TEST(Session, CliRunsASessionAndSavesOne) {
  const std::string tmp = kt::make_temp_dir("sess");
  const std::string fix = kt::source_dir() + "/tests/fixtures/hf/mha_fp32_hub";
  kt::write_file(tmp + "/s.json", R"({"name": "t", "max_new_tokens": 3, "kv_storage": "fp32", "methods": ["calibquant:bits=1", "vlcache:budget=0.5"]})");
  // fp32 rows are a CPU-backend storage (the CUDA KV cache holds fp16 rows).
  const auto r = kt::run(kt::cli() + " run --backend cpu --model " + fix + " --image " + fix + "/image.png --session " + tmp +
                         "/s.json --save-session " + tmp + "/saved.json --report " + tmp + "/r.json");
  ASSERT_EQ(r.code, 0) << r.output;
  const Session saved = load_session(tmp + "/saved.json");
  ASSERT_EQ(saved.methods.size(), 2u);
  EXPECT_EQ(saved.methods[0].method(), "calibquant");
  EXPECT_EQ(saved.max_new_tokens, 3);
  EXPECT_EQ(saved.kv_storage, "fp32");  // from the session, into the report and the saved one
  std::ifstream rf(tmp + "/r.json");
  const auto report = nlohmann::json::parse(rf);
  EXPECT_EQ(report["options"]["kv_storage"], "fp32");
  EXPECT_LT(report["full"]["compression_vs_fp16"].get<double>(), 0.6);
  EXPECT_EQ(saved.model_hash, folder_content_hash(fix, "model"));
  EXPECT_EQ(saved.image_hash, file_content_hash(fix + "/image.png", "image"));
  // Disabled methods do not run; labels name the methods in the report.
  kt::write_file(tmp + "/l.json", R"({"kvlens_session": 2, "max_new_tokens": 3, "methods": [
    {"method": "kivi", "label": "KIVI 2-bit"}, {"method": "vlcache", "enabled": false}]})");
  const auto l = kt::run(kt::cli() + " run --model " + fix + " --image " + fix + "/image.png --session " + tmp +
                         "/l.json --report " + tmp + "/l_report.json");
  ASSERT_EQ(l.code, 0) << l.output;
  const auto lr = nlohmann::json::parse(kt::read_file(tmp + "/l_report.json"));
  ASSERT_EQ(lr["methods"].size(), 1u);
  EXPECT_EQ(lr["methods"][0]["label"], "KIVI 2-bit");
  // A session whose image changed since it was saved still runs, with a note naming the image.
  kt::write_file(tmp + "/h.json", "{\"image_hash\": \"fnv1a64:0000000000000000\", \"max_new_tokens\": 2, \"methods\": [\"kivi\"]}");
  const auto h = kt::run(kt::cli() + " run --model " + fix + " --image " + fix + "/image.png --session " + tmp + "/h.json");
  EXPECT_EQ(h.code, 0) << h.output;
  EXPECT_NE(h.output.find("note: image " + fix + "/image.png differs"), std::string::npos) << h.output;
  kt::write_file(tmp + "/bad.json", R"({"methods": ["lookm:merge=blend"]})");
  const auto bad = kt::run(kt::cli() + " run --model " + fix + " --image " + fix + "/image.png --session " + tmp + "/bad.json");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.output.find("merge"), std::string::npos) << bad.output;
}
