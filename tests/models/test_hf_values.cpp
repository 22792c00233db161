// Values, not only ids, against HF transformers for each parity fixture (tests/fixtures/hf,
// recorded by tests/make_hf_fixtures.py): the CLIP-preprocessed pixel values, the projected
// image features that replace the image tokens, and the logits of every greedy decode step.
#include <gtest/gtest.h>

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/data/image.h"
#include "models/preprocess/clip_image.h"
#include "models/model.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {


nlohmann::json expected(const std::string& dir) {
  std::ifstream f(dir + "/expected.json");
  return nlohmann::json::parse(f);
}

// A recorded float32 array with the shape expected.json gives it.
std::vector<float> recorded(const std::string& dir, const nlohmann::json& exp, const std::string& what) {
  const std::vector<float> v = kt::read_f32(dir + "/" + exp[what + "_file"].get<std::string>());
  size_t n = 1;
  for (const auto& d : exp[what + "_shape"]) n *= d.get<size_t>();
  EXPECT_EQ(v.size(), n) << what;
  return v;
}


// max |ours − ref| / max |ref|: the criterion test_parity uses for the first-step logits.
double rel_max_diff(const float* ours, const std::vector<float>& ref, size_t off, size_t n) {
  double d = 0, m = 0;
  for (size_t i = 0; i < n; ++i) {
    d = std::max(d, std::fabs(static_cast<double>(ours[i]) - ref[off + i]));
    m = std::max(m, std::fabs(static_cast<double>(ref[off + i])));
  }
  return d / m;
}

class HfValues : public ::testing::TestWithParam<std::string> {};

}  // namespace

// The processor's pixel values (CLIPImageProcessor; LlavaNextImageProcessor's whole image and
// tiles), within kt::pixel_tolerance.
TEST_P(HfValues, PixelValues) {
  const std::string dir = GetParam();
  const auto exp = expected(dir);
  const std::unique_ptr<Model> model_owned = load_model(dir);
  const Model& model = *model_owned;
  if (exp.value("text_only", false)) {  // no processor: an image is refused, naming the folder
    EXPECT_FALSE(model.info().takes_image());
    const RGBImage img = load_image(kt::source_dir() + "/assets/images/scene_000.png");
    EXPECT_THROW(model.pixel_values(img), InputError);
    EXPECT_THROW(model.prefill(img, "x", "{prompt}", false), InputError);
    return;
  }
  const Tensor pv = model.pixel_values(load_image(dir + "/image.png"));
  const std::vector<float> ref = recorded(dir, exp, "pixel_values");
  // [3][S][S], or [1 + tiles][3][S][S] for LLaVA-NeXT (the whole image, then each tile).
  ASSERT_EQ(pv.shape, exp["pixel_values_shape"].get<std::vector<int64_t>>()) << pv.shape_str();
  ASSERT_EQ(pv.data.size(), ref.size());
  const int64_t plane = pv.dim(-1) * pv.dim(-2);
  const PreprocessConfig& pc = model.preprocess_config();
  for (size_t i = 0; i < ref.size(); ++i) {
    const int c = static_cast<int>(i / plane % 3);
    const double tol = kt::pixel_tolerance(ref[i], pc.mean[c], pc.std[c]);
    ASSERT_LE(std::fabs(pv.data[i] - ref[i]), tol) << dir << " value " << i;
  }
}

// The projector output for HF's own pixel values (so the vision tower and projector are tested
// on their own), and for kvlens's pixel values (the whole image path), against
// image_hidden_states: max |diff| ≤ 1e-4·max |ref|, as for the logits.
TEST_P(HfValues, ImageFeatures) {
  const std::string dir = GetParam();
  const auto exp = expected(dir);
  const std::unique_ptr<Model> model_owned = load_model(dir);
  const Model& model = *model_owned;
  if (exp.value("text_only", false)) {  // no tower: its prompt has no visual tokens
    const PrefillState st = model.prefill(RGBImage{}, exp["prompt"].get<std::string>(), kt::hf_fixture_template(dir), false);
    EXPECT_EQ(st.n_visual, 0);
    EXPECT_TRUE(std::none_of(st.kinds.begin(), st.kinds.end(), [](SegmentKind k) { return k == SegmentKind::Visual; }));
    EXPECT_THROW(model.prefill(RGBImage{}, "x", kDefaultTemplate, false), InputError) << "a template with <image>";
    return;
  }
  const std::vector<float> ref = recorded(dir, exp, "image_features");
  const std::vector<float> pv_ref = recorded(dir, exp, "pixel_values");
  Tensor pv("pixel_values", exp["pixel_values_shape"].get<std::vector<int64_t>>());
  std::copy(pv_ref.begin(), pv_ref.end(), pv.ptr());
  const RGBImage img = load_image(dir + "/image.png");
  const VisualLayout layout = model.visual_layout(img.width, img.height);
  EXPECT_EQ(layout.n_tokens, exp["n_visual_tokens"].get<int>()) << "the processor's token count";
  for (const Tensor& input : {pv, model.pixel_values(img)}) {
    const Buffer fb = model.encode_image(input, layout).features;  // in the backend's memory
    Tensor f("image_features", fb.shape);
    model.backend().download(fb, f.ptr());
    ASSERT_EQ(f.shape, (std::vector<int64_t>{exp["image_features_shape"][0].get<int64_t>(),
                                              exp["image_features_shape"][1].get<int64_t>()}))
        << f.shape_str();
    ASSERT_EQ(f.data.size(), ref.size());
    const double r = rel_max_diff(f.ptr(), ref, 0, ref.size());
    EXPECT_LE(r, 1e-4) << dir;
    EXPECT_GT(r, 0.0) << dir << ": bit-identical to HF is unexpected; is the fixture being read?";
  }
}

// The logits that chose each of the recorded greedy tokens (the prefill's last position, then
// each decode step with the cached keys and values): max |diff| ≤ 1e-4·max |ref| per step.
// HF recorded them with an fp32 cache, so the decode keeps exact (fp32) rows here; kvlens's
// default fp16 rows move these logits by a few 1e-4 relative and keep HF's greedy ids
// (test_parity checks both storages).
TEST_P(HfValues, DecodeStepLogits) {
  const std::string dir = GetParam();
  const auto exp = expected(dir);
  const std::unique_ptr<Model> model_owned = load_model(dir);
  const Model& model = *model_owned;
  const PrefillState st = model.prefill(kt::hf_fixture_image(dir), exp["prompt"].get<std::string>(),
                                        kt::hf_fixture_template(dir), false);
  const std::vector<float> ref = recorded(dir, exp, "step_logits");
  const int steps = exp["step_logits_shape"][0].get<int>(), V = exp["step_logits_shape"][1].get<int>();
  GenerateOptions g;
  g.max_new_tokens = steps;
  g.stop_at_eos = false;
  g.keep_step_logits = true;
  g.kv_storage = RowStorage::Fp32;
  const DecodeResult r = model.decode(st, nullptr, g);
  ASSERT_EQ(r.generated_ids, exp["greedy_ids"].get<std::vector<int>>()) << "a different trajectory";
  ASSERT_EQ(r.step_logits.size(), static_cast<size_t>(steps));
  EXPECT_EQ(r.step_logits[0], r.first_logits);
  for (int s = 0; s < steps; ++s) {
    ASSERT_EQ(r.step_logits[s].size(), static_cast<size_t>(V));
    EXPECT_LE(rel_max_diff(r.step_logits[s].data(), ref, static_cast<size_t>(s) * V, V), 1e-4) << dir << " step " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfValues, ::testing::ValuesIn(kt::hf_fixture_dirs()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param.substr(i.param.rfind('/') + 1);
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HfValues);
