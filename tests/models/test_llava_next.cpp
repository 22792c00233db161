// LLaVA-NeXT behind the model interface (models/llava.cpp with models/llava_next.cpp and
// models/preprocess/anyres.cpp): the processor against HF's on images of every shape, the layout
// of the visual tokens, configs it cannot read, and the methods on an anyres prompt. Parity of
// logits and greedy ids with HF transformers is in test_parity / test_hf_values (the next_*
// fixtures, recorded by tests/make_hf_next_fixtures.py).
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/compress/method.h"
#include "core/errors.h"
#include "models/config.h"
#include "models/llava_next.h"
#include "models/model.h"
#include "models/preprocess/anyres.h"
#include "tests/test_expect.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using kt::edited_copy;
using kt::expect_input_error;
namespace fs = std::filesystem;

namespace {

const std::string kLlamaNext = kt::source_dir() + "/tests/fixtures/hf/next_llama_fp32_save";
const std::string kMistralNext = kt::source_dir() + "/tests/fixtures/hf/next_mistral_bf16_hub";

}  // namespace

// LlavaNextImageProcessor's pixel values (PIL backend) and LlavaNextProcessor's token count for
// images from 1×1 to 41×1500: thin ones whose tiles keep no row after unpadding, near-square,
// and large against the tile.
TEST(LlavaNext, ProcessorMatchesHfOnImagesOfEveryShape) {
  for (const std::string& dir : {kLlamaNext, kMistralNext}) kt::expect_processor_cases(dir);
}

// HF's select_best_resolution on hand-worked cases: most kept pixels first, then least waste,
// then the first listed; and the aspect-keeping resize into the chosen resolution.
TEST(LlavaNext, BestResolutionKeepsMostAndWastesLeast) {
  const std::vector<Resolution> pins{{336, 672}, {672, 336}, {672, 672}, {1008, 336}, {336, 1008}};
  EXPECT_EQ(select_best_resolution(480, 640, pins), (Resolution{672, 672}));   // keeps all 307,200 pixels
  EXPECT_EQ(select_best_resolution(200, 800, pins), (Resolution{336, 1008}));  // wide: 1008×252 keeps all
  EXPECT_EQ(select_best_resolution(800, 200, pins), (Resolution{1008, 336}));
  EXPECT_EQ(select_best_resolution(100, 100, pins), (Resolution{336, 672}));   // all keep 10,000; least waste, first
  EXPECT_EQ(resize_into(200, 800, {336, 1008}), (Resolution{252, 1008}));
  EXPECT_EQ(resize_into(799, 200, {1008, 336}), (Resolution{1008, 253}));       // ceil(200 · 1008/799) = 253
}

// Where the visual tokens of the fixture's 80×20 image lie: the whole image's 8×8 grid, then the
// 1×3 tiles' joined 8×24 grid with one row cut top and bottom by unpadding, a newline token
// after each of its 6 rows.
TEST(LlavaNext, LayoutPlacesTheBaseGridThenTheUnpaddedTilesWithNewlines) {
  const LlavaConfig cfg = load_llava_config(kLlamaNext + "/config.json");
  ASSERT_TRUE(cfg.anyres());
  const AnyresGeometry g = anyres_geometry(cfg, 80, 20);
  EXPECT_EQ(g.tile_rows, 1);
  EXPECT_EQ(g.tile_cols, 3);
  EXPECT_EQ(g.side, 8);
  EXPECT_EQ(g.row0, 1);
  EXPECT_EQ(g.rows, 6);
  EXPECT_EQ(g.cols, 24);
  const VisualLayout l = anyres_layout(cfg, 80, 20);
  EXPECT_EQ(l.n_tokens, 64 + 6 * 25);
  ASSERT_EQ(l.grids.size(), 2u);
  EXPECT_EQ(l.grids[0].name, "base");
  EXPECT_EQ(l.grids[0].token(7, 7), 63);
  const VisualGrid& t = l.grids[1];
  EXPECT_EQ(t.first, 64);
  EXPECT_EQ(t.row_stride, 25);
  EXPECT_EQ(t.token(1, 0), 64 + 25);  // the newline of row 0 at 64 + 24
  EXPECT_EQ(l.finest(), &t);
  EXPECT_EQ(l.describe(), "214 = base 8×8 + tiles 6×24 (1×3 tiles) + 6 newlines");
  // A 300×5 image keeps no row of its tiles: the whole image's tokens alone, as HF counts them.
  const VisualLayout thin = anyres_layout(cfg, 300, 5);
  EXPECT_EQ(thin.n_tokens, 64);
  EXPECT_EQ(thin.grids.size(), 1u);
}

// The model's facts name the family and its tiling; the image decides the token count.
TEST(LlavaNext, FactsNameTheFamilyAndTheTiling) {
  const std::unique_ptr<Model> model = load_model(kMistralNext);
  const ModelInfo& f = model->info();
  EXPECT_EQ(f.architecture, "llava_next");
  EXPECT_EQ(f.family, "LLaVA-NeXT (anyres)");
  EXPECT_TRUE(f.image_dependent);
  EXPECT_NE(f.tiling.find("24-px tiles"), std::string::npos) << f.tiling;
  EXPECT_EQ(f.n_kv_heads, 2);
  EXPECT_EQ(f.n_heads, 6);
  EXPECT_NE(model->visual_layout(19, 50).n_tokens, model->visual_layout(50, 19).n_tokens);
}

TEST(LlavaNext, ConfigsItCannotReadAreRefusedNamingTheField) {
  auto cfg_edit = [](const std::string& tag, const std::function<void(nlohmann::json&)>& e) {
    return edited_copy(kLlamaNext, tag, "config.json", e);
  };
  expect_input_error([&] { load_model(cfg_edit("pin", [](nlohmann::json& c) { c["image_grid_pinpoints"] = {{32, 50}}; })); },
                     "image_grid_pinpoints[0] = [32, 50] is not a whole number of 32-pixel tiles");
  expect_input_error([&] { load_model(cfg_edit("many", [](nlohmann::json& c) { c["image_grid_pinpoints"] = {{32 * 9, 32 * 8}}; })); },
                     "makes 72 tiles; kvlens takes at most 64");
  expect_input_error([&] { load_model(cfg_edit("pair", [](nlohmann::json& c) { c["image_grid_pinpoints"] = {{32}}; })); },
                     "image_grid_pinpoints[0]: expected [height, width]");
  expect_input_error([&] { load_model(cfg_edit("full", [](nlohmann::json& c) { c["vision_feature_select_strategy"] = "full"; })); },
                     "vision_feature_select_strategy 'full' does not work with llava_next");
  expect_input_error([&] {
    load_model(edited_copy(kLlamaNext, "pre", "preprocessor_config.json",
                           [](nlohmann::json& c) { c["image_grid_pinpoints"] = {{32, 64}}; }));
  }, "preprocessor_config.json: image_grid_pinpoints differ from config.json's");
  expect_input_error([&] {
    load_model(edited_copy(kLlamaNext, "crop", "preprocessor_config.json",
                           [](nlohmann::json& c) { c["crop_size"] = {{"height", 24}, {"width", 24}}; }));
  }, "crop size 24x24 differs from vision_config.image_size 32");
  // A checkpoint without its image_newline tensor (renamed in the safetensors header).
  const std::string dir = kt::make_temp_dir("nonl") + "/model";
  fs::copy(kLlamaNext, dir, fs::copy_options::recursive);
  const std::string bytes = kt::read_file(dir + "/model.safetensors");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  ASSERT_TRUE(header.contains("image_newline"));
  header["not_the_newline"] = header["image_newline"];
  header.erase("image_newline");
  kt::write_file(dir + "/model.safetensors", kt::safetensors_bytes(header, bytes.substr(8 + n)));
  expect_input_error([&] { load_model(dir); }, "no 'image_newline' tensor");
}

// Every method runs on an anyres prompt: the visual segment is every image token (the base grid,
// the tiles and their newline tokens), and the compressed cache keeps the layout's token count.
TEST(LlavaNext, EveryMethodCompressesTheAnyresVisualSegment) {
  const std::unique_ptr<Model> model = load_model(kLlamaNext);
  const RGBImage img = load_image(kLlamaNext + "/image.png");
  const nlohmann::json exp = kt::read_json(kLlamaNext + "/expected.json");
  const PrefillState st = model->prefill(img, exp["prompt"].get<std::string>(), exp["template"].get<std::string>(), true);
  EXPECT_EQ(st.n_visual, 214);
  EXPECT_EQ(st.layout.grids.size(), 2u);
  EXPECT_EQ(std::count(st.kinds.begin(), st.kinds.end(), SegmentKind::Visual), 214);
  GenerateOptions g;
  g.max_new_tokens = 4;
  for (const MethodSpec& m : methods()) {
    SCOPED_TRACE(m.name);
    const std::unique_ptr<KVPolicy> policy = make_policy(parse_method_spec(m.name));
    const DecodeResult d = model->decode(st, policy.get(), g);
    EXPECT_EQ(d.generated_ids.size(), 4u);
    EXPECT_GT(d.bytes_after_prefill.total(), 0);
  }
}
