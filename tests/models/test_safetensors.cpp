// Checkpoint loading: safetensors validation and dtype conversion, config defaults and errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "models/config.h"
#include "models/safetensors.h"
#include "tests/test_util.h"

using namespace kvlens;
using kvlens::testing::make_temp_dir;
using kvlens::testing::le64;
using kvlens::testing::write_file;

namespace {



std::string f32_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

template <typename F>
void expect_input_error(F f, const std::string& must_contain) {
  try {
    f();
    ADD_FAILURE() << "expected InputError containing '" << must_contain << "'";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(must_contain), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Safetensors, ReadsF32F16Bf16) {
  const std::string dir = make_temp_dir("st");
  // 1.5, -2, 0.333.. in f16: 0x3E00, 0xC000, 0x3555; bf16 of 3.140625 = 0x4049.
  std::string f16 = std::string("\x00\x3e\x00\xc0\x55\x35", 6);
  std::string bf16 = std::string("\x49\x40", 2);
  std::string f32 = f32_bytes({1.0f, 2.0f, 3.0f, 4.0f});
  nlohmann::json h;
  h["a"] = {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {0, 16}}};
  h["b"] = {{"dtype", "F16"}, {"shape", {3}}, {"data_offsets", {16, 22}}};
  h["c"] = {{"dtype", "BF16"}, {"shape", {1}}, {"data_offsets", {22, 24}}};
  h["__metadata__"] = {{"format", "pt"}};
  write_file(dir + "/model.safetensors", kvlens::testing::safetensors_bytes(h, f32 + f16 + bf16));
  const WeightStore ws = WeightStore::open_dir(dir);
  EXPECT_EQ(ws.names().size(), 3u);
  const Tensor a = ws.load("a", {2, 2});
  EXPECT_EQ(a.data, (std::vector<float>{1, 2, 3, 4}));
  const Tensor b = ws.load("b");
  EXPECT_FLOAT_EQ(b.data[0], 1.5f);
  EXPECT_FLOAT_EQ(b.data[1], -2.0f);
  EXPECT_NEAR(b.data[2], 1.0f / 3.0f, 1e-3f);  // f16 has 10 mantissa bits
  EXPECT_FLOAT_EQ(ws.load("c").data[0], 3.140625f);
  expect_input_error([&] { ws.load("a", {4}); }, "'a' has shape [2,2]");
  expect_input_error([&] { ws.load("nope"); }, "no tensor 'nope'");
}

// Reading a tensor makes its mapped pages resident in this process; release() hands them back
// (the resident set shrinks by about the tensor's size) and the tensor reads the same after.
TEST(Safetensors, ReleaseHandsBackReadPages) {
  const std::string dir = make_temp_dir("strel");
  const int64_t n = int64_t{16} << 20;  // 64 MiB of f32
  std::string data(static_cast<size_t>(n) * 4, '\0');
  for (size_t i = 0; i < data.size(); i += 4093) data[i] = static_cast<char>(i * 2654435761u >> 24);
  nlohmann::json h;
  h["w"] = {{"dtype", "F32"}, {"shape", {n}}, {"data_offsets", {0, n * 4}}};
  write_file(dir + "/model.safetensors", kvlens::testing::safetensors_bytes(h, data));
  const WeightStore ws = WeightStore::open_dir(dir);
  auto resident = [] {
    std::ifstream f("/proc/self/statm");
    int64_t size = 0, pages = 0;
    f >> size >> pages;
    return pages * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  };
  const HostTensor t = ws.host("w");
  auto checksum = [&] {
    const auto* b = static_cast<const uint8_t*>(t.data);
    uint64_t c = 0;
    for (int64_t i = 0; i < n * 4; i += 512) c = c * 31 + b[i];
    return c;
  };
  const uint64_t first = checksum();
  const int64_t before = resident();
  ws.release();
  const int64_t after = resident();
  EXPECT_GT(before - after, int64_t{48} << 20) << "resident " << before << " bytes before, " << after << " after";
  EXPECT_EQ(checksum(), first);
}

TEST(Safetensors, RejectsBadFiles) {
  const std::string dir = make_temp_dir("stbad");
  const std::string p = dir + "/model.safetensors";
  nlohmann::json h;
  h["a"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  const std::string good = kvlens::testing::safetensors_bytes(h, f32_bytes({1, 2}));

  write_file(p, good.substr(0, 5));
  expect_input_error([&] { SafetensorsFile f(p); }, "truncated");
  write_file(p, good.substr(0, good.size() - 3));
  expect_input_error([&] { SafetensorsFile f(p); }, "past the end of the file");
  write_file(p, le64(1000) + "{}");
  expect_input_error([&] { SafetensorsFile f(p); }, "larger than the file");
  write_file(p, le64(kMaxSafetensorsHeader + 1) + "{}");
  expect_input_error([&] { SafetensorsFile f(p); }, "cap");
  write_file(p, le64(5) + "{nope");
  expect_input_error([&] { SafetensorsFile f(p); }, "not valid JSON");

  nlohmann::json bad = h;
  bad["a"]["shape"] = {3};
  write_file(p, kvlens::testing::safetensors_bytes(bad, f32_bytes({1, 2})));
  expect_input_error([&] { SafetensorsFile f(p); }, "needs 12 bytes");
  bad = h;
  bad["a"]["dtype"] = "F4";
  write_file(p, kvlens::testing::safetensors_bytes(bad, f32_bytes({1, 2})));
  expect_input_error([&] { SafetensorsFile f(p); }, "unknown dtype 'F4'");
  bad = h;
  bad["b"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4, 8}}};
  write_file(p, kvlens::testing::safetensors_bytes(bad, f32_bytes({1, 2})));
  expect_input_error([&] { SafetensorsFile f(p); }, "overlap");
  // 2^62 × 4 elements × 4 bytes wraps to 0 in 64 bits: must not pass as an empty tensor.
  bad = h;
  bad["a"]["shape"] = {int64_t{1} << 62, 4};
  bad["a"]["data_offsets"] = {0, 0};
  write_file(p, kvlens::testing::safetensors_bytes(bad, f32_bytes({1, 2})));
  expect_input_error([&] { SafetensorsFile f(p); }, "tensor 'a': shape");
  expect_input_error([&] { SafetensorsFile f(p); }, "overflows 64-bit byte counts");
  bad["a"]["shape"] = {int64_t{1} << 62, 0};  // a zero dimension: empty, whatever the rest
  write_file(p, kvlens::testing::safetensors_bytes(bad, f32_bytes({1, 2})));
  EXPECT_NO_THROW({ SafetensorsFile f(p); });

  nlohmann::json ints;
  ints["i"] = {{"dtype", "I32"}, {"shape", {2}}, {"data_offsets", {0, 8}}};
  write_file(p, kvlens::testing::safetensors_bytes(ints, f32_bytes({1, 2})));
  const WeightStore ws = WeightStore::open_dir(dir);
  expect_input_error([&] { ws.load("i"); }, "dtype I32");

  expect_input_error([&] { SafetensorsFile f(dir + "/missing.safetensors"); }, "missing.safetensors");
}

TEST(Safetensors, ShardsWithIndex) {
  const std::string dir = make_temp_dir("shard");
  nlohmann::json h1, h2, idx;
  h1["x"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}};
  h2["y"] = {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}};
  write_file(dir + "/model-00001-of-00002.safetensors", kvlens::testing::safetensors_bytes(h1, f32_bytes({7})));
  write_file(dir + "/model-00002-of-00002.safetensors", kvlens::testing::safetensors_bytes(h2, f32_bytes({9})));
  idx["weight_map"] = {{"x", "model-00001-of-00002.safetensors"}, {"y", "model-00002-of-00002.safetensors"}};
  write_file(dir + "/model.safetensors.index.json", idx.dump());
  const WeightStore ws = WeightStore::open_dir(dir);
  EXPECT_EQ(ws.load("x").data[0], 7.0f);
  EXPECT_EQ(ws.load("y").data[0], 9.0f);

  idx["weight_map"]["z"] = "model-00003-of-00003.safetensors";
  write_file(dir + "/model.safetensors.index.json", idx.dump());
  expect_input_error([&] { WeightStore::open_dir(dir); }, "shard 'model-00003-of-00003.safetensors'");
  expect_input_error([&] { WeightStore::open_dir(make_temp_dir("empty")); }, "no model.safetensors");
  idx["weight_map"]["z"] = 3;
  write_file(dir + "/model.safetensors.index.json", idx.dump());
  expect_input_error([&] { WeightStore::open_dir(dir); }, "shard of tensor 'z' is not a file name");
  write_file(dir + "/model.safetensors.index.json", "{oops");
  expect_input_error([&] { WeightStore::open_dir(dir); }, "model.safetensors.index.json: not valid JSON");
}

TEST(Config, DefaultsFollowHF) {
  // The published llava-1.5-7b config omits most text/vision keys.
  const auto j = nlohmann::json::parse(R"({
    "model_type": "llava", "image_token_index": 32000, "vocab_size": 32064,
    "text_config": {"model_type": "llama", "vocab_size": 32064, "max_position_embeddings": 4096},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                      "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768}})");
  const LlavaConfig c = parse_llava_config(j, "config.json");
  EXPECT_EQ(c.text.hidden_size, 4096);
  EXPECT_EQ(c.text.num_attention_heads, 32);
  EXPECT_EQ(c.text.num_key_value_heads, 32);
  EXPECT_EQ(c.text.head_dim, 128);
  EXPECT_EQ(c.text.num_hidden_layers, 32);
  EXPECT_FLOAT_EQ(c.text.rope.theta, 10000.0f);
  EXPECT_DOUBLE_EQ(c.text.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.vision.hidden_act, "quick_gelu");
  EXPECT_EQ(c.n_visual_tokens(), 576);  // (336/14)^2, CLS dropped
  EXPECT_EQ(c.feature_layer_indices(), std::vector<int>{23});  // -2 of 25 hidden states
  EXPECT_EQ(c.encoder_layers_needed(), 23);
  EXPECT_EQ(c.projector_hidden_act, "gelu");
}

TEST(Config, VariantsAndErrors) {
  auto j = nlohmann::json::parse(R"({
    "model_type": "llava", "image_token_index": 5, "vision_feature_select_strategy": "full",
    "vision_feature_layer": [-1, 1],
    "text_config": {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 16, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}},
    "vision_config": {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 3,
                      "image_size": 32, "patch_size": 8}})");
  const LlavaConfig c = parse_llava_config(j, "cfg");
  EXPECT_EQ(c.text.head_dim, 16);
  EXPECT_EQ(c.text.num_key_value_heads, 2);
  EXPECT_FLOAT_EQ(c.text.rope.theta, 500000.0f);
  EXPECT_EQ(c.n_visual_tokens(), 17);
  EXPECT_EQ(c.feature_layer_indices(), (std::vector<int>{3, 1}));

  auto bad = j;
  bad["model_type"] = "qwen2_vl";
  expect_input_error([&] { parse_llava_config(bad, "cfg"); }, "model_type 'qwen2_vl'");
  bad = j;
  bad["text_config"]["num_key_value_heads"] = 3;
  expect_input_error([&] { parse_llava_config(bad, "cfg"); }, "num_key_value_heads");
  bad = j;
  bad["vision_feature_layer"] = 9;
  expect_input_error([&] { parse_llava_config(bad, "cfg"); }, "vision_feature_layer");
  bad = j;
  bad["image_token_index"] = 64;
  expect_input_error([&] { parse_llava_config(bad, "cfg"); }, "image_token_index must be an integer in [0, 63], got 64");
  expect_input_error([&] { load_llava_config("/nonexistent/config.json"); }, "/nonexistent/config.json");
}

TEST(Config, IntegersAreStrictAndArchitectureNumbersBounded) {
  const auto j = nlohmann::json::parse(R"({
    "model_type": "llava", "image_token_index": 5,
    "text_config": {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4},
    "vision_config": {"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 3,
                      "image_size": 32, "patch_size": 8}})");
  ASSERT_NO_THROW(parse_llava_config(j, "cfg"));
  auto with = [&](const std::string& path, const nlohmann::json& v) {
    auto b = j;
    b[nlohmann::json::json_pointer(path)] = v;
    return b;
  };
  auto refused = [&](const std::string& path, const nlohmann::json& v, const std::string& msg) {
    SCOPED_TRACE(path + " = " + v.dump());
    expect_input_error([&] { parse_llava_config(with(path, v), "cfg"); }, msg);
  };
  // No wrap-around, truncation or rounding of integers.
  refused("/text_config/num_attention_heads", 4294967304LL,
          "cfg: text_config: num_attention_heads must be an integer in [1, 1024], got 4294967304");
  refused("/text_config/num_attention_heads", 8.5, "num_attention_heads must be an integer in [1, 1024], got 8.5");
  refused("/text_config/num_attention_heads", 1e30, "num_attention_heads must be an integer in [1, 1024], got 1e+30");
  refused("/image_token_index", 40.5, "cfg: image_token_index must be an integer in [0, 63], got 40.5");
  refused("/text_config/vocab_size", "64", "vocab_size must be an integer in");
  refused("/text_config/rms_norm_eps", "tiny", "rms_norm_eps must be a finite number in [0, 1]");
  // Architecture numbers are bounded: sizes computed from them cannot overflow.
  refused("/vision_config/num_hidden_layers", 2147483647, "num_hidden_layers must be an integer in [1, 512], got 2147483647");
  refused("/vision_config/hidden_size", 1 << 20, "vision_config: hidden_size must be an integer in [1, 65536]");
  refused("/vision_config/image_size", 0, "image_size must be an integer in [1, 8192], got 0");
  refused("/vision_config/patch_size", 33, "vision_config: patch_size 33 is larger than image_size 32");
  refused("/vision_config/patch_size", 9000, "patch_size must be an integer in [1, 8192], got 9000");
  // The default patch size (32, as in CLIPVisionConfig) against a given image size, found by
  // fuzzing: no patch fits.
  expect_input_error([] { parse_llava_config(nlohmann::json::parse(R"({"model_type": "llava", "image_token_index": 0, "vision_config": {"image_size": 5}})"), "cfg"); },
                     "cfg: vision_config: patch_size 32 is larger than image_size 5");
  refused("/text_config/num_key_value_heads", 8, "num_key_value_heads must be an integer in [1, 4], got 8");
  refused("/text_config/eos_token_id", nlohmann::json::array({2, 99}), "eos_token_id[1] must be an integer in [0, 63], got 99");
  refused("/text_config/tie_word_embeddings", 1, "'tie_word_embeddings' must be true or false, got 1");
  // vision_feature_layer: an empty list, an index past either end, a non-integer.
  refused("/vision_feature_layer", nlohmann::json::array(), "'vision_feature_layer' is an empty list");
  refused("/vision_feature_layer", -5, "vision_feature_layer must be an integer in [-4, 3], got -5");
  refused("/vision_feature_layer", nlohmann::json::array({-2, 4}), "vision_feature_layer[1] must be an integer in [-4, 3], got 4");
  refused("/vision_feature_layer", "last", "'vision_feature_layer' must be an integer or a list");
  // Integral floats are integers.
  EXPECT_EQ(parse_llava_config(with("/text_config/num_attention_heads", 4.0), "cfg").text.num_attention_heads, 4);
  EXPECT_EQ(parse_llava_config(with("/vision_feature_layer", -4), "cfg").feature_layer_indices(), std::vector<int>{0});
}
