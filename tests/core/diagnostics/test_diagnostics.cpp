// Diagnostics (core/diagnostics) pinned by hand-built recorded runs: a few keys with known
// values, a known compressed version, decode events written here. Every expected number is
// computed in this file from the definitions (in double), never taken from the code under test:
//   softmax MSE   mean over the exact key set of (P_full − P_method)², mean over heads, steps
//   softmax KL    KL(P_full ‖ P_method) = Σ P_full·log(P_full / max(P_method, 1e-10)): the full
//                 cache is the reference distribution
//   output error  ‖o_method − o_full‖ / ‖o_full‖ (a norm ratio, not its square)
//   sparsity      share of a row's entries below p · (row max)
//   histogram     one set of bin edges [lo, hi] shared by exact / quantized / calibrated scores
//   CacheHitRate  |top-k by strategy ∩ top-k by the decode attention over the prompt| / k
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "core/diagnostics/diagnostics.h"
#include "core/errors.h"
#include "core/exact_attention.h"
#include "core/compress/quant_methods.h"
#include "tests/held_attention.h"

using namespace kvlens;
using K = SegmentKind;

namespace {

// ---- a hand-made recorded run --------------------------------------------------------------
// One layer, one KV head shared by two query heads (GQA), head_dim 2, prompt S V V P.
constexpr int D = 2, H = 2, T = 4;
const std::vector<K> kKinds = {K::System, K::Visual, K::Visual, K::PostVisionText};
const double kScale = 1.0 / std::sqrt(2.0);

struct Row {
  int32_t pos;
  K kind;
  std::vector<float> k, v;
};

// The exact prompt rows (full store) and two generated tokens (positions 4 and 5).
const std::vector<Row> kPrompt = {{0, K::System, {1.0f, 0.0f}, {1.0f, 2.0f}},
                                  {1, K::Visual, {0.0f, 1.0f}, {-1.0f, 0.0f}},
                                  {2, K::Visual, {1.0f, 1.0f}, {0.5f, 0.5f}},
                                  {3, K::PostVisionText, {-1.0f, 0.5f}, {2.0f, -1.0f}}};
const std::vector<Row> kGenerated = {{4, K::Generated, {0.5f, -0.5f}, {1.0f, 1.0f}},
                                     {5, K::Generated, {-0.5f, 1.0f}, {0.0f, 2.0f}}};
// Decode queries [step][head][D].
const float kQ[2][H][D] = {{{1.0f, 0.5f}, {-0.5f, 1.0f}}, {{0.2f, -1.0f}, {1.5f, 1.5f}}};

KVStore full_store() {
  KVStore s(1, 1, D);
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  for (const Row& r : kPrompt) {
    k.insert(k.end(), r.k.begin(), r.k.end());
    v.insert(v.end(), r.v.begin(), r.v.end());
    pos.push_back(r.pos);
  }
  s.append(0, k.data(), v.data(), pos.data(), kKinds.data(), T);
  return s;
}

// The rows a method's attention reads at `step` (its kept prompt rows, then generated rows).
std::vector<Row> method_rows(const std::vector<Row>& kept_prompt, int step) {
  std::vector<Row> r = kept_prompt;
  for (int s = 0; s <= step; ++s) r.push_back(kGenerated[s]);
  return r;
}

// What the method's attention saw: scores q·k/√d (then `calibrate` on the visual keys, as a
// score transform does), probabilities = their softmax. Recorded as a decode event.
// With `taps`, the event carries no rows: the scores before calibration, the method's output
// and the exact attention (over the full prompt and the generated rows) instead, computed here
// from the definitions, as a device hands them over.
void record(DecodeRecorder& rec, int step, const std::vector<Row>& rows, bool calibrate = false,
            float tau1 = 0, float tau2 = 0, bool taps = false) {
  const int n = static_cast<int>(rows.size());
  std::vector<float> q(H * D), k, v, scores(H * n), probs(H * n);
  std::vector<int32_t> key_pos;
  std::vector<K> key_kind;
  for (int h = 0; h < H; ++h)
    for (int x = 0; x < D; ++x) q[h * D + x] = kQ[step][h][x];
  for (const Row& r : rows) {
    k.insert(k.end(), r.k.begin(), r.k.end());
    v.insert(v.end(), r.v.begin(), r.v.end());
    key_pos.push_back(r.pos);
    key_kind.push_back(r.kind);
  }
  std::vector<float> raw(H * n);
  for (int h = 0; h < H; ++h) {
    float* s = &scores[h * n];
    for (int j = 0; j < n; ++j)
      s[j] = static_cast<float>((q[h * D] * rows[j].k[0] + q[h * D + 1] * rows[j].k[1]) * kScale);
    std::copy(s, s + n, &raw[h * n]);
    if (calibrate) calibquant::calibrate_visual(s, key_kind.data(), n, tau1, tau2);
    double mx = *std::max_element(s, s + n), z = 0;
    for (int j = 0; j < n; ++j) z += std::exp(s[j] - mx);
    for (int j = 0; j < n; ++j) probs[h * n + j] = static_cast<float>(std::exp(s[j] - mx) / z);
  }
  const int32_t qpos = T + step;
  AttentionEvent e;
  e.phase = Phase::Decode;
  e.layer = 0, e.step = step, e.n_heads = H, e.n_kv_heads = 1, e.n_q = 1, e.n_k = n, e.head_dim = D;
  e.scores = scores.data(), e.probs = probs.data(), e.query_pos = &qpos;
  e.key_pos = key_pos.data(), e.key_kind = key_kind.data();
  e.q = q.data(), e.k = k.data(), e.v = v.data();
  std::vector<float> out(H * D, 0.0f);
  ExactAttention x;
  if (taps) {
    std::vector<Row> exact = kPrompt;
    for (int s = 0; s <= step; ++s) exact.push_back(kGenerated[s]);
    x.n = static_cast<int>(exact.size());
    for (const Row& r : exact) x.pos.push_back(r.pos);
    x.out.assign(H * D, 0.0);
    for (int h = 0; h < H; ++h) {
      std::vector<double> se(x.n);
      for (int j = 0; j < x.n; ++j) se[j] = (q[h * D] * double(exact[j].k[0]) + q[h * D + 1] * double(exact[j].k[1])) * kScale;
      const double mx = *std::max_element(se.begin(), se.end());
      double z = 0;
      for (double v : se) z += std::exp(v - mx);
      for (int j = 0; j < x.n; ++j) {
        const double pj = std::exp(se[j] - mx) / z;
        x.scores.push_back(static_cast<float>(se[j]));
        x.probs.push_back(static_cast<float>(pj));
        for (int c = 0; c < D; ++c) x.out[h * D + c] += pj * exact[j].v[c];
      }
      for (int j = 0; j < n; ++j)
        for (int c = 0; c < D; ++c) out[h * D + c] += probs[h * n + j] * rows[j].v[c];
    }
    e.k = e.v = nullptr;
    e.raw_scores = raw.data();
    e.out = out.data();
    e.exact = &x;
  }
  rec.on_attention(e);
}

// The reference numbers of one (step, head), from the definitions.
struct Expect {
  double mse = 0, kl = 0, rel = 0, sparsity = 0;
};

Expect expected(int step, int h, const std::vector<Row>& rows, const std::vector<float>& method_probs,
                double p) {
  // Exact distribution: the query against the full prompt rows and the generated rows.
  std::vector<Row> exact = kPrompt;
  for (int s = 0; s <= step; ++s) exact.push_back(kGenerated[s]);
  const int ne = static_cast<int>(exact.size());
  std::vector<double> pe(ne);
  for (int j = 0; j < ne; ++j)
    pe[j] = (kQ[step][h][0] * static_cast<double>(exact[j].k[0]) + kQ[step][h][1] * static_cast<double>(exact[j].k[1])) * kScale;
  const double mx = *std::max_element(pe.begin(), pe.end());
  double z = 0;
  for (double& x : pe) z += (x = std::exp(x - mx));
  for (double& x : pe) x /= z;
  // The method's probability of each exact key (0 where it evicted the key).
  std::vector<double> pm(ne, 0.0);
  for (size_t r = 0; r < rows.size(); ++r)
    for (int j = 0; j < ne; ++j)
      if (exact[j].pos == rows[r].pos) pm[j] += method_probs[r];
  Expect e;
  double oe[D] = {0, 0}, om[D] = {0, 0};
  for (int j = 0; j < ne; ++j) {
    e.mse += (pe[j] - pm[j]) * (pe[j] - pm[j]) / ne;
    e.kl += pe[j] * std::log(pe[j] / std::max(pm[j], 1e-10));
    for (int x = 0; x < D; ++x) oe[x] += pe[j] * exact[j].v[x];
  }
  for (size_t r = 0; r < rows.size(); ++r)
    for (int x = 0; x < D; ++x) om[x] += method_probs[r] * rows[r].v[x];
  e.rel = std::hypot(om[0] - oe[0], om[1] - oe[1]) / std::hypot(oe[0], oe[1]);
  const double pmax = *std::max_element(method_probs.begin(), method_probs.end());
  int below = 0;
  for (float x : method_probs) below += x < p * pmax;
  e.sparsity = static_cast<double>(below) / method_probs.size();
  return e;
}

// The method probabilities of head h in the recorded entry.
std::vector<float> probs_of(const DecodeRecorder::Entry& e, int h) {
  return std::vector<float>(e.probs.begin() + h * e.n_k, e.probs.begin() + (h + 1) * e.n_k);
}

// ‖a − b‖ within float rounding of values of size `scale`.
void expect_close(double got, double want, const char* what) {
  EXPECT_NEAR(got, want, 1e-5 * std::max(std::fabs(want), 1e-3)) << what;
}

PrefillView view_of(const KVStore& full, const std::vector<std::vector<float>>& probs, int heads) {
  static std::vector<std::unique_ptr<kvlens::testing::HeldAttention>> held;  // live for the test run
  held.push_back(std::make_unique<kvlens::testing::HeldAttention>(probs, heads, T));
  PrefillView v;
  v.full = &full;
  v.attention = held.back().get();
  v.kinds = &kKinds;
  v.n_heads = heads;
  v.prompt_len = T;
  return v;
}

}  // namespace

// A method that quantized the key and value of visual token 1 (nothing evicted), read over two
// decode steps: MSE, KL, output error and sparsity against the definitions.
TEST(DiagnosticsByHand, QuantizedKeyMseKlOutputErrorAndSparsity) {
  const KVStore full = full_store();
  std::vector<Row> kept = kPrompt;
  kept[1].k = {0.25f, 0.75f};  // a coarse code of (0, 1)
  kept[1].v = {-0.75f, 0.25f};
  DecodeRecorder rec(4);
  for (int step = 0; step < 2; ++step) record(rec, step, method_rows(kept, step));
  KVStore compressed = full;
  const std::vector<std::vector<float>> no_probs(1);
  const double p = 0.3;
  const auto d = compare_layers(view_of(full, no_probs, H), rec, compressed, 8, p);
  ASSERT_EQ(d.size(), 1u);
  Expect mean;
  for (int step = 0; step < 2; ++step)
    for (int h = 0; h < H; ++h) {
      const Expect e = expected(step, h, method_rows(kept, step), probs_of(*rec.find(step, 0), h), p);
      mean.mse += e.mse / 4, mean.kl += e.kl / 4, mean.rel += e.rel / 4, mean.sparsity += e.sparsity / 4;
    }
  // The example is not degenerate: every quantity is well away from zero.
  ASSERT_GT(mean.mse, 1e-5);
  ASSERT_GT(mean.kl, 1e-4);
  ASSERT_GT(mean.rel, 1e-2);
  ASSERT_GT(mean.sparsity, 0.0);
  expect_close(d[0].softmax_mse, mean.mse, "softmax MSE");
  expect_close(d[0].softmax_kl, mean.kl, "KL(full || method)");
  expect_close(d[0].output_rel_error, mean.rel, "attention-output relative error");
  EXPECT_DOUBLE_EQ(d[0].sparsity_decode, mean.sparsity);
}

// KL's direction: the full cache is the reference. KL(method ‖ full) gives a different number
// here, so a swapped direction fails.
TEST(DiagnosticsByHand, KlTakesTheFullCacheAsReference) {
  const KVStore full = full_store();
  std::vector<Row> kept = kPrompt;
  kept[2].k = {2.0f, -1.0f};
  DecodeRecorder rec(1);
  record(rec, 0, method_rows(kept, 0));
  const std::vector<std::vector<float>> no_probs(1);
  const auto d = compare_layers(view_of(full, no_probs, H), rec, full, 4, 0.01);
  double forward = 0, reverse = 0;
  for (int h = 0; h < H; ++h) {
    const std::vector<float> pm = probs_of(*rec.find(0, 0), h);
    forward += expected(0, h, method_rows(kept, 0), pm, 0.01).kl / H;
    // KL(method ‖ full) on the same keys (nothing evicted: the key sets agree).
    std::vector<Row> rows = method_rows(kept, 0);
    double pe[5], mx = -1e300, z = 0;
    for (int j = 0; j < 5; ++j) {
      const Row& r = j < T ? kPrompt[j] : kGenerated[0];
      pe[j] = (kQ[0][h][0] * static_cast<double>(r.k[0]) + kQ[0][h][1] * static_cast<double>(r.k[1])) * kScale;
      mx = std::max(mx, pe[j]);
    }
    for (double& x : pe) z += (x = std::exp(x - mx));
    for (int j = 0; j < 5; ++j) reverse += pm[j] * std::log(pm[j] / (pe[j] / z)) / H;
  }
  ASSERT_GT(std::fabs(forward - reverse), 1e-2 * forward) << "the example cannot tell the directions apart";
  expect_close(d[0].softmax_kl, forward, "KL(full || method)");
}

// Eviction: the evicted key has method probability 0, which KL clamps at 1e-10; the output
// error compares against the exact output over every key; token fate marks the evicted patch.
TEST(DiagnosticsByHand, EvictedKeyCountsInMseKlAndOutputError) {
  const KVStore full = full_store();
  const std::vector<Row> kept = {kPrompt[0], kPrompt[2], kPrompt[3]};  // visual token 1 evicted
  DecodeRecorder rec(2);
  for (int step = 0; step < 2; ++step) record(rec, step, method_rows(kept, step));
  KVStore compressed(1, 1, D);
  {
    std::vector<float> k, v;
    std::vector<int32_t> pos;
    std::vector<K> kinds;
    for (const Row& r : kept)
      k.insert(k.end(), r.k.begin(), r.k.end()), v.insert(v.end(), r.v.begin(), r.v.end()),
          pos.push_back(r.pos), kinds.push_back(r.kind);
    compressed.append(0, k.data(), v.data(), pos.data(), kinds.data(), 3);
  }
  const std::vector<std::vector<float>> no_probs(1);
  const auto d = compare_layers(view_of(full, no_probs, H), rec, compressed, 8, 0.01);
  Expect mean;
  for (int step = 0; step < 2; ++step)
    for (int h = 0; h < H; ++h) {
      const Expect e = expected(step, h, method_rows(kept, step), probs_of(*rec.find(step, 0), h), 0.01);
      mean.mse += e.mse / 4, mean.kl += e.kl / 4, mean.rel += e.rel / 4;
    }
  ASSERT_GT(mean.kl, 1.0);  // the clamp at 1e-10 dominates: ~P_full(1)·23 nats
  expect_close(d[0].softmax_mse, mean.mse, "softmax MSE");
  expect_close(d[0].softmax_kl, mean.kl, "KL with the 1e-10 clamp");
  expect_close(d[0].output_rel_error, mean.rel, "attention-output relative error");
  ASSERT_EQ(d[0].fate_kept.size(), 2u);  // two visual tokens
  EXPECT_EQ(d[0].fate_kept[0], 0.0f);
  EXPECT_EQ(d[0].fate_kept[1], 1.0f);
  EXPECT_EQ(d[0].fate_bits[0], 0.0f);  // no head keeps it
  EXPECT_EQ(d[0].fate_bits[1], 32.0f);
}

// The visual-score histogram of the first decode step: one set of edges [lo, hi] spanning the
// exact, quantized and calibrated scores, and each set's counts in those bins.
TEST(DiagnosticsByHand, HistogramSharesBinEdgesAcrossExactQuantizedCalibrated) {
  const KVStore full = full_store();
  std::vector<Row> kept = kPrompt;
  kept[1].k = {0.5f, 1.5f};
  kept[2].k = {1.5f, 0.5f};
  const float tau1 = 0.5f, tau2 = 1.0f;
  DecodeRecorder rec(2);
  for (int step = 0; step < 2; ++step) record(rec, step, method_rows(kept, step), true, tau1, tau2);
  const std::vector<std::vector<float>> no_probs(1);
  const int bins = 5;
  const auto d = compare_layers(view_of(full, no_probs, H), rec, full, bins, 0.01);
  // Step 0 only, visual keys (tokens 1, 2) of both heads.
  std::vector<double> exact, quant, calib;
  for (int h = 0; h < H; ++h) {
    std::vector<double> qs;
    for (int t : {1, 2}) {
      const auto dot = [&](const std::vector<float>& k) { return (kQ[0][h][0] * static_cast<double>(k[0]) + kQ[0][h][1] * static_cast<double>(k[1])) * kScale; };
      exact.push_back(dot(kPrompt[t].k));
      quant.push_back(dot(kept[t].k));
      qs.push_back(quant.back());
    }
    // g maps [γ, δ] of the visual scores onto [γ − τ1, δ − τ2] (CalibQuant Eq. 7).
    const double g = std::min(qs[0], qs[1]), dl = std::max(qs[0], qs[1]);
    for (double x : qs) calib.push_back((dl - g + tau1 - tau2) / (dl - g) * (x - g) + g - tau1);
  }
  double lo = 1e300, hi = -1e300;
  for (const auto* v : {&exact, &quant, &calib})
    for (double x : *v) lo = std::min(lo, x), hi = std::max(hi, x);
  const ScoreHistogram& hs = d[0].visual_scores;
  EXPECT_NEAR(hs.lo, lo, 1e-6);
  EXPECT_NEAR(hs.hi, hi, 1e-6);
  // The calibrated minimum is below every exact and quantized score: a histogram whose edges
  // came from the exact scores alone would miss it.
  ASSERT_LT(*std::min_element(calib.begin(), calib.end()), *std::min_element(exact.begin(), exact.end()) - 0.1);
  auto counts = [&](const std::vector<double>& v) {
    std::vector<int64_t> c(bins, 0);
    for (double x : v) {
      const double at = (x - lo) / (hi - lo) * bins;
      // No value sits within float rounding of an inner edge, so the bin is unambiguous.
      EXPECT_GT(std::fabs(at - std::nearbyint(at)) + (at < 0.5 || at > bins - 0.5), 1e-4) << x;
      c[std::clamp(static_cast<int>(std::floor(at)), 0, bins - 1)]++;
    }
    return c;
  };
  EXPECT_EQ(hs.exact, counts(exact));
  EXPECT_EQ(hs.quantized, counts(quant));
  EXPECT_EQ(hs.calibrated, counts(calib));
  EXPECT_NE(hs.exact, hs.quantized);
  EXPECT_NE(hs.quantized, hs.calibrated);
}

// Decode sparsity counts each head's row over the keys it holds (padding excluded) with the
// ThresholdFilter p · max; prefill sparsity is causal.
TEST(DiagnosticsByHand, SparsityThresholdAndCausalMask) {
  // One head, 4 × 4 causal; row maxima on the diagonal in rows 1 and 3.
  const float P[16] = {1, 0, 0, 0,  0.2f, 0.8f, 0, 0,  0.5f, 0.45f, 0.05f, 0,  0.05f, 0.1f, 0.25f, 0.6f};
  // p = 0.3: thresholds 0.3, 0.24, 0.15, 0.18 → zeros 0, 1 (0.2), 1 (0.05), 2 (0.05, 0.1) of 10.
  EXPECT_DOUBLE_EQ(sparsity(P, 1, 4, 4, 0.3), 4.0 / 10.0);
  // Two queries over the last two rows' keys (n_q < n_k: the first query sees 3 keys).
  EXPECT_DOUBLE_EQ(sparsity(P + 8, 1, 2, 4, 0.3), 3.0 / 7.0);
  // Two heads average their shares.
  float P2[32];
  std::copy(P, P + 16, P2);
  for (int i = 0; i < 16; ++i) P2[16 + i] = (i % 4 <= i / 4) ? 1.0f / (i / 4 + 1) : 0.0f;  // uniform rows: no zeros
  EXPECT_DOUBLE_EQ(sparsity(P2, 2, 4, 4, 0.3), (4.0 / 10.0 + 0.0) / 2);
  // ThresholdFilter keeps A_ij >= p · max: entries exactly at the threshold are not zeros.
  const float at[3] = {0.5f, 0.25f, 0.25f};
  EXPECT_DOUBLE_EQ(sparsity(at, 1, 1, 3, 0.5), 0.0);
  EXPECT_DOUBLE_EQ(sparsity(at, 1, 1, 3, 0.51), 2.0 / 3.0);
}

// The report states each formula next to the numbers, KL's reference distribution included.
TEST(DiagnosticsByHand, DefinitionsNameEveryLayerFieldAndKlDirection) {
  const nlohmann::json defs = diagnostic_definitions();
  const nlohmann::json layer = to_json(LayerDiagnostics{});
  for (const char* key : {"softmax_mse", "softmax_kl", "attn_output_rel_error", "sparsity_decode", "visual_score_histogram"}) {
    ASSERT_TRUE(defs.contains(key)) << key;
    EXPECT_TRUE(layer.contains(key)) << key;
  }
  EXPECT_NE(defs["softmax_kl"].get<std::string>().find("KL(full || method)"), std::string::npos);
  EXPECT_NE(defs["softmax_kl"].get<std::string>().find("reference"), std::string::npos);
  EXPECT_NE(defs["attn_output_rel_error"].get<std::string>().find("norm ratio"), std::string::npos);
  EXPECT_TRUE(defs.contains("cache_hit_rate"));
}

// ---- CacheHitRate ----------------------------------------------------------------------------
namespace {

// A prompt of 2 system, 9 visual and 5 post-vision tokens with seeded random causal attention
// in 2 layers × 4 heads, and a full-cache decode recorded at steps 0 and 2 whose heads give
// very different mass to the generated keys (so per-head renormalisation over the prompt keys
// matters).
struct HitRun {
  static constexpr int T = 16, H = 4, L = 2, KH = 2;
  std::vector<K> kinds;
  KVStore store{L, KH, 2};
  std::vector<std::vector<float>> probs;  // [layer][H][T][T]
  mutable std::shared_ptr<kvlens::testing::HeldAttention> held;  // over probs
  DecodeRecorder rec{8};
  std::vector<int> steps = {0, 2};

  explicit HitRun(uint32_t seed) {
    std::mt19937 rng(seed);
    std::gamma_distribution<double> sharp(0.3, 1.0), flat(3.0, 1.0);
    kinds.assign(2, K::System);
    kinds.insert(kinds.end(), 9, K::Visual);
    kinds.insert(kinds.end(), 5, K::PostVisionText);
    std::vector<float> kv(static_cast<size_t>(T) * KH * 2, 0.0f);
    std::vector<int32_t> pos(T);
    std::iota(pos.begin(), pos.end(), 0);
    for (int l = 0; l < L; ++l) store.append(l, kv.data(), kv.data(), pos.data(), kinds.data(), T);
    probs.assign(L, std::vector<float>(static_cast<size_t>(H) * T * T, 0.0f));
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < T; ++i) {
          std::vector<double> w(i + 1);
          double z = 0;
          for (double& x : w) z += (x = (h % 2 ? sharp : flat)(rng) + 1e-9);
          for (int j = 0; j <= i; ++j) probs[l][(static_cast<size_t>(h) * T + i) * T + j] = static_cast<float>(w[j] / z);
        }
    for (int s : steps)
      for (int l = 0; l < L; ++l) {
        const int n = T + s + 1;  // prompt keys + generated keys (the newest is the query's own)
        std::vector<float> p(static_cast<size_t>(H) * n), k(static_cast<size_t>(KH) * n * 2, 0.0f);
        std::vector<int32_t> key_pos(static_cast<size_t>(KH) * n);
        std::vector<K> key_kind(key_pos.size());
        for (int kh = 0; kh < KH; ++kh)
          for (int j = 0; j < n; ++j)
            key_pos[kh * n + j] = j, key_kind[kh * n + j] = j < T ? kinds[j] : K::Generated;
        for (int h = 0; h < H; ++h) {
          // Head h puts share m_h on the generated keys, the rest on the prompt.
          const double m = 0.1 + 0.25 * h;
          std::vector<double> w(n);
          double zp = 0, zg = 0;
          for (int j = 0; j < n; ++j) (j < T ? zp : zg) += (w[j] = sharp(rng) + 1e-9);
          for (int j = 0; j < n; ++j) p[h * n + j] = static_cast<float>(j < T ? (1 - m) * w[j] / zp : m * w[j] / zg);
        }
        const int32_t qpos = T + s;
        AttentionEvent e;
        e.phase = Phase::Decode;
        e.layer = l, e.step = s, e.n_heads = H, e.n_kv_heads = KH, e.n_q = 1, e.n_k = n, e.head_dim = 2;
        e.probs = p.data(), e.scores = p.data(), e.query_pos = &qpos, e.key_pos = key_pos.data();
        e.key_kind = key_kind.data(), e.q = k.data(), e.k = k.data(), e.v = k.data();
        rec.on_attention(e);
      }
  }
  PrefillView view() const {
    PrefillView v;
    held = std::make_shared<kvlens::testing::HeldAttention>(probs, H, T);
    v.full = &store, v.attention = held.get(), v.kinds = &kinds, v.n_heads = H, v.prompt_len = T;
    return v;
  }
  double prob(int l, int h, int i, int j) const { return probs[l][(static_cast<size_t>(h) * T + i) * T + j]; }
};

// The k best indices by score (no ties in these data), as a set.
std::set<int> best(const std::vector<double>& s, int k) {
  std::vector<int> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](int a, int b) { return s[a] > s[b]; });
  return std::set<int>(idx.begin(), idx.begin() + k);
}

double overlap(const std::set<int>& a, const std::set<int>& b, int k) {
  int n = 0;
  for (int x : a) n += b.count(x);
  return static_cast<double>(n) / k;
}

}  // namespace

// Every strategy at every k against the definitions (VL-Cache §3.2): accumulated
// ψ_j = Σ_i A_ij; normalized ψ_j = Σ_i A_ij / n_j with n_j = T − j unmasked entries in column j;
// sliding window Σ over the last w queries; post-vision Σ over the queries after the last visual
// token; recency ψ_j = j. The truth is A_{m+1} = softmax(q K_{:m}ᵀ/√d), the decode query's
// attention over the prompt keys alone: each head's prompt probabilities renormalised to sum
// to 1, averaged over heads. Strategies use the head-mean prefill attention.
TEST(CacheHitRate, EveryStrategyAtEveryBudgetAgainstTheDefinitions) {
  const HitRun run(7);
  const int T = HitRun::T, H = HitRun::H;
  int distinct = 0;  // budgets where strategies disagree: the data tell them apart
  for (int w : {1, 3, 7, 16, 40})
    for (int k = 1; k <= T; ++k) {
      const HitRates hr = cache_hit_rates(run.view(), run.rec, static_cast<double>(k) / T, run.steps, w);
      ASSERT_EQ(hr.k, k);
      ASSERT_EQ(hr.strategies, (std::vector<std::string>{"accumulated", "normalized", "sliding_window", "post_vision", "recency"}));
      ASSERT_EQ(hr.steps, run.steps);
      for (int l = 0; l < HitRun::L; ++l) {
        std::vector<double> acc(T, 0), norm(T), window(T, 0), post(T, 0), recent(T);
        for (int j = 0; j < T; ++j) {
          for (int h = 0; h < H; ++h)
            for (int i = j; i < T; ++i) {
              acc[j] += run.prob(l, h, i, j) / H;
              if (i >= T - w) window[j] += run.prob(l, h, i, j) / H;
              if (i >= 11) post[j] += run.prob(l, h, i, j) / H;  // last visual token: 10
            }
          norm[j] = acc[j] / (T - j);
          recent[j] = j;
        }
        const std::vector<std::set<int>> picks = {best(acc, k), best(norm, k), best(window, k), best(post, k), best(recent, k)};
        for (size_t si = 0; si < run.steps.size(); ++si) {
          const auto* e = run.rec.find(run.steps[si], l);
          std::vector<double> truth(T, 0.0);
          for (int h = 0; h < H; ++h) {
            double mass = 0;
            for (int j = 0; j < T; ++j) mass += e->probs[h * e->n_k + j];
            for (int j = 0; j < T; ++j) truth[j] += e->probs[h * e->n_k + j] / mass / H;
          }
          const std::set<int> want = best(truth, k);
          std::set<double> seen;
          for (size_t st = 0; st < picks.size(); ++st) {
            const double r = overlap(picks[st], want, k);
            EXPECT_DOUBLE_EQ(hr.rates[st][si][l], r)
                << hr.strategies[st] << " k=" << k << " w=" << w << " layer " << l << " step " << run.steps[si];
            seen.insert(r);
          }
          distinct += seen.size() > 2;
        }
      }
    }
  EXPECT_GT(distinct, 50) << "the attention data should give the strategies different rates";
}

// The truth renormalises each head over the prompt keys: a head that looks mostly at the
// generated tokens still votes with weight 1. Two heads disagree on the best prompt key; the
// one with little prompt mass decides it once renormalised.
TEST(CacheHitRate, TruthRenormalisesEachHeadOverThePromptKeys) {
  HitRun run(3);
  const int T = HitRun::T, H = HitRun::H;
  DecodeRecorder rec(1);
  for (int l = 0; l < HitRun::L; ++l) {
    const int n = T + 1;
    std::vector<float> p(static_cast<size_t>(H) * n, 0.0f), z(static_cast<size_t>(2) * n * 2, 0.0f);
    std::vector<int32_t> key_pos(2 * n);
    std::vector<K> key_kind(2 * n, K::Generated);
    for (int kh = 0; kh < 2; ++kh)
      for (int j = 0; j < n; ++j) key_pos[kh * n + j] = j;
    // Heads 0, 1: 0.6 on key 3, 0.2 on key 5, 0.2 on the generated key.
    // Heads 2, 3: 0.02 on key 3, 0.08 on key 5, 0.9 on the generated key.
    // Head mean without renormalising: key 3 (0.31) above key 5 (0.14); renormalised per head
    // over the prompt: key 3 (0.375 + 0.1) vs key 5 (0.125 + 0.4) = 0.475 vs 0.525.
    for (int h = 0; h < H; ++h) {
      const bool look_away = h >= 2;
      p[h * n + 3] = look_away ? 0.02f : 0.6f;
      p[h * n + 5] = look_away ? 0.08f : 0.2f;
      p[h * n + T] = look_away ? 0.9f : 0.2f;
    }
    const int32_t qpos = T;
    AttentionEvent e;
    e.phase = Phase::Decode;
    e.layer = l, e.step = 0, e.n_heads = H, e.n_kv_heads = 2, e.n_q = 1, e.n_k = n, e.head_dim = 2;
    e.probs = p.data(), e.scores = p.data(), e.query_pos = &qpos, e.key_pos = key_pos.data();
    e.key_kind = key_kind.data(), e.q = z.data(), e.k = z.data(), e.v = z.data();
    rec.on_attention(e);
  }
  // k = 1 and recency keeps the last prompt token, which is neither: rate 0. The accumulated
  // strategy's pick, with key 5's column made the largest, shows which key the truth chose.
  for (int l = 0; l < HitRun::L; ++l)
    for (int h = 0; h < H; ++h)
      for (int i = 5; i < T; ++i) {
        float* row = &run.probs[l][(static_cast<size_t>(h) * T + i) * T];
        std::fill(row, row + i + 1, 0.0f);
        row[5] = 1.0f;
      }
  const HitRates hr = cache_hit_rates(run.view(), rec, 1.0 / T, {0}, 4);
  ASSERT_EQ(hr.k, 1);
  for (int l = 0; l < HitRun::L; ++l) {
    EXPECT_EQ(hr.rates[0][0][l], 1.0) << "accumulated picks key 5, the renormalised truth's top key";
    EXPECT_EQ(hr.rates[4][0][l], 0.0);
  }
}

// A capture on a device reduces every layer over one set of queries in one pass, with one wait:
// the hit rates ask it to prepare every layer for each strategy's queries (the whole prompt, the
// window, after the last visual token) before they reduce any layer, and reduce no set they did
// not prepare.
TEST(CacheHitRate, EveryLayerIsPreparedBeforeAnyIsReduced) {
  const HitRun run(5);
  cache_hit_rates(run.view(), run.rec, 0.2, run.steps, 4);
  const auto asked = run.held->asked();
  const std::vector<int> all_layers = {0, 1};
  std::vector<std::vector<int>> prepared;
  bool reduced = false;
  for (const auto& a : asked) {
    if (a.prepare) {
      EXPECT_FALSE(reduced) << "a layer was reduced before every set was prepared";
      EXPECT_EQ(a.layers, all_layers);
      prepared.push_back(a.queries);
    } else {
      reduced = true;
      EXPECT_NE(std::find(prepared.begin(), prepared.end(), a.queries), prepared.end())
          << "layer " << a.layers.at(0) << " reduced over a set never prepared";
    }
  }
  EXPECT_TRUE(reduced);
  ASSERT_EQ(prepared.size(), 3u);
  EXPECT_EQ(prepared[0], AttentionReduction::range(0, HitRun::T, HitRun::T));
  EXPECT_EQ(prepared[1], AttentionReduction::range(HitRun::T - 4, HitRun::T, HitRun::T));
  EXPECT_EQ(prepared[2], AttentionReduction::range(11, HitRun::T, HitRun::T));  // last visual token: 10
}

// Every layer's prefill sparsity: the counts of all layers prepared first, over every query row
// at p, then each layer as prefill_sparsity gives it.
TEST(Sparsity, EveryLayerOfThePrefillPreparedInOnePass) {
  const HitRun run(7);
  const PrefillView v = run.view();
  const std::vector<double> all = prefill_sparsities(v, 0.1);
  const auto asked = run.held->asked();
  ASSERT_EQ(asked.size(), 1u + HitRun::L);
  EXPECT_TRUE(asked[0].prepare);
  EXPECT_EQ(asked[0].layers, (std::vector<int>{0, 1}));
  EXPECT_EQ(asked[0].queries, AttentionReduction::range(0, HitRun::T, HitRun::T));
  EXPECT_TRUE(asked[0].below);
  EXPECT_EQ(asked[0].p, 0.1);
  for (int l = 0; l < HitRun::L; ++l) {
    EXPECT_FALSE(asked[static_cast<size_t>(1 + l)].prepare);
    EXPECT_EQ(asked[static_cast<size_t>(1 + l)].layers, std::vector<int>{l});
  }
  ASSERT_EQ(all.size(), static_cast<size_t>(HitRun::L));
  for (int l = 0; l < HitRun::L; ++l) {
    EXPECT_EQ(all[static_cast<size_t>(l)], prefill_sparsity(run.view(), l, 0.1)) << "layer " << l;
    EXPECT_GT(all[static_cast<size_t>(l)], 0.0) << "layer " << l;
  }
}

// The reductions the prefill sparsity and the hit rates read, asked of the capture in one call
// (a device recomputes each layer once for all of them); the sparsity and the rates then read
// those sets and no other.
TEST(PrefillDiagnostics, EveryRowSetTheSparsityAndTheHitRatesReadIsPreparedInOneCall) {
  const HitRun run(5);
  const int T = HitRun::T;
  EXPECT_EQ(hit_rate_query_starts(run.view(), 4), (std::array<int, 3>{0, T - 4, 11}));  // last visual token: 10
  EXPECT_EQ(hit_rate_query_starts(run.view(), 2 * T), (std::array<int, 3>{0, 0, 11}));
  prepare_prefill_diagnostics(run.view(), 0.1, 4);
  auto asked = run.held->asked();
  ASSERT_EQ(asked.size(), 3u);
  for (const auto& a : asked) {
    EXPECT_TRUE(a.prepare);
    EXPECT_EQ(a.call, asked[0].call) << "the row sets were asked in more than one call";
    EXPECT_EQ(a.layers, (std::vector<int>{0, 1}));
  }
  EXPECT_EQ(asked[0].queries, AttentionReduction::range(0, T, T));
  EXPECT_TRUE(asked[0].below);
  EXPECT_EQ(asked[0].p, 0.1);
  EXPECT_EQ(asked[1].queries, AttentionReduction::range(T - 4, T, T));
  EXPECT_FALSE(asked[1].below);
  EXPECT_EQ(asked[2].queries, AttentionReduction::range(11, T, T));
  EXPECT_FALSE(asked[2].below);
  prefill_sparsities(run.view(), 0.1);
  cache_hit_rates(run.view(), run.rec, 0.2, run.steps, 4);
  asked = run.held->asked();
  for (size_t i = 3; i < asked.size(); ++i) {
    const bool known = std::any_of(asked.begin(), asked.begin() + 3, [&](const auto& p) {
      return p.queries == asked[i].queries && (!asked[i].below || (p.below && p.p == asked[i].p));
    });
    EXPECT_TRUE(known) << "ask " << i << " reads a row set the one call did not prepare";
  }
}

// The truth side (the decode attention's top keys) reads no prefill attention, so it can run
// while a device reduces the prefill; the rates from it are those of the whole computation.
TEST(CacheHitRate, TheTruthSideReadsNoPrefillAttention) {
  const HitRun run(5);
  const PrefillView v = run.view();
  const HitTruth truth = hit_rate_truth(v, run.rec, 0.2, {0, 1, 2, 9});
  EXPECT_TRUE(run.held->asked().empty()) << "the truth side asked the prefill attention";
  EXPECT_EQ(truth.k, 3);
  EXPECT_EQ(truth.steps, (std::vector<int>{0, 2}));
  ASSERT_EQ(truth.layer.size(), 2u);
  ASSERT_EQ(truth.head.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    ASSERT_EQ(truth.layer[s].size(), static_cast<size_t>(HitRun::L));
    for (int l = 0; l < HitRun::L; ++l) {
      EXPECT_EQ(truth.layer[s][static_cast<size_t>(l)].size(), 3u);
      ASSERT_EQ(truth.head[s][static_cast<size_t>(l)].size(), static_cast<size_t>(HitRun::KH));
    }
  }
  const HitRates a = cache_hit_rates(v, truth, 4), b = cache_hit_rates(v, run.rec, 0.2, {0, 1, 2, 9}, 4);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.rates, b.rates);
  EXPECT_EQ(a.rates_head, b.rates_head);
  bool any = false;
  for (const auto& st : a.rates)
    for (const auto& step : st)
      for (double r : step) any = any || r > 0.0;
  EXPECT_TRUE(any) << "every rate is 0: the comparison above would hold for rates never computed";
}

// Each layer's decode sparsity: the mean of sparsity() over its recorded steps below the limit,
// 0 for a layer with none.
TEST(Sparsity, DecodeSparsityOfEveryLayerIsTheMeanOverItsSteps) {
  const HitRun run(9);  // (steps 0 and 2 recorded)
  for (int limit : {1, 3, 9}) {
    const std::vector<double> got = decode_sparsities(run.rec, HitRun::L + 1, limit, 0.1);
    ASSERT_EQ(got.size(), static_cast<size_t>(HitRun::L + 1));
    for (int l = 0; l < HitRun::L; ++l) {
      double s = 0;
      int n = 0;
      for (const auto& e : run.rec.entries())
        if (e.layer == l && e.step < limit) s += sparsity(e.probs.data(), e.n_heads, 1, e.n_k, 0.1), ++n;
      EXPECT_EQ(n, limit > 2 ? 2 : 1) << "layer " << l;
      EXPECT_EQ(got[static_cast<size_t>(l)], s / n) << "layer " << l << ", steps below " << limit;
      EXPECT_GT(got[static_cast<size_t>(l)], 0.0) << "layer " << l;
    }
    EXPECT_EQ(got.back(), 0.0) << "a layer without steps";
  }
}

// Steps that were not recorded are dropped from the report; k = floor(budget · T), at least 1
// (the rows an eviction policy at that budget keeps).
TEST(CacheHitRate, StepsAndK) {
  const HitRun run(5);
  const HitRates hr = cache_hit_rates(run.view(), run.rec, 0.2, {0, 1, 2, 9}, 4);
  EXPECT_EQ(hr.steps, (std::vector<int>{0, 2}));
  EXPECT_EQ(hr.k, 3);  // floor(0.2 · 16) = 3
  EXPECT_EQ(cache_hit_rates(run.view(), run.rec, 0.001, {0}, 4).k, 1);
  EXPECT_EQ(cache_hit_rates(run.view(), run.rec, 0.22, {0}, 4).k, 3);  // floor(3.52); rounding gives 4
  ASSERT_EQ(hr.rates.size(), 5u);
  for (const auto& s : hr.rates) {
    ASSERT_EQ(s.size(), 2u);
    for (const auto& per_layer : s) EXPECT_EQ(per_layer.size(), static_cast<size_t>(HitRun::L));
  }
}

// A recorder that compares as the queries come (what a run uses) gives compare_layers what a
// recorder that keeps the rows gives, whether the events carry rows (compared on the host with
// the full store) or only what a device hands over (raw scores, the output, the exact
// attention, computed in this file from the definitions): a quantized key, an evicted key and
// calibrated scores over two steps. The rows recorder is pinned to the definitions above.
TEST(DiagnosticsByHand, ComparingRecorderWithAndWithoutRowsAgrees) {
  const KVStore full = full_store();
  const std::vector<std::vector<float>> no_probs(1);
  std::vector<Row> quantized = kPrompt;
  quantized[1].k = {0.25f, 0.75f};
  quantized[1].v = {-0.75f, 0.25f};
  const std::vector<Row> evicted = {kPrompt[0], kPrompt[2], kPrompt[3]};
  struct Case { const char* name; std::vector<Row> kept; bool calibrate; };
  for (const Case& c : {Case{"quantized key", quantized, false}, Case{"evicted key", evicted, false},
                        Case{"calibrated", quantized, true}}) {
    const PrefillView pv = view_of(full, no_probs, H);
    DecodeRecorder rows(4), with_rows(4, pv), without(4, pv);
    EXPECT_EQ(with_rows.compares_to(), pv.attention);
    EXPECT_EQ(rows.compares_to(), nullptr);
    for (int step = 0; step < 2; ++step) {
      record(rows, step, method_rows(c.kept, step), c.calibrate, 0.5f, 1.0f);
      record(with_rows, step, method_rows(c.kept, step), c.calibrate, 0.5f, 1.0f);
      record(without, step, method_rows(c.kept, step), c.calibrate, 0.5f, 1.0f, true);
    }
    for (const auto& e : without.entries()) {
      EXPECT_TRUE(e.compared && e.k.empty() && e.v.empty()) << c.name;
    }
    const auto want = compare_layers(pv, rows, full, 6, 0.01);
    for (const DecodeRecorder* r : {&with_rows, &without}) {
      const auto got = compare_layers(pv, *r, full, 6, 0.01);
      ASSERT_EQ(got.size(), 1u);
      const std::string what = std::string(c.name) + (r == &without ? " (no rows)" : " (rows)");
      ASSERT_GT(want[0].softmax_mse, 1e-6) << what;
      expect_close(got[0].softmax_mse, want[0].softmax_mse, what.c_str());
      expect_close(got[0].softmax_kl, want[0].softmax_kl, what.c_str());
      expect_close(got[0].output_rel_error, want[0].output_rel_error, what.c_str());
      EXPECT_DOUBLE_EQ(got[0].sparsity_decode, want[0].sparsity_decode) << what;
      EXPECT_EQ(got[0].visual_scores.exact, want[0].visual_scores.exact) << what;
      EXPECT_EQ(got[0].visual_scores.quantized, want[0].visual_scores.quantized) << what;
      EXPECT_EQ(got[0].visual_scores.calibrated, want[0].visual_scores.calibrated) << what;
      EXPECT_NEAR(got[0].visual_scores.lo, want[0].visual_scores.lo, 1e-6) << what;
    }
  }
  // An event with neither rows nor what a device hands over cannot be compared.
  DecodeRecorder bad(4, view_of(full, no_probs, H));
  const int32_t qpos = T;
  std::vector<float> q(H * D, 0.5f), sc(H * T, 0.0f), pr(H * T, 0.25f);
  std::vector<int32_t> kp = {0, 1, 2, 3};
  AttentionEvent e;
  e.phase = Phase::Decode;
  e.n_heads = H, e.n_kv_heads = 1, e.n_q = 1, e.n_k = T, e.head_dim = D;
  e.scores = sc.data(), e.probs = pr.data(), e.query_pos = &qpos, e.key_pos = kp.data(), e.key_kind = kKinds.data();
  e.q = q.data();
  EXPECT_THROW(bad.on_attention(e), InternalError);
}
