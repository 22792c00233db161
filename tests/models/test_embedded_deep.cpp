// The deeper embedded model (assets/models/kvlens-scenes-14m, trained on rich scenes: generator
// version 2, 336 px): greedy output equal to HF transformers' on held-out rich scenes (recorded on
// the GPU machine by train_embedded.py --hf-outputs into tests/fixtures/embedded_deep), and
// caption / VQA quality on held-out rich scenes measured with kvlens's own runner. Where the model
// or the recording is missing these tests fail, naming the missing path.
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/data/scenes.h"
#include "core/eval/eval_table.h"
#include "app/lab/eval_runner.h"
#include "models/model.h"
#include "tests/hf_recorded.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {

const std::string kDeepModel = kt::source_dir() + "/assets/models/kvlens-scenes-14m";
const std::string kDeepRecording = kt::source_dir() + "/tests/fixtures/embedded_deep/hf_greedy.json";
constexpr uint64_t kHeldoutSeed = 1000001;  // never used in training

const Model& deep_model() { return kt::shared_embedded_model(kDeepModel); }
const nlohmann::json& deep_outputs() { return kt::shared_recording(kDeepRecording); }

}  // namespace

// 16 of each by default; KVLENS_HF_SPOTCHECK=N checks the first N recorded generations.
TEST(EmbeddedDeep, CaptionsMatchTransformers) {
  kt::check_recorded_generations(deep_model(), deep_outputs(), "captions", kt::hf_spotcheck_count());
}
TEST(EmbeddedDeep, AnswersMatchTransformers) {
  kt::check_recorded_generations(deep_model(), deep_outputs(), "questions", kt::hf_spotcheck_count());
}

TEST(EmbeddedDeep, HeldOutQuality) {
  // 20 held-out rich scenes (336 px), their captions and first questions; the model card reports
  // the whole held-out set.
  const Model& m = deep_model();  // first, so that a missing model fails before the set is written
  const std::string dir = kt::make_temp_dir("heldout_deep") + "/set";
  SceneOptions rich;
  rich.version = kRichScenes;
  write_scene_set(dir, 20, kHeldoutSeed, false, rich);
  EvalDataset ds = load_eval_dataset(dir);
  // Each question is a prefill of 589 tokens: one a scene keeps the test short (under the
  // sanitizers too); the card reports all 2 949.
  std::set<int64_t> asked;
  std::vector<CocoQuestion> first;
  for (const CocoQuestion& q : ds.questions)
    if (asked.insert(q.image_id).second) first.push_back(q);
  ds.questions = first;
  const std::vector<EvalVariant> full = expand_variants({}, {}, nullptr);
  const std::vector<size_t> all = shard_positions(ds.images.size(), 0, Shard{});
  const auto records = run_eval(m, ds, all, full, EvalSettings{}, "embedded-deep", "");
  const EvalTable t = build_eval_table(ds, all, full, records, true, nullptr, "not needed");
  ASSERT_EQ(t.rows.size(), 1u);
  const EvalRow& r = t.rows[0];
  EXPECT_EQ(t.images, 20u);
  // The model card's rates over 500 scenes are 94.0 % captions and 98.0 % VQA; these 20 give 18
  // captions and 19 answers (kvlens CPU runner). The floors leave one more miss each.
  EXPECT_GE(r.caption_exact, 17u) << t.to_json().dump();
  EXPECT_EQ(r.questions, 20u);
  EXPECT_GE(r.vqa_accuracy().value_or(0), 0.9) << t.to_json().dump();
}
