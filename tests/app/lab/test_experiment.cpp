// Methods end to end on fixture checkpoints, with every diagnostic against the full cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "core/diagnostics/diagnostics.h"
#include "core/errors.h"
#include "core/compress/method.h"
#include "app/lab/experiment.h"
#include "app/lab/memory_plan.h"
#include "tests/recorder_check.h"
#include "tests/test_util.h"

using namespace kvlens;
namespace kt = kvlens::testing;

namespace {

struct Fixture {
  std::unique_ptr<Model> owned;
  RGBImage image;
  const Model& model;
};

const Fixture& fixture(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Fixture>> cache;
  auto& f = cache[name];
  if (!f) {
    const std::string dir = kt::source_dir() + "/tests/fixtures/hf/" + name;
    std::unique_ptr<Model> m = load_model(dir);
    const Model& ref = *m;
    f.reset(new Fixture{std::move(m), load_image(dir + "/image.png"), ref});
  }
  return *f;
}

ExperimentOptions small_options() {
  ExperimentOptions o;
  o.max_new_tokens = 6;
  o.diag_steps = 3;
  o.hit_steps = {0, 2};
  return o;
}

}  // namespace

void expect_same_attention(const DecodeRecorder& a, const DecodeRecorder& b) {
  ASSERT_EQ(a.entries().size(), b.entries().size());
  for (size_t i = 0; i < a.entries().size(); ++i) {
    EXPECT_EQ(a.entries()[i].probs, b.entries()[i].probs);  // bit-identical
    EXPECT_EQ(a.entries()[i].scores, b.entries()[i].scores);
  }
}

TEST(Experiment, FullPolicyIsBitIdenticalToNoPolicy) {
  const Fixture& f = fixture("gqa_fp16_save");
  const PrefillState st = f.model.prefill(f.image, kDefaultPrompt, kDefaultTemplate, false);
  GenerateOptions g;  // the run's row storage: fp16 (the default)
  g.max_new_tokens = 6;
  g.stop_at_eos = false;
  ASSERT_EQ(g.kv_storage, RowStorage::Fp16);
  DecodeRecorder a(6), b(6), c(6), d(6);
  // `full` stores rows as the run does.
  const DecodeResult none16 = f.model.decode(st, nullptr, g, {&a});
  const DecodeResult full16 = f.model.decode(st, make_policy("full").get(), g, {&b});
  EXPECT_EQ(none16.generated_ids, full16.generated_ids);
  expect_same_attention(a, b);
  // full:storage=fp32 asks for exact rows in an fp16 run: the same as an fp32 run.
  const DecodeResult full32 = f.model.decode(st, make_policy("full:storage=fp32").get(), g, {&c});
  GenerateOptions e = g;
  e.kv_storage = RowStorage::Fp32;
  const DecodeResult none32 = f.model.decode(st, nullptr, e, {&d});
  EXPECT_EQ(none32.generated_ids, full32.generated_ids);
  expect_same_attention(c, d);
  // 2 bytes a value against 4, the same int32 positions.
  KVBytes fp16;
  for (int l = 0; l < st.store.n_layers(); ++l)
    for (const KVSegment& s : st.store.layer(l).segments) fp16 += s.dense_bytes(st.store.head_dim(), 2);
  EXPECT_EQ(full16.bytes_after_prefill.total(), fp16.total());
  EXPECT_EQ(full32.bytes_after_prefill.codes, 2 * full16.bytes_after_prefill.codes);
  EXPECT_EQ(full32.bytes_after_prefill.indices, full16.bytes_after_prefill.indices);
}

// An observer reads the decode steps it asks for (decode_steps) and the rows only when it says it
// reads them (reads_decode_kv); what it is handed is the same as what an observer of every step
// with rows gets, and observing changes no token.
TEST(Experiment, ObserversSeeTheStepsAndRowsTheyAskFor) {
  struct Counter : AttentionObserver {
    std::vector<int> steps;
    int with_rows = 0;
    void on_attention(const AttentionEvent& e) override {
      if (e.phase != Phase::Decode) return;
      if (e.layer == 0) steps.push_back(e.step);
      with_rows += e.k && e.v;
    }
  };
  const Fixture& f = fixture("gqa_fp16_save");
  const PrefillState st = f.model.prefill(f.image, kDefaultPrompt, kDefaultTemplate, false);
  GenerateOptions g;
  g.max_new_tokens = 6;
  g.stop_at_eos = false;
  const DecodeResult plain = f.model.decode(st, nullptr, g);
  DecodeRecorder all(100), two(2), probs_only(3, false);
  Counter every;
  const DecodeResult seen = f.model.decode(st, nullptr, g, {&all, &two, &probs_only, &every});
  EXPECT_EQ(seen.generated_ids, plain.generated_ids);
  const int L = st.store.n_layers(), forwards = g.max_new_tokens - 1;  // the first token comes from prefill
  EXPECT_EQ(every.steps, (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(every.with_rows, L * forwards);
  EXPECT_EQ(all.steps(), forwards);
  EXPECT_EQ(two.steps(), 2);
  EXPECT_EQ(static_cast<int>(two.entries().size()), 2 * L);
  EXPECT_EQ(probs_only.steps(), 3);
  for (const DecodeRecorder* r : {&two, &probs_only}) kvlens::testing::expect_events_of(*r, all);
  // Diagnostics need the rows: a recorder without them is refused, not read as empty.
  EXPECT_THROW(compare_layers(PrefillView{&st.store, nullptr, &st.kinds, 0, static_cast<int>(st.ids.size())},
                              probs_only, st.store, 8, 0.01),
               InternalError);
}

// A recorder told to read a few steps (record_only) is handed exactly those, the same events as
// an observer of every step gets, and the steps between change no token. The experiment's full
// recorder reads the diagnostic steps and the hit-rate steps alone, and the full cache's decode
// sparsity averages the diagnostic steps, as a method's does.
TEST(Experiment, RecordersReadOnlyTheStepsTheyName) {
  const Fixture& f = fixture("gqa_fp16_save");
  const PrefillState st = f.model.prefill(f.image, kDefaultPrompt, kDefaultTemplate, false);
  GenerateOptions g;
  g.max_new_tokens = 7;
  g.stop_at_eos = false;
  const DecodeResult plain = f.model.decode(st, nullptr, g);
  DecodeRecorder all(100), picked(5, false), with_rows(6);
  picked.record_only({1, 3});
  with_rows.record_only({4});
  EXPECT_THROW(DecodeRecorder(3).record_only({3}), InternalError);
  EXPECT_EQ(f.model.decode(st, nullptr, g, {&all}).generated_ids, plain.generated_ids);
  EXPECT_EQ(f.model.decode(st, nullptr, g, {&picked, &with_rows}).generated_ids, plain.generated_ids);
  const int L = st.store.n_layers();
  std::set<int> steps;
  for (const auto& e : picked.entries()) steps.insert(e.step);
  EXPECT_EQ(steps, (std::set<int>{1, 3}));
  EXPECT_EQ(static_cast<int>(picked.entries().size()), 2 * L);
  ASSERT_EQ(static_cast<int>(with_rows.entries().size()), L);
  EXPECT_EQ(with_rows.entries().front().step, 4);
  kvlens::testing::expect_events_of(picked, all);
  kvlens::testing::expect_events_of(with_rows, all);

  ExperimentOptions opt = small_options();
  opt.max_new_tokens = 8;
  opt.diag_steps = 2;
  opt.hit_steps = {0, 5};
  const Experiment ex = start_experiment(f.model, f.image, opt);
  steps.clear();
  for (const auto& e : ex.full_recorder->entries()) steps.insert(e.step);
  EXPECT_EQ(steps, (std::set<int>{0, 1, 5}));
  for (int l = 0; l < L; ++l) {
    double s = 0;
    for (int step = 0; step < opt.diag_steps; ++step) {
      const auto* e = ex.full_recorder->find(step, l);
      ASSERT_NE(e, nullptr);
      s += sparsity(e->probs.data(), e->n_heads, 1, e->n_k, opt.sparsity_p);
    }
    EXPECT_DOUBLE_EQ(ex.sparsity_decode_full[static_cast<size_t>(l)], s / opt.diag_steps) << "layer " << l;
  }
}

TEST(Experiment, FullCacheHasZeroErrorAndIdenticalHistograms) {
  // With exact (fp32) rows the full cache is the prefill the diagnostics compare against.
  const Fixture& f = fixture("mha_fp32_hub");
  ExperimentOptions opt = small_options();
  opt.kv_storage = RowStorage::Fp32;
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const MethodRun r = run_method(f.model, ex, parse_method_spec("full"), opt);
  EXPECT_EQ(r.result.generated_ids, ex.full.generated_ids);
  EXPECT_EQ(r.divergence.position, -1);
  for (const auto& d : r.layers) {
    EXPECT_LT(d.softmax_mse, 1e-12);
    EXPECT_LT(std::abs(d.softmax_kl), 1e-5);
    EXPECT_LT(d.output_rel_error, 1e-5);
    EXPECT_EQ(d.visual_scores.exact, d.visual_scores.quantized);
    EXPECT_EQ(d.visual_scores.exact, d.visual_scores.calibrated);
    const int64_t n = std::accumulate(d.visual_scores.exact.begin(), d.visual_scores.exact.end(), int64_t{0});
    // Every visual key of every head is counted once.
    EXPECT_EQ(n, static_cast<int64_t>(ex.prefill.n_visual) * f.model.info().n_heads);
    for (float k : d.fate_kept) EXPECT_EQ(k, 1.0f);
    for (float b : d.fate_bits) EXPECT_EQ(b, 32.0f);
  }
}

TEST(Experiment, Fp16FullCacheIsTheRatioOneReference) {
  // The default run stores rows as fp16: the reference and `full` are the same decode, at
  // compression 1.00 against the fp16 full cache, and differ from the exact prefill only by
  // half-precision rounding (relative error ≤ 2^-11 per key, so scores move by a few 1e-3).
  const Fixture& f = fixture("mha_fp32_hub");
  const ExperimentOptions opt = small_options();
  ASSERT_EQ(opt.kv_storage, RowStorage::Fp16);
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const MethodRun r = run_method(f.model, ex, parse_method_spec("full"), opt);
  EXPECT_EQ(r.result.generated_ids, ex.full.generated_ids);
  EXPECT_EQ(ex.full.bytes_after_prefill.total(), ex.full_fp16_bytes.total());
  EXPECT_DOUBLE_EQ(r.compression_vs_fp16, 1.0);
  const nlohmann::json j = experiment_json(f.model, ex, opt);
  EXPECT_DOUBLE_EQ(j["full"]["compression_vs_fp16"].get<double>(), 1.0);
  EXPECT_EQ(j["options"]["kv_storage"], "fp16");
  for (const auto& d : r.layers) {
    EXPECT_GT(d.softmax_mse, 0.0);   // rounded keys: not the exact prefill
    EXPECT_LT(d.softmax_mse, 1e-6);
    EXPECT_LT(d.output_rel_error, 1e-2);
    for (float b : d.fate_bits) EXPECT_EQ(b, 16.0f);
  }
  const MethodRun e = run_method(f.model, ex, parse_method_spec("full:storage=fp32"), opt);
  EXPECT_DOUBLE_EQ(e.compression_vs_fp16, ex.full_fp16_bytes.total() /
                                              static_cast<double>(e.result.bytes_after_prefill.total()));
  EXPECT_LT(e.compression_vs_fp16, 0.6);  // fp32 codes are twice the fp16 ones
  for (const auto& d : e.layers) EXPECT_LT(d.softmax_mse, 1e-12);
}

TEST(Experiment, EveryMethodRunsWithEveryDiagnostic) {
  for (const char* name : {"mha_fp32_hub", "gqa_fp16_save"}) {
    const Fixture& f = fixture(name);
    const ExperimentOptions opt = small_options();
    Experiment ex = start_experiment(f.model, f.image, opt);
    for (const MethodSpec& m : methods()) {
      ex.runs.push_back(run_method(f.model, ex, parse_method_spec(m.name), opt));
      const MethodRun& r = ex.runs.back();
      EXPECT_GT(r.result.bytes_after_prefill.total(), 0) << m.name;
      EXPECT_FALSE(r.result.generated_ids.empty()) << m.name;
      ASSERT_EQ(r.layers.size(), static_cast<size_t>(f.model.info().n_layers));
      for (const auto& d : r.layers) {
        EXPECT_GE(d.softmax_mse, 0.0) << m.name;
        EXPECT_TRUE(std::isfinite(d.softmax_kl)) << m.name;
        EXPECT_EQ(d.fate_kept.size(), static_cast<size_t>(ex.prefill.n_visual)) << m.name;
        EXPECT_FALSE(d.visual_scores.exact.empty()) << m.name;
      }
    }
    const nlohmann::json j = experiment_json(f.model, ex, opt);
    ASSERT_EQ(j["methods"].size(), methods().size());
    for (const auto& m : j["methods"]) {
      for (const char* key : {"caption", "generated_ids", "bytes_after_prefill", "compression_vs_fp16",
                              "timings_ms", "mean_softmax_mse", "first_divergence", "layers"})
        EXPECT_TRUE(m.contains(key)) << m["method"] << " lacks " << key;
      for (const auto& l : m["layers"])
        for (const char* key : {"softmax_mse", "softmax_kl", "attn_output_rel_error", "sparsity_decode",
                                "visual_score_histogram", "token_fate", "bytes"})
          EXPECT_TRUE(l.contains(key)) << m["method"] << " layer lacks " << key;
    }
    for (const char* key : {"sparsity_prefill", "sparsity_decode"}) EXPECT_TRUE(j["full"].contains(key));
    EXPECT_EQ(j["cache_hit_rate"]["rates"].size(), 5u);
    EXPECT_EQ(j["cache_hit_rate"]["rates_per_kv_head"].size(), 5u);
    EXPECT_TRUE(j["cache_hit_rate"].contains("definitions"));
  }
}

TEST(Experiment, ZipCacheRequantizesEveryGapGeneratedTokens) {
  // Algorithm 3 with a small gap: every 3 generated tokens are quantized (1 of 3 salient at 4
  // bits, 2 at 2 bits) once the next one arrives; with gap 100 they stay fp16 rows.
  const Fixture& f = fixture("mha_fp32_hub");
  ExperimentOptions opt = small_options();
  opt.max_new_tokens = 14;
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const MethodRun slow = run_method(f.model, ex, parse_method_spec("zipcache"), opt);
  const MethodRun fast = run_method(f.model, ex, parse_method_spec("zipcache:gap=3"), opt);
  EXPECT_EQ(fast.result.bytes_after_prefill.total(), slow.result.bytes_after_prefill.total());
  const ModelInfo& c = f.model.info();
  const int64_t KH = c.n_kv_heads, D = c.head_dim, L = c.n_layers;
  const int appended = static_cast<int>(fast.result.generated_ids.size()) - 1;  // the last token is not fed back
  ASSERT_EQ(appended, static_cast<int>(slow.result.generated_ids.size()) - 1) << "compare equal decode lengths";
  ASSERT_GE(appended, 7) << "needs at least two gaps";
  const int64_t gaps = (appended - 1) / 3;
  const int64_t dense = 3 * KH * (2 * D * 2);  // a gap's fp16 K and V codes (positions stay)
  auto packed = [](int64_t n, int b) { return (n * b + 7) / 8; };
  const int64_t per_head = packed(D, 4) + packed(2 * D, 2) + 8 * D +  // K streams + ranges per subset
                           packed(D, 4) + 2 * packed(D, 2) + 4 * D + 1;  // V codes, c per subset, flags
  // V token ranges (4 B each): one per token when the heads agree, up to two when they do not.
  const int64_t lo = per_head * KH + 4 * 3, hi = per_head * KH + 4 * 6;
  const int64_t saved = slow.result.bytes_final.total() - fast.result.bytes_final.total();
  EXPECT_GE(saved, L * gaps * (dense - hi)) << gaps << " gaps";
  EXPECT_LE(saved, L * gaps * (dense - lo)) << gaps << " gaps";
}

TEST(Experiment, EvictionShrinksBytesAndMarksFate) {
  const Fixture& f = fixture("mha_fp32_hub");
  const ExperimentOptions opt = small_options();
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const MethodRun r = run_method(f.model, ex, parse_method_spec("streamingllm:budget=0.2"), opt);
  EXPECT_GT(r.compression_vs_fp16, 1.0);
  // StreamingLLM keeps sinks + the most recent tokens; the visual tokens in the middle of the
  // prompt are gone in every layer.
  for (const auto& d : r.layers) {
    const float kept = std::accumulate(d.fate_kept.begin(), d.fate_kept.end(), 0.0f);
    EXPECT_LT(kept, static_cast<float>(d.fate_kept.size()));
    EXPECT_GT(d.softmax_mse, 0.0);
  }
}

TEST(Experiment, TokenFateReadsRowBitsAndMergeCounts) {
  const Fixture& f = fixture("mha_fp32_hub");
  const ExperimentOptions opt = small_options();
  const Experiment ex = start_experiment(f.model, f.image, opt);
  // ZipCache: every kept visual row is stored at low_bits or high_bits, never as fp32.
  const MethodRun z = run_method(f.model, ex, parse_method_spec("zipcache:high_bits=4,low_bits=2"), opt);
  for (const auto& d : z.layers) {
    ASSERT_EQ(d.fate_bits.size(), static_cast<size_t>(ex.prefill.n_visual));
    bool below_32 = false;
    for (size_t i = 0; i < d.fate_bits.size(); ++i) {
      EXPECT_EQ(d.fate_kept[i], 1.0f);
      EXPECT_GE(d.fate_bits[i], 2.0f) << i;
      EXPECT_LE(d.fate_bits[i], 4.0f) << i;
      below_32 = below_32 || d.fate_bits[i] < 32.0f;
    }
    EXPECT_TRUE(below_32);
    for (float m : d.fate_merged) EXPECT_EQ(m, 0.0f);
  }
  // LOOK-M (pivotal merging by default): kept visual rows absorbed evicted ones. The text prior
  // would rank every text token first; without it, visual tokens compete for N on attention.
  const MethodRun m = run_method(f.model, ex, parse_method_spec("lookm:alpha1=0.1,alpha2=0.5,text_prior=false"), opt);
  double max_mean = 0, kept = 0;
  for (const auto& d : m.layers) {
    double sum = 0;
    for (float x : d.fate_merged) sum += x;
    for (float x : d.fate_kept) kept += x;
    max_mean = std::max(max_mean, sum / std::max<size_t>(d.fate_merged.size(), 1));
    for (float b : d.fate_bits) EXPECT_TRUE(b == 0.0f || b == 16.0f) << b;  // 0: evicted everywhere; fp16 rows
  }
  EXPECT_GT(kept, 0.0);
  EXPECT_GT(max_mean, 0.0);
}

TEST(Diagnostics, SparsityOnAHandMadeMatrix) {
  // One head, causal 3×3: rows [1], [0.5 0.5], [0.9 0.095 0.005]. With p = 0.01 only 0.005 is
  // below 0.01·0.9, so 1 of the 6 visible entries counts as zero.
  const float probs[9] = {1, 0, 0, 0.5f, 0.5f, 0, 0.9f, 0.095f, 0.005f};
  EXPECT_NEAR(sparsity(probs, 1, 3, 3, 0.01), 1.0 / 6.0, 1e-12);
  EXPECT_NEAR(sparsity(probs, 1, 3, 3, 0.2), 2.0 / 6.0, 1e-12);
}

TEST(Diagnostics, FirstDivergence) {
  const auto d = first_divergence({5, 6, 7}, {0.9f, 0.8f, 0.7f}, {5, 6, 9}, {0.9f, 0.8f, 0.4f});
  EXPECT_EQ(d.position, 2);
  EXPECT_EQ(d.full_token, 7);
  EXPECT_EQ(d.method_token, 9);
  EXPECT_FLOAT_EQ(d.method_prob, 0.4f);
  EXPECT_EQ(first_divergence({1, 2}, {1, 1}, {1, 2}, {1, 1}).position, -1);
  EXPECT_EQ(first_divergence({1, 2}, {1, 1}, {1}, {1}).position, 1);
}

TEST(Diagnostics, RecencyHitRateMatchesDirectCount) {
  const Fixture& f = fixture("mha_fp32_hub");
  const ExperimentOptions opt = small_options();
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const HitRates& h = ex.hit_rates;
  ASSERT_EQ(h.strategies[4], "recency");
  const int T = static_cast<int>(ex.prefill.ids.size());
  for (size_t si = 0; si < h.steps.size(); ++si)
    for (int l = 0; l < ex.prefill.store.n_layers(); ++l) {
      // Direct: each head's attention over the prompt keys at this step (renormalised to sum
      // to 1), averaged over heads, its top-k, and how many of them are among the last k prompt
      // positions.
      const auto* e = ex.full_recorder->find(h.steps[si], l);
      ASSERT_NE(e, nullptr);
      std::vector<double> a(T, 0.0);
      const int G = e->n_heads / e->n_kv_heads;
      for (int hd = 0; hd < e->n_heads; ++hd) {
        double mass = 0;
        for (int j = 0; j < e->n_k; ++j)
          if (e->key_pos[(hd / G) * e->n_k + j] < T) mass += e->probs[hd * e->n_k + j];
        for (int j = 0; j < e->n_k; ++j) {
          const int p = e->key_pos[(hd / G) * e->n_k + j];
          if (p < T) a[p] += e->probs[hd * e->n_k + j] / mass / e->n_heads;
        }
      }
      std::vector<int> idx(T);
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int x, int y) { return a[x] > a[y]; });  // ties: earlier
      int hits = 0;
      for (int i = 0; i < h.k; ++i) hits += idx[i] >= T - h.k ? 1 : 0;
      EXPECT_DOUBLE_EQ(h.rates[4][si][l], static_cast<double>(hits) / h.k);
      // Per KV head: the same count on each head's group-mean attention, averaged over heads.
      double per_head = 0;
      for (int g = 0; g < e->n_kv_heads; ++g) {
        std::vector<double> b(T, 0.0);
        for (int hd = g * G; hd < (g + 1) * G; ++hd)
          for (int j = 0; j < e->n_k; ++j) {
            const int p = e->key_pos[g * e->n_k + j];
            if (p >= 0 && p < T) b[p] += e->probs[hd * e->n_k + j] / G;
          }
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int x, int y) { return b[x] > b[y]; });
        int hg = 0;
        for (int i = 0; i < h.k; ++i) hg += idx[i] >= T - h.k ? 1 : 0;
        per_head += static_cast<double>(hg) / h.k / e->n_kv_heads;
      }
      EXPECT_NEAR(h.rates_head[4][si][l], per_head, 1e-12);
    }
}

TEST(Experiment, BadSpecNamesMethodAndParameter) {
  try {
    parse_method_spec("calibquant:tau2=-1");
    FAIL();
  } catch (const InputError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("calibquant"), std::string::npos) << w;
    EXPECT_NE(w.find("tau2"), std::string::npos) << w;
  }
  const auto r = kt::run(kt::cli() + " run --model " + kt::source_dir() + "/tests/fixtures/hf/mha_fp32_hub --image " +
                         kt::source_dir() + "/tests/fixtures/hf/mha_fp32_hub/image.png --method 'vlcache:budget=7'");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("budget"), std::string::npos) << r.output;
}

TEST(Experiment, SeededSampling) {
  const Fixture& f = fixture("mha_fp32_hub");
  const PrefillState st = f.model.prefill(f.image, kDefaultPrompt, kDefaultTemplate, false);
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.stop_at_eos = false;
  g.temperature = 1.5f;
  g.seed = 7;
  const auto a = f.model.decode(st, nullptr, g).generated_ids;
  EXPECT_EQ(a, f.model.decode(st, nullptr, g).generated_ids);  // same seed, same tokens
  bool differs = false;
  for (uint64_t s = 8; s < 16 && !differs; ++s) {
    g.seed = s;
    differs = f.model.decode(st, nullptr, g).generated_ids != a;
  }
  EXPECT_TRUE(differs) << "eight other seeds all sampled the same 12 tokens at temperature 1.5";
  // A nucleus that holds only the top token is greedy decoding.
  g.top_p = 1e-6f;
  GenerateOptions greedy;
  greedy.max_new_tokens = 12;
  greedy.stop_at_eos = false;
  EXPECT_EQ(f.model.decode(st, nullptr, g).generated_ids, f.model.decode(st, nullptr, greedy).generated_ids);
}

TEST(Diagnostics, WindowStrategiesAgreeWhereTheyCoincide) {
  // A window of every prompt query is the accumulated strategy; a window of just the queries
  // after the last visual token is the post-vision strategy.
  const Fixture& f = fixture("mha_fp32_hub");
  const ExperimentOptions opt = small_options();
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const int T = static_cast<int>(ex.prefill.ids.size());
  int last_visual = 0;
  for (int t = 0; t < T; ++t)
    if (ex.prefill.kinds[t] == SegmentKind::Visual) last_visual = t;
  const HitRates all = cache_hit_rates(ex.view(), *ex.full_recorder, 0.2, {0, 2}, T);
  const HitRates post = cache_hit_rates(ex.view(), *ex.full_recorder, 0.2, {0, 2}, T - 1 - last_visual);
  EXPECT_EQ(all.rates[2], all.rates[0]);
  EXPECT_EQ(post.rates[2], post.rates[3]);
}

TEST(Diagnostics, CalibrationRecomputedFromStoredScoresMatchesADecode) {
  // The calibrated scores recomputed from the stored quantized scores by the policy's transform
  // equal what the softmax saw in the run; and at layer 0 (where the first decode step's query
  // does not depend on the cache) they equal a real re-run with other taus.
  const Fixture& f = fixture("mha_fp32_hub");
  const ExperimentOptions opt = small_options();
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const MethodRun a = run_method(f.model, ex, parse_method_spec("calibquant:bits=1,tau1=0,tau2=3"), opt);
  const MethodRun b = run_method(f.model, ex, parse_method_spec("calibquant:bits=1,tau1=1,tau2=0.5"), opt);
  auto expect_near = [](const VisualScores& x, const VisualScores& y, const char* what) {
    ASSERT_EQ(x.calibrated.size(), y.calibrated.size()) << what;
    for (size_t h = 0; h < x.calibrated.size(); ++h) {
      ASSERT_EQ(x.calibrated[h].size(), y.calibrated[h].size()) << what;
      for (size_t i = 0; i < x.calibrated[h].size(); ++i)
        EXPECT_NEAR(x.calibrated[h][i], y.calibrated[h][i], 1e-4 + 1e-5 * std::abs(y.calibrated[h][i]))
            << what << " head " << h << " key " << i;
    }
  };
  const auto pa = make_policy("calibquant:bits=1,tau1=0,tau2=3");
  const auto pb = make_policy("calibquant:bits=1,tau1=1,tau2=0.5");
  for (const auto& d : a.layers)
    expect_near(retransform_visual_scores(d.visual_score_samples, d.layer, *pa), d.visual_score_samples, "same taus");
  const VisualScores moved = retransform_visual_scores(a.layers[0].visual_score_samples, 0, *pb);
  expect_near(moved, b.layers[0].visual_score_samples, "layer 0, other taus");
  EXPECT_NE(moved.calibrated, a.layers[0].visual_score_samples.calibrated);
  // The histogram of the recomputed scores moves with the taus; exact and quantized stay.
  const ScoreHistogram before = visual_score_histogram(a.layers[0].visual_score_samples, -1, 40);
  const ScoreHistogram after = visual_score_histogram(moved, -1, 40);
  EXPECT_NE(before.calibrated, after.calibrated);
  EXPECT_EQ(before.exact, a.layers[0].visual_scores.exact);
  // One head: its own keys only.
  const ScoreHistogram h0 = visual_score_histogram(moved, 0, 40);
  EXPECT_EQ(std::accumulate(h0.quantized.begin(), h0.quantized.end(), int64_t{0}),
            static_cast<int64_t>(moved.quantized[0].size()));
  // No transform: calibrated = quantized.
  const auto none = make_policy("kivi");
  const VisualScores plain = retransform_visual_scores(a.layers[1].visual_score_samples, 1, *none);
  EXPECT_EQ(plain.calibrated, plain.quantized);
}

TEST(Diagnostics, ScoreHistogramsCompareTheKeysTheMethodHolds) {
  // The exact, quantized and calibrated samples of a head are of the same keys: after an
  // eviction the exact histogram leaves out the evicted visual keys (it would otherwise count
  // keys the quantized one cannot have); without one every visual key is in all three.
  const Fixture& f = fixture("mha_fp32_hub");
  const ExperimentOptions opt = small_options();
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const int n_visual = ex.prefill.n_visual;
  for (const char* spec : {"stack:evict=snapkv,quant=calibquant,budget=0.4,bits=1", "calibquant:bits=1"}) {
    SCOPED_TRACE(spec);
    const bool evicts = std::string(spec).rfind("stack", 0) == 0;
    const MethodRun r = run_method(f.model, ex, parse_method_spec(spec), opt);
    int fewer = 0;
    for (const LayerDiagnostics& d : r.layers) {
      const VisualScores& v = d.visual_score_samples;
      ASSERT_FALSE(v.exact.empty()) << "layer " << d.layer;
      for (size_t h = 0; h < v.exact.size(); ++h) {
        EXPECT_EQ(v.exact[h].size(), v.quantized[h].size()) << "layer " << d.layer << " head " << h;
        EXPECT_EQ(v.calibrated[h].size(), v.quantized[h].size()) << "layer " << d.layer << " head " << h;
        if (!evicts) {
          EXPECT_EQ(static_cast<int>(v.exact[h].size()), n_visual) << "layer " << d.layer << " head " << h;
        }
        fewer += static_cast<int>(v.exact[h].size()) < n_visual;
      }
      const ScoreHistogram all = visual_score_histogram(v, -1, 40);
      EXPECT_EQ(std::accumulate(all.exact.begin(), all.exact.end(), int64_t{0}),
                std::accumulate(all.quantized.begin(), all.quantized.end(), int64_t{0}))
          << "layer " << d.layer;
    }
    if (evicts) {
      EXPECT_GT(fewer, 0) << "the eviction left out visual keys";
    }
  }
  // A method that keeps no visual key: empty samples, yet bins over every visual key's exact
  // score; at layer 0, whose query the cache does not change, the full cache's range.
  const MethodRun none = run_method(f.model, ex, parse_method_spec("streamingllm:budget=0.02"), opt);
  const MethodRun full = run_method(f.model, ex, parse_method_spec("full"), opt);
  bool some_empty = false;
  for (size_t l = 0; l < none.layers.size(); ++l) {
    const VisualScores& v = none.layers[l].visual_score_samples;
    for (size_t h = 0; h < v.exact.size(); ++h) some_empty = some_empty || v.exact[h].empty();
    const ScoreHistogram& a = none.layers[l].visual_scores;
    const ScoreHistogram& b = full.layers[l].visual_scores;
    EXPECT_EQ(a.exact.size(), static_cast<size_t>(opt.hist_bins)) << "layer " << l;
    EXPECT_LT(a.lo, a.hi) << "layer " << l;
    if (l == 0) {  // (the full cache's own scores are float roundings of the exact ones)
      EXPECT_NEAR(a.lo, b.lo, 1e-3 * (1 + std::abs(b.lo)));
      EXPECT_NEAR(a.hi, b.hi, 1e-3 * (1 + std::abs(b.hi)));
    }
    EXPECT_LT(std::accumulate(a.exact.begin(), a.exact.end(), int64_t{0}),
              std::accumulate(b.exact.begin(), b.exact.end(), int64_t{0}));
  }
  EXPECT_TRUE(some_empty) << "a head that kept no visual key";
}

TEST(Experiment, KeepGoingCancelsBetweenDecodeSteps) {
  const Fixture& f = fixture("mha_fp32_hub");
  ExperimentOptions opt = small_options();
  const Experiment ex = start_experiment(f.model, f.image, opt);
  int asked = 0;
  opt.keep_going = [&](int done) {
    ++asked;
    return done < 2;
  };
  EXPECT_THROW(run_method(f.model, ex, parse_method_spec("kivi"), opt), Cancelled);
  EXPECT_EQ(asked, 3);  // before compression, after token 1, after token 2
  opt.keep_going = [](int) { return true; };
  const MethodRun r = run_method(f.model, ex, parse_method_spec("kivi"), opt);
  opt.keep_going = nullptr;
  EXPECT_EQ(r.result.generated_ids, run_method(f.model, ex, parse_method_spec("kivi"), opt).result.generated_ids);
}

TEST(Experiment, AttentionMapsAndPatchAttention) {
  const Fixture& f = fixture("gqa_fp16_save");
  ExperimentOptions opt = small_options();
  opt.attention_maps = true;
  const Experiment ex = start_experiment(f.model, f.image, opt);
  const int T = static_cast<int>(ex.prefill.ids.size()), S = ex.attention_steps, n = T + S;
  ASSERT_EQ(S, opt.diag_steps);
  ASSERT_EQ(ex.attention.size(), static_cast<size_t>(f.model.info().n_layers));
  for (const auto& m : ex.attention)
    for (int i = 0; i < n; ++i) {
      double sum = 0;
      for (int j = 0; j < n; ++j) {
        if (j > i) {
          EXPECT_EQ(m[static_cast<size_t>(i) * n + j], 0.0f) << i << "," << j;  // causal
        }
        sum += m[static_cast<size_t>(i) * n + j];
      }
      EXPECT_NEAR(sum, 1.0, 1e-4) << "row " << i;
    }
  int first_visual = -1;
  for (int t = 0; t < T && first_visual < 0; ++t)
    if (ex.prefill.kinds[t] == SegmentKind::Visual) first_visual = t;
  VisualAttentionRecorder va(first_visual, ex.prefill.n_visual);
  const MethodRun r = run_method(f.model, ex, parse_method_spec("streamingllm:budget=0.3"), opt, {&va});
  ASSERT_EQ(r.decode_attention.size(), ex.attention.size());
  EXPECT_EQ(va.steps(), static_cast<int>(r.result.generated_ids.size()) - 1);
  for (int l = 0; l < static_cast<int>(r.decode_attention.size()); ++l) {
    const auto& d = r.decode_attention[l];
    ASSERT_EQ(d.size(), static_cast<size_t>(S) * n);
    for (int s = 0; s < S; ++s) {
      // The decode row's visual part is the patch recorder's head mean; evicted keys hold 0.
      const std::vector<float> mean = va.attention(s, l, -1);
      ASSERT_EQ(mean.size(), static_cast<size_t>(ex.prefill.n_visual));
      double row = 0;
      for (int j = 0; j < n; ++j) row += d[static_cast<size_t>(s) * n + j];
      EXPECT_NEAR(row, 1.0, 1e-4);
      for (int v = 0; v < ex.prefill.n_visual; ++v)
        EXPECT_NEAR(mean[v], d[static_cast<size_t>(s) * n + first_visual + v], 1e-5);
      double heads = 0;
      for (int h = 0; h < f.model.info().n_heads; ++h) {
        const auto one = va.attention(s, l, h);
        heads += std::accumulate(one.begin(), one.end(), 0.0);
      }
      EXPECT_NEAR(heads / f.model.info().n_heads, std::accumulate(mean.begin(), mean.end(), 0.0), 1e-5);
    }
  }
  EXPECT_TRUE(va.attention(va.steps(), 0, -1).empty());
  const nlohmann::json j = experiment_json(f.model, ex, {&r}, opt);
  EXPECT_EQ(j["attention"]["size"], n);
  EXPECT_EQ(j["token_kinds"].size(), static_cast<size_t>(T));
  EXPECT_EQ(j["methods"][0]["decode_attention"].size(), ex.attention.size());
  EXPECT_NEAR(j["attention"]["layers"][1][T][first_visual].get<double>(), ex.attention[1][static_cast<size_t>(T) * n + first_visual], 1e-6);
  EXPECT_EQ(j["attention"]["rows"], T);
  EXPECT_EQ(j["attention"]["cols"], n);
  // In the report a value is 0 exactly where the method gave no attention (keys it evicted,
  // keys after the query): rounding keeps every positive value positive.
  int zeros = 0;
  for (int l = 0; l < static_cast<int>(r.decode_attention.size()); ++l)
    for (int s = 0; s < S; ++s)
      for (int k = 0; k < n; ++k) {
        const float v = r.decode_attention[static_cast<size_t>(l)][static_cast<size_t>(s) * n + k];
        const double w = j["methods"][0]["decode_attention"][l][s][k].get<double>();
        EXPECT_EQ(w == 0.0, v == 0.0f) << "layer " << l << " step " << s << " key " << k << ": " << v;
        zeros += w == 0.0 && k < T;
      }
  EXPECT_GT(zeros, 0) << "streamingllm evicts prompt keys";
  // The rounding itself: tiny positive values stay positive, zeros stay zero.
  const nlohmann::json rounded = attention_rows({0.1234567f, 3e-7f, 0.0f, 1e-9f}, 2, 2);
  EXPECT_DOUBLE_EQ(rounded[0][0].get<double>(), 0.123457);
  EXPECT_DOUBLE_EQ(rounded[0][1].get<double>(), 1e-6);
  EXPECT_EQ(rounded[1][0].get<double>(), 0.0);
  EXPECT_DOUBLE_EQ(rounded[1][1].get<double>(), 1e-6);

  // Fewer bins than positions: each block is the mean of the full map's causal cells in it,
  // prompt rows and keys pooled by ⌊i·R/T⌋ and ⌊j·C/n⌋, each decode row on its own, and the
  // method's decode rows pooled the same way. Values are ≤ 1 and both sides are float roundings
  // of sums taken in another order (decode rows: H float additions, ≤ H·2⁻²⁴ ≈ 2e-6 for H ≤ 32).
  ExperimentOptions pooled = opt;
  pooled.attention_bins = 7;
  const Experiment ep = start_experiment(f.model, f.image, pooled);
  const int R = ep.attention_rows, C = ep.attention_cols;
  ASSERT_EQ(R, 7);
  ASSERT_EQ(C, 7);
  ASSERT_EQ(ep.full.generated_ids, ex.full.generated_ids);
  const MethodRun rp = run_method(f.model, ep, parse_method_spec("streamingllm:budget=0.3"), pooled);
  auto block_mean = [&](const std::vector<float>& full, int row_lo, int row_hi, int c) {
    double sum = 0;
    int cells = 0;
    for (int i = row_lo; i < row_hi; ++i)
      for (int k = 0; k < n; ++k)
        if (static_cast<int64_t>(k) * C / n == c && k <= i) {
          sum += full[static_cast<size_t>(i) * n + k];
          ++cells;
        }
    return cells ? sum / cells : 0.0;
  };
  for (int l = 0; l < static_cast<int>(ep.attention.size()); ++l) {
    const std::vector<float>& m = ep.attention[static_cast<size_t>(l)];
    ASSERT_EQ(m.size(), static_cast<size_t>(R + S) * C);
    for (int b = 0; b < R + S; ++b) {
      int lo = T + (b - R), hi = lo + 1;  // a decode row
      if (b < R) {
        lo = hi = -1;
        for (int i = 0; i < T; ++i)
          if (static_cast<int64_t>(i) * R / T == b) {
            if (lo < 0) lo = i;
            hi = i + 1;
          }
      }
      for (int c = 0; c < C; ++c)
        EXPECT_NEAR(m[static_cast<size_t>(b) * C + c], block_mean(ex.attention[static_cast<size_t>(l)], lo, hi, c), 2e-6)
            << "layer " << l << " block " << b << "," << c;
    }
    const std::vector<float>& d = rp.decode_attention[static_cast<size_t>(l)];
    ASSERT_EQ(d.size(), static_cast<size_t>(S) * C);
    std::vector<float> unpooled(static_cast<size_t>(n) * n, 0.0f);  // the method's rows at T..n-1
    std::copy(r.decode_attention[static_cast<size_t>(l)].begin(), r.decode_attention[static_cast<size_t>(l)].end(),
              unpooled.begin() + static_cast<size_t>(T) * n);
    for (int s = 0; s < S; ++s)
      for (int c = 0; c < C; ++c)
        EXPECT_NEAR(d[static_cast<size_t>(s) * C + c], block_mean(unpooled, T + s, T + s + 1, c), 2e-6)
            << "layer " << l << " step " << s << " block " << c;
  }
  const nlohmann::json jp = experiment_json(f.model, ep, {&rp}, pooled);
  EXPECT_EQ(jp["attention"]["rows"], R);
  EXPECT_EQ(jp["attention"]["layers"][0].size(), static_cast<size_t>(R + S));
  EXPECT_EQ(jp["methods"][0]["decode_attention"][0][0].size(), static_cast<size_t>(C));
  pooled.attention_bins = 0;
  EXPECT_THROW(start_experiment(f.model, f.image, pooled), InputError);
}

// The memory plan counts what the run holds: the prompt as prefill assembles it, and the capture
// as the prefill keeps it (each layer's q, k, v; nothing on the host besides).
TEST(MemoryPlan, CountsThePromptAndTheCaptureAsThePrefillHoldsThem) {
  const Fixture& f = fixture("gqa_fp16_save");
  ExperimentOptions opt;
  const VisualLayout image = f.model.visual_layout(f.image.width, f.image.height);
  const MemoryPlan p = plan_experiment(f.model, opt, image);
  const PrefillState st = f.model.prefill(f.image, opt.prompt, opt.templ, true);
  EXPECT_EQ(p.prompt_tokens, static_cast<int>(st.ids.size()));
  EXPECT_EQ(p.capture, st.capture.attention->capture_bytes());
  EXPECT_EQ(p.backend, "cpu");
  EXPECT_EQ(p.total(), p.capture + p.caches + p.attention + p.prefill_work);
  // The CPU says nothing of its free memory: no limit, no refusal; a limit below the plan refuses.
  EXPECT_EQ(available_memory(f.model, opt), -1);
  EXPECT_NO_THROW(check_memory(f.model, opt, image));
  opt.memory_limit = p.total() - 1;
  EXPECT_THROW(check_memory(f.model, opt, image), InputError);
  opt.memory_limit = p.total();
  EXPECT_NO_THROW(check_memory(f.model, opt, image));
}
