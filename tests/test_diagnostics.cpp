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
#include <cmath>
#include <numeric>
#include <random>
#include <set>

#include "core/diagnostics.h"
#include "core/policies/quant_methods.h"

using namespace kvlens;
using K = SegmentKind;

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
    v.full = &store, v.probs = &probs, v.kinds = &kinds, v.n_heads = H, v.prompt_len = T;
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

// Steps that were not recorded are dropped from the report; k rounds budget · T, at least 1.
TEST(CacheHitRate, StepsAndK) {
  const HitRun run(5);
  const HitRates hr = cache_hit_rates(run.view(), run.rec, 0.2, {0, 1, 2, 9}, 4);
  EXPECT_EQ(hr.steps, (std::vector<int>{0, 2}));
  EXPECT_EQ(hr.k, 3);  // round(0.2 · 16) = 3
  EXPECT_EQ(cache_hit_rates(run.view(), run.rec, 0.001, {0}, 4).k, 1);
  ASSERT_EQ(hr.rates.size(), 5u);
  for (const auto& s : hr.rates) {
    ASSERT_EQ(s.size(), 2u);
    for (const auto& per_layer : s) EXPECT_EQ(per_layer.size(), static_cast<size_t>(HitRun::L));
  }
}
