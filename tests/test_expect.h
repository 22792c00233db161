// GoogleTest helpers the model and tokenizer suites share: an InputError expected with a message
// part, the message of one, a fixture folder copied with one JSON file edited, a fixture's
// processor cases (processor_cases.json: images, HF's pixel values and token counts) checked, and
// every method run on a fixture's prompt.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/compress/method.h"
#include "core/errors.h"
#include "models/model.h"
#include "tests/test_util.h"

namespace kvlens::testing {

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

// Every method on the prompt of image fixture `dir` (its visual segment: the image's tokens, as
// many as HF's processor gives), three tokens each; and the checkpoint's chat template, its image
// token marked <image>, is the fixture's template.
inline void expect_every_method_runs(const std::string& dir) {
  const std::unique_ptr<Model> model = load_model(dir);
  const RGBImage img = load_image(dir + "/image.png");
  const nlohmann::json exp = read_json(dir + "/expected.json");
  const PrefillState st = model->prefill(img, exp["prompt"].get<std::string>(), exp["template"].get<std::string>(), true);
  EXPECT_EQ(st.n_visual, exp["n_visual_tokens"].get<int>());
  EXPECT_EQ(std::count(st.kinds.begin(), st.kinds.end(), SegmentKind::Visual), st.n_visual);
  EXPECT_EQ(st.ids, exp["prompt_ids"].get<std::vector<int>>());
  GenerateOptions g;
  g.max_new_tokens = 3;
  for (const MethodSpec& m : methods()) {
    SCOPED_TRACE(m.name);
    const std::unique_ptr<KVPolicy> policy = make_policy(parse_method_spec(m.name));
    EXPECT_EQ(model->decode(st, policy.get(), g).generated_ids.size(), 3u);
  }
  EXPECT_EQ(model->tokenizer().chat_prompt(true), exp["template"].get<std::string>());
}

}  // namespace kvlens::testing
