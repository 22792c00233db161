// The embedded default model: greedy output equal to HF transformers' on held-out scenes
// (recorded on the GPU machine by assets/models/kvlens-scenes-6m/train_embedded.py), and caption / VQA quality on
// held-out scenes measured with kvlens's own runner.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/data/scenes.h"
#include "core/eval/eval_table.h"
#include "core/compress/method.h"
#include "app/lab/eval_runner.h"
#include "models/model.h"
#include "tests/policy_probe.h"
#include "tests/hf_recorded.h"
#include "tests/test_util.h"
#include "tests/captured_attention_check.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {

const std::string kModel = kt::source_dir() + "/assets/models/kvlens-scenes-6m";
constexpr uint64_t kHeldoutSeed = 1000001;  // never used in training (seed 1)

const Model& model() { return kt::shared_embedded_model(kModel); }
// The recording: all 64 + 64 generations agree (KVLENS_HF_SPOTCHECK=64).
const nlohmann::json& hf_outputs() {
  return kt::shared_recording(kt::source_dir() + "/tests/fixtures/embedded/hf_greedy.json");
}

}  // namespace

// 16 of each by default; KVLENS_HF_SPOTCHECK=64 checks every recorded generation.
TEST(Embedded, CaptionsMatchTransformers) {
  kt::check_recorded_generations(model(), hf_outputs(), "captions", kt::hf_spotcheck_count());
}
TEST(Embedded, AnswersMatchTransformers) {
  kt::check_recorded_generations(model(), hf_outputs(), "questions", kt::hf_spotcheck_count());
}

TEST(Embedded, SampleImageCaptionIsTheCanonicalReference) {
  // The sample image comes from the generator (seed 20261122, index 0): the caption must be
  // that scene's canonical reference.
  const Scene sc = generate_scene(20261122, 0);
  const RGBImage img = load_image(kt::source_dir() + "/assets/images/scene_000.png");
  ASSERT_EQ(img.data, sc.image.data);
  const DecodeResult r = model().decode(model().prefill(img, kDefaultPrompt, kDefaultTemplate, false), nullptr, {});
  EXPECT_EQ(r.text, sc.captions[0]);
}

TEST(Embedded, NoNewTokensAskedGivesAnEmptyCaption) {
  const RGBImage img = load_image(kt::source_dir() + "/assets/images/scene_000.png");
  const PrefillState st = model().prefill(img, kDefaultPrompt, kDefaultTemplate, false);
  for (int n : {0, -3}) {
    GenerateOptions g;
    g.max_new_tokens = n;
    const DecodeResult r = model().decode(st, nullptr, g);
    EXPECT_TRUE(r.generated_ids.empty()) << "max_new_tokens " << n;
    EXPECT_TRUE(r.chosen_probs.empty()) << "max_new_tokens " << n;
    EXPECT_EQ(r.text, "") << "max_new_tokens " << n;
  }
  GenerateOptions one;
  one.max_new_tokens = 1;
  one.stop_at_eos = false;
  EXPECT_EQ(model().decode(st, nullptr, one).generated_ids.size(), 1u);
}

TEST(Embedded, HeldOutQuality) {
  // A slice of the held-out set; the model card reports the whole 500-image set.
  const std::string dir = kt::make_temp_dir("heldout") + "/set";
  write_scene_set(dir, 30, kHeldoutSeed, false, {});
  const EvalDataset ds = load_eval_dataset(dir);
  const std::vector<EvalVariant> full = expand_variants({}, {}, nullptr);
  const std::vector<size_t> all = shard_positions(ds.images.size(), 0, Shard{});
  const auto records = run_eval(model(), ds, all, full, EvalSettings{}, "embedded", "");
  const EvalTable t = build_eval_table(ds, all, full, records, true, nullptr, "not needed");
  ASSERT_EQ(t.rows.size(), 1u);
  const EvalRow& r = t.rows[0];
  EXPECT_EQ(t.images, 30u);
  EXPECT_GE(r.caption_exact, 26u) << t.to_json().dump();
  EXPECT_GT(r.questions, 60u);
  EXPECT_GE(r.vqa_accuracy().value_or(0), 0.85) << t.to_json().dump();
}

// A prefill-only method decodes without its decode hook and without host work a step, to the
// same tokens, logits and cache bytes as when the loop keeps the host rows and calls the hook
// once a layer and forward.
TEST(Embedded, PrefillOnlyMethodsDecodeWithoutTheHookToTheSameResult) {
  const RGBImage img = load_image(kt::source_dir() + "/assets/images/scene_000.png");
  const PrefillState st = model().prefill(img, kDefaultPrompt, kDefaultTemplate, true);
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.stop_at_eos = false;
  g.keep_step_logits = true;
  const int layers = model().info().n_layers;
  for (const char* spec : {"calibquant:bits=1", "calibquant:bits=2", "snapkv", "stack"}) {
    SCOPED_TRACE(spec);
    kt::PolicyProbe host(make_policy(spec), true), inert(make_policy(spec), false);
    const DecodeResult a = model().decode(st, &host, g);
    const DecodeResult b = model().decode(st, &inert, g);
    EXPECT_EQ(host.decode_calls, layers * (g.max_new_tokens - 1));
    EXPECT_EQ(inert.decode_calls, 0);
    EXPECT_FALSE(a.chained || b.chained);  // the CPU backend runs each step after the last
    EXPECT_EQ(b.generated_ids, a.generated_ids);
    EXPECT_EQ(b.step_logits, a.step_logits);
    EXPECT_EQ(b.bytes_after_prefill.total(), a.bytes_after_prefill.total());
    EXPECT_EQ(b.bytes_final.total(), a.bytes_final.total());
  }
}

// The research path's capture: each layer's attention recomputed on demand, equal to the
// prefill's, from queries, keys and values only.
TEST(Embedded, CapturedAttentionIsThePrefillsAttention) {
  kt::check_captured_attention(model(), load_image(kt::source_dir() + "/assets/images/scene_000.png"), "cpu");
}

// A recording names its scenes by "heldout_info" (seed, size, version of the set's info block),
// else by "heldout_seed" (classic scenes), else classic scenes of seed 1000001; the 6m recording
// restated with an info block checks the same.
TEST(Embedded, RecordingsNameTheirScenes) {
  const auto rich = kt::recorded_scenes(
      {{"heldout_info", {{"generator", "kvlens scenes"}, {"seed", 7}, {"n", 5}, {"size", 336}, {"version", 2}}}});
  EXPECT_EQ(rich.seed, 7u);
  EXPECT_EQ(rich.opts.version, kRichScenes);
  EXPECT_EQ(rich.opts.size, 336);
  const auto classic = kt::recorded_scenes({{"heldout_info", {{"seed", 9}, {"n", 5}, {"size", 256}}}});
  EXPECT_EQ(classic.seed, 9u);
  EXPECT_EQ(classic.opts.version, kClassicScenes);
  EXPECT_EQ(kt::recorded_scenes({{"heldout_seed", 5}}).seed, 5u);
  EXPECT_EQ(kt::recorded_scenes(nlohmann::json::object()).seed, kt::kDefaultHeldoutSeed);
  nlohmann::json rec = hf_outputs();
  rec.erase("heldout_seed");
  rec["heldout_info"] = {{"generator", "kvlens scenes"}, {"seed", kHeldoutSeed}, {"n", 500}, {"size", 256}};
  kt::check_recorded_generations(model(), rec, "captions", 2);
  const std::string missing = kt::source_dir() + "/tests/fixtures/embedded/no_such.json";
  try {
    kt::load_recording(missing);
    ADD_FAILURE() << "a missing recording loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
}
