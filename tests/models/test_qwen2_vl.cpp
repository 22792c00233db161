// Qwen2-VL and Qwen2.5-VL behind the model interface (models/qwen2_vl.cpp, models/qwen2_vit.cpp,
// models/preprocess/qwen_patches.cpp): the processor against HF's on images of every shape,
// smart_resize on hand-worked cases, the M-RoPE positions against HF's get_rope_index, the token
// grid, Qwen2.5-VL's windows, configs it cannot read, the methods on its prompt and its chat
// template. Parity of logits
// and greedy ids with HF transformers is in test_parity / test_hf_values (the qwen2vl_* fixtures,
// recorded by tests/make_hf_qwen2vl_fixtures.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "models/model.h"
#include "models/preprocess/qwen_patches.h"
#include "models/qwen2_vit.h"
#include "models/qwen2_vl.h"
#include "tests/test_expect.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;
using kt::edited_copy;
using kt::error_of;

namespace {

const std::string kFp32 = kt::source_dir() + "/tests/fixtures/hf/qwen2vl_fp32";
const std::string kBf16 = kt::source_dir() + "/tests/fixtures/hf/qwen2vl_bf16_inmem";
const std::string k25 = kt::source_dir() + "/tests/fixtures/hf/qwen25vl_fp32";

}  // namespace

// Qwen2VLImageProcessor's pixel values (PIL backend) and token count for images from 1×1 to
// 41×1500, each resized within the fixture's min_pixels .. max_pixels.
TEST(Qwen2VL, ProcessorMatchesHfOnImagesOfEveryShape) {
  for (const std::string& dir : {kFp32, kBf16, k25}) kt::expect_processor_cases(dir);
}

// HF smart_resize worked by hand: sides rounded (halves to even) to multiples of the factor, then
// scaled into [min_pixels, max_pixels] keeping the aspect; aspects beyond 200 refused.
TEST(Qwen2VL, SmartResizeRoundsScalesAndRefusesExtremeAspects) {
  EXPECT_EQ(smart_resize(37, 100, 12, 576, 5760), (std::array<int, 2>{36, 96}));  // 3.08 → 3, 8.33 → 8
  EXPECT_EQ(smart_resize(30, 30, 12, 576, 5760), (std::array<int, 2>{24, 24}));   // 2.5 → 2 (even), 576 ≥ min
  EXPECT_EQ(smart_resize(42, 42, 12, 576, 5760), (std::array<int, 2>{48, 48}));   // 3.5 → 4 (even)
  // 600×577: 50·48 factors are 345,600 pixels > 5,760: beta = sqrt(346,200 / 5,760) = 7.753 → floor.
  EXPECT_EQ(smart_resize(577, 600, 12, 576, 5760), (std::array<int, 2>{72, 72}));
  // 1×1: 0·0 < min: beta = sqrt(576) = 24 → ceil(24 / 12)·12 = 24 a side.
  EXPECT_EQ(smart_resize(1, 1, 12, 576, 5760), (std::array<int, 2>{24, 24}));
  EXPECT_NE(error_of([] { smart_resize(1, 201, 12, 576, 5760); }).find("aspect ratio must be smaller than 200"), std::string::npos);
}

// The fixture's prompt: text positions count on, the image's tokens take (start, start + row,
// start + column), the text after it continues from start + max(rows, columns): HF's positions
// and rope_deltas exactly.
TEST(Qwen2VL, MropePositionsAreHfGetRopeIndex) {
  for (const std::string& dir : {kFp32, kBf16, k25}) {
    SCOPED_TRACE(dir);
    const std::unique_ptr<Model> model = load_model(dir);
    const nlohmann::json exp = kt::read_json(dir + "/expected.json");
    const RGBImage img = load_image(dir + "/image.png");
    const PrefillState st = model->prefill(img, exp["prompt"].get<std::string>(), exp["template"].get<std::string>(), false);
    int delta = 0;
    const std::vector<int32_t> p = Qwen2VLModel::mrope_positions(st.kinds, st.layout, delta);
    const auto want = exp["mrope_positions"].get<std::vector<std::vector<int32_t>>>();
    ASSERT_EQ(want.size(), 3u);
    const size_t T = st.ids.size();
    for (size_t r = 0; r < 3; ++r) EXPECT_EQ(std::vector<int32_t>(p.begin() + r * T, p.begin() + (r + 1) * T), want[r]) << "row " << r;
    EXPECT_EQ(delta, exp["rope_deltas"].get<int>());
    const auto thw = exp["grid_thw"].get<std::vector<int>>();
    const VisualGrid& g = st.layout.grids.at(0);
    EXPECT_EQ(g.rows, thw[1] / 2);
    EXPECT_EQ(g.cols, thw[2] / 2);
    EXPECT_EQ(st.n_visual, g.rows * g.cols);
  }
}

TEST(Qwen2VL, ConfigsItCannotReadAreRefusedNamingTheField) {
  auto cfg_edit = [](const std::string& tag, const std::function<void(nlohmann::json&)>& e) {
    return edited_copy(kFp32, tag, "config.json", e);
  };
  EXPECT_NE(error_of([&] {
              load_model(cfg_edit("sections", [](nlohmann::json& c) {
                c["text_config"]["rope_parameters"]["mrope_section"] = {2, 2, 2};
              }));
            }).find("mrope_section sums to 6; it must split head_dim / 2 = 8 frequencies"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_model(cfg_edit("two", [](nlohmann::json& c) { c["text_config"]["rope_parameters"]["mrope_section"] = {4, 4}; }));
            }).find("mrope_section must list 3 section sizes"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_model(cfg_edit("none", [](nlohmann::json& c) { c["text_config"]["rope_parameters"].erase("mrope_section"); }));
            }).find("no rope_parameters.mrope_section"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_model(cfg_edit("width", [](nlohmann::json& c) { c["vision_config"]["hidden_size"] = 32; })); })
                .find("hidden_size 32 (the merger's output) differs from the decoder's 64"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_model(edited_copy(kFp32, "merge", "preprocessor_config.json", [](nlohmann::json& c) { c["merge_size"] = 3; }));
            }).find("merge_size 3, temporal_patch_size 2 differ from vision_config's"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_model(edited_copy(kFp32, "pixels", "preprocessor_config.json", [](nlohmann::json& c) {
                c["min_pixels"] = 9000;
                c["max_pixels"] = 100;
              }));
            }).find("min_pixels 9000 exceeds max_pixels 100"),
            std::string::npos);
}

// Every method runs on a Qwen2-VL prompt (the image pad tokens are the visual segment, the vision
// start and end tokens text); the checkpoint's chat template, its <|image_pad|> marked <image>,
// is the fixture's template; the Model panel's facts.
TEST(Qwen2VL, EveryMethodCompressesTheImageTokens) {
  kt::expect_every_method_runs(kBf16);
  const std::unique_ptr<Model> model = load_model(kBf16);
  const ModelInfo& f = model->info();
  EXPECT_EQ(f.architecture, "qwen2_vl");
  EXPECT_TRUE(f.image_dependent);
  EXPECT_EQ(f.tiling.substr(0, f.tiling.find(';')), "2×2 of 4-px patches") << f.tiling;
}

// Qwen2.5-VL's windows (HF get_vision_window_index) on a 3×5 grid of merge blocks in windows of
// 2×2: windows row by row, a window's blocks row by row, partial windows at the right and bottom.
TEST(Qwen2VL, WindowsCoverTheGridRowByRow) {
  const VisionWindows w = vision_windows(3, 5, 2);
  EXPECT_EQ(w.order, (std::vector<int>{0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14}));
  EXPECT_EQ(w.sizes, (std::vector<int>{4, 4, 2, 2, 2, 1}));
  const VisionWindows whole = vision_windows(4, 4, 4);  // one window: the grid's order
  EXPECT_EQ(whole.sizes, (std::vector<int>{16}));
  EXPECT_TRUE(std::is_sorted(whole.order.begin(), whole.order.end()));
  const std::unique_ptr<Model> model = load_model(k25);
  EXPECT_EQ(model->info().architecture, "qwen2_5_vl");
  auto cfg_edit = [](const std::string& tag, const std::function<void(nlohmann::json&)>& e) {
    return edited_copy(k25, tag, "config.json", e);
  };
  EXPECT_NE(error_of([&] { load_model(cfg_edit("window", [](nlohmann::json& c) { c["vision_config"]["window_size"] = 30; })); })
                .find("window_size 30 is not a whole number of merged patches (12 pixels)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_model(cfg_edit("full", [](nlohmann::json& c) { c["vision_config"]["fullatt_block_indexes"] = {1, 9}; }));
            }).find("fullatt_block_indexes[1]"),
            std::string::npos);
}
