// Parity with HF transformers: for each checkpoint under tests/fixtures/hf (built and recorded
// by tests/make_hf_fixtures.py), the CPU runner must reproduce HF's prompt ids, greedy ids,
// first-step logits and layer-0 attention probabilities.
//
// HF's greedy ids were recorded with an fp32 cache. kvlens's full-cache caption stores the
// decode cache as fp16 by default (rows rounded to half precision, like the papers' full
// cache); both that default and the exact (fp32) cache must give HF's ids.
#include <gtest/gtest.h>

#include <dirent.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/data/image.h"
#include "models/model.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {


using kt::read_json;

class HfParity : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST(HfFixtures, Present) {
  // The fixtures are committed; their absence is a failure, not a skip.
  EXPECT_GE(kt::hf_fixture_dirs().size(), 5u);
}

TEST_P(HfParity, MatchesTransformers) {
  const std::string dir = GetParam();
  const auto exp = read_json(dir + "/expected.json");
  const std::unique_ptr<Model> model_owned = load_model(dir);
  const Model& model = *model_owned;
  const RGBImage img = kt::hf_fixture_image(dir);
  const std::string templ = kt::hf_fixture_template(dir);
  const PrefillState st = model.prefill(img, exp["prompt"].get<std::string>(), templ, true);

  EXPECT_EQ(st.n_visual, exp["n_visual_tokens"].get<int>());
  ASSERT_EQ(st.ids, exp["prompt_ids"].get<std::vector<int>>()) << dir;

  // First-step logits: max |ours − HF| relative to max |HF| ≤ 1e-4.
  const auto ref = kt::read_f32(dir + "/" + exp["logits_file"].get<std::string>());
  ASSERT_EQ(ref.size(), st.logits.size());
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(static_cast<double>(st.logits[i]) - ref[i]));
    max_ref = std::max(max_ref, std::abs(static_cast<double>(ref[i])));
  }
  EXPECT_LE(max_diff / max_ref, 1e-4) << dir << ": max diff " << max_diff << " of max " << max_ref;

  // Layer-0 attention probabilities [H][T][T] ≤ 1e-5 absolute.
  const auto attn = kt::read_f32(dir + "/" + exp["attn0_file"].get<std::string>());
  const auto held = st.capture.attention->probs(0);
  const std::vector<float>& ours = *held;
  ASSERT_EQ(attn.size(), ours.size());
  double max_attn = 0;
  for (size_t i = 0; i < attn.size(); ++i) max_attn = std::max(max_attn, std::abs(static_cast<double>(ours[i]) - attn[i]));
  EXPECT_LE(max_attn, 1e-5) << dir;

  // Greedy ids, no stopping at EOS (HF's were recorded the same way).
  const auto greedy = exp["greedy_ids"].get<std::vector<int>>();
  for (const RowStorage rows : {RowStorage::Fp16, RowStorage::Fp32}) {
    GenerateOptions opt;
    opt.max_new_tokens = static_cast<int>(greedy.size());
    opt.stop_at_eos = false;
    opt.kv_storage = rows;
    const DecodeResult r = model.decode(st, nullptr, opt);
    EXPECT_EQ(r.generated_ids, greedy) << dir << " with " << row_storage_name(rows) << " KV rows";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfParity, ::testing::ValuesIn(kt::hf_fixture_dirs()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param.substr(i.param.rfind('/') + 1);
                         });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(HfParity);
