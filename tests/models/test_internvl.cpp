// InternVL behind the model interface (models/internvl.cpp, models/intern_vit.cpp,
// models/preprocess/dynamic_tiles.cpp): the processor against HF's on images of every shape, the
// tile grid it picks, where each visual token lies (tile by tile, then the thumbnail), configs it
// cannot read, the methods on its prompt and its chat template. Parity of logits and greedy ids
// with HF transformers is in test_parity / test_hf_values (the internvl_* fixtures, recorded by
// tests/make_hf_internvl_fixtures.py).
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "models/model.h"
#include "models/preprocess/dynamic_tiles.h"
#include "tests/test_expect.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using kt::edited_copy;
using kt::error_of;

namespace {

const std::string kQwen = kt::source_dir() + "/tests/fixtures/hf/internvl_qwen2_fp32";
const std::string kLlama = kt::source_dir() + "/tests/fixtures/hf/internvl_llama3_bf16";

}  // namespace

// GotOcr2ImageProcessor's pixel values (PIL backend, crop_to_patches) and token count for images
// from 1×1 to 41×1500.
TEST(InternVL, ProcessorMatchesHfOnImagesOfEveryShape) {
  for (const std::string& dir : {kQwen, kLlama}) kt::expect_processor_cases(dir);
}

// HF get_optimal_tiled_canvas on hand-worked cases: the closest aspect, ties to more tiles while
// the image covers more than half of them.
TEST(InternVL, TileGridHasTheClosestAspect) {
  EXPECT_EQ(optimal_tile_grid(448, 448, 448, 1, 12), (std::array<int, 2>{1, 1}));
  EXPECT_EQ(optimal_tile_grid(448, 1344, 448, 1, 12), (std::array<int, 2>{3, 1}));  // 3:1
  EXPECT_EQ(optimal_tile_grid(1344, 448, 448, 1, 12), (std::array<int, 2>{1, 3}));
  // Square and large: 1×1, 2×2 and 3×3 tie on aspect; each later one wins while the image
  // covers more than half of its area: 1000² > ½ · 9 · 448² = 903,168, so 3×3.
  EXPECT_EQ(optimal_tile_grid(1000, 1000, 448, 1, 12), (std::array<int, 2>{3, 3}));
  EXPECT_EQ(optimal_tile_grid(900, 900, 448, 1, 12), (std::array<int, 2>{2, 2}));  // 810,000 < 903,168
  EXPECT_EQ(optimal_tile_grid(1000, 1000, 448, 1, 3), (std::array<int, 2>{1, 1}));
  EXPECT_EQ(optimal_tile_grid(448, 448, 448, 2, 6), (std::array<int, 2>{2, 2}));  // at least two tiles, square
}

// The fixture's 100×37 image: 3×1 tiles of 4×4 tokens, stored tile by tile, then the thumbnail.
TEST(InternVL, LayoutPlacesTheTilesTokensTileByTileThenTheThumbnail) {
  const std::unique_ptr<Model> model = load_model(kQwen);
  const VisualLayout l = model->visual_layout(100, 37);
  EXPECT_EQ(l.n_tokens, 4 * 16);
  ASSERT_EQ(l.grids.size(), 2u);
  const VisualGrid& t = l.grids[0];
  EXPECT_EQ(t.rows, 4);
  EXPECT_EQ(t.cols, 12);
  EXPECT_TRUE(t.tile_major);
  EXPECT_EQ(t.token(0, 3), 3);
  EXPECT_EQ(t.token(0, 4), 16);  // the second tile's first token
  EXPECT_EQ(t.token(1, 0), 4);
  EXPECT_EQ(t.token(3, 11), 47);
  EXPECT_EQ(l.grids[1].name, "thumbnail");
  EXPECT_EQ(l.grids[1].first, 48);
  EXPECT_EQ(l.describe(), "64 = tiles 4×12 (1×3 tiles) + thumbnail 4×4");
  // A square image of one tile: no thumbnail.
  const VisualLayout one = model->visual_layout(56, 56);
  EXPECT_EQ(one.n_tokens, 16);
  EXPECT_EQ(one.grids.size(), 1u);
  const ModelInfo& f = model->info();
  EXPECT_EQ(f.architecture, "internvl");
  EXPECT_TRUE(f.image_dependent);
}

TEST(InternVL, ConfigsItCannotReadAreRefusedNamingTheField) {
  auto cfg_edit = [](const std::string& tag, const std::function<void(nlohmann::json&)>& e) {
    return edited_copy(kQwen, tag, "config.json", e);
  };
  EXPECT_NE(error_of([&] { load_model(cfg_edit("ratio", [](nlohmann::json& c) { c["downsample_ratio"] = 0.25; })); })
                .find("downsample_ratio 0.25 is not supported"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_model(cfg_edit("odd", [](nlohmann::json& c) { c["vision_config"]["image_size"] = 49; })); })
                .find("image_size 49 must be an even number of 7-pixel patches"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_model(cfg_edit("rect", [](nlohmann::json& c) { c["vision_config"]["image_size"] = {56, 42}; })); })
                .find("'image_size' [56,42] is not square"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_model(cfg_edit("full", [](nlohmann::json& c) { c["vision_feature_select_strategy"] = "full"; })); })
                .find("vision_feature_select_strategy 'full' does not work with internvl"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_model(cfg_edit("norm", [](nlohmann::json& c) { c["vision_config"]["norm_type"] = "batch"; })); })
                .find("norm_type 'batch'"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_model(edited_copy(kQwen, "patches", "preprocessor_config.json", [](nlohmann::json& c) {
                c["min_patches"] = 5;
                c["max_patches"] = 2;
              }));
            }).find("min_patches 5 exceeds max_patches 2"),
            std::string::npos);
}

// Every method runs on an InternVL prompt (tiles and thumbnail are the visual segment; <img> and
// </img> are text), and the chat template is the default template.
TEST(InternVL, EveryMethodCompressesTheTiledVisualSegment) { kt::expect_every_method_runs(kLlama); }
