// GoogleTest helpers the model and tokenizer suites share: an InputError expected with a message
// part, the message of one, a fixture folder copied with one JSON file edited, and a fixture's
// processor cases (processor_cases.json: images, HF's pixel values and token counts) checked.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "models/model.h"
#include "tests/test_util.h"

namespace kvlens::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

inline void expect_input_error(const std::function<void()>& f, const std::string& must_contain) {
  try {
    f();
    ADD_FAILURE() << "expected InputError containing '" << must_contain << "'";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(must_contain), std::string::npos) << e.what();
  }
}

// A copy of fixture folder `from` (under a temporary folder named by `tag`) with `file` edited.
inline std::string edited_copy(const std::string& from, const std::string& tag, const std::string& file,
                               const std::function<void(nlohmann::json&)>& edit) {
  const std::string dir = make_temp_dir(tag) + "/model";
  std::filesystem::copy(from, dir, std::filesystem::copy_options::recursive);
  nlohmann::json j = read_json(dir + "/" + file);
  edit(j);
  write_file(dir + "/" + file, j.dump(2));
  return dir;
}

// Each image of `dir`/processor_cases.json through the model's processor: HF's token count and
// pixel values within pixel_tolerance.
inline void expect_processor_cases(const std::string& dir) {
  const std::unique_ptr<Model> model = load_model(dir);
  const PreprocessConfig& pc = model->preprocess_config();
  const nlohmann::json cases = read_json(dir + "/processor_cases.json");
  ASSERT_GE(cases.size(), 6u);
  for (const auto& c : cases) {
    SCOPED_TRACE(dir + " " + c["image"].get<std::string>());
    const RGBImage img = load_image(dir + "/" + c["image"].get<std::string>());
    EXPECT_EQ(model->visual_layout(img.width, img.height).n_tokens, c["n_visual_tokens"].get<int>());
    const Tensor pv = model->pixel_values(img);
    ASSERT_EQ(pv.shape, c["pixel_values_shape"].get<std::vector<int64_t>>()) << pv.shape_str();
    const std::vector<float> ref = read_f32(dir + "/" + c["pixel_values_file"].get<std::string>());
    ASSERT_EQ(pv.data.size(), ref.size());
    // Channel planes [..][3][H][W], or Qwen2-VL's patches [patches][3 · frames · P · P].
    const bool patches = pv.shape.size() == 2;
    const int64_t plane = pv.dim(-1) * pv.dim(-2), row = pv.dim(-1);
    for (size_t i = 0; i < ref.size(); ++i) {
      const int ch = static_cast<int>(patches ? i % row / (row / 3) : i / plane % 3);
      ASSERT_LE(std::fabs(pv.data[i] - ref[i]), pixel_tolerance(ref[i], pc.mean[ch], pc.std[ch])) << "value " << i;
    }
  }
}

}  // namespace kvlens::testing
