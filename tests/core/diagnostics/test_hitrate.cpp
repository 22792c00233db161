// CacheHitRate on hand-made attention: the layer-level rate (VL-Cache §3.2, head means) and the
// per-KV-head rate (truth and prediction per head) where they disagree, and ties broken as the
// selection code breaks them (to the earlier token).
#include <gtest/gtest.h>

#include <vector>

#include "core/diagnostics/diagnostics.h"
#include "core/errors.h"
#include "tests/held_attention.h"

using namespace kvlens;

namespace {

// One layer, two query heads over two KV heads (MHA), prompt of T tokens: prefill attention
// set row by row, one decode step whose attention over the prompt is `decode[h][j]`.
struct HandMade {
  int T;
  KVStore store;
  std::vector<std::vector<float>> probs;  // [1][H][T][T]
  mutable std::shared_ptr<kvlens::testing::HeldAttention> held;  // over probs
  std::vector<SegmentKind> kinds;
  DecodeRecorder rec{1};

  HandMade(int T_, const std::vector<std::vector<double>>& column_mass, const std::vector<std::vector<float>>& decode)
      : T(T_), store(1, 2, 2), probs(1, std::vector<float>(2 * T_ * T_, 0.0f)), kinds(T_, SegmentKind::Visual) {
    // Each prefill row i spreads its mass over keys j ≤ i in proportion to column_mass[h][j].
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < T; ++i) {
        double z = 0;
        for (int j = 0; j <= i; ++j) z += column_mass[h][j];
        for (int j = 0; j <= i; ++j) probs[0][(static_cast<size_t>(h) * T + i) * T + j] = static_cast<float>(column_mass[h][j] / z);
      }
    std::vector<int32_t> key_pos(2 * T), qpos = {T};
    for (int g = 0; g < 2; ++g)
      for (int j = 0; j < T; ++j) key_pos[g * T + j] = j;
    std::vector<SegmentKind> key_kind(2 * T, SegmentKind::Visual);
    std::vector<float> p, scores(2 * T, 0.0f), q(4, 0.0f), kv(2 * T * 2, 0.0f);
    for (const auto& row : decode) p.insert(p.end(), row.begin(), row.end());
    AttentionEvent e;
    e.phase = Phase::Decode, e.layer = 0, e.step = 0, e.n_heads = 2, e.n_kv_heads = 2, e.n_q = 1, e.n_k = T;
    e.scores = scores.data(), e.probs = p.data(), e.query_pos = qpos.data(), e.key_pos = key_pos.data();
    e.key_kind = key_kind.data(), e.q = q.data(), e.k = kv.data(), e.v = kv.data(), e.head_dim = 2;
    rec.on_attention(e);
  }
  HitRates rates(double budget) const {
    PrefillView pv;
    pv.full = &store;
    held = std::make_shared<kvlens::testing::HeldAttention>(probs, 2, T);
    pv.attention = held.get();
    pv.kinds = &kinds;
    pv.n_heads = 2;
    pv.prompt_len = T;
    return cache_hit_rates(pv, rec, budget, {0}, T);
  }
};

}  // namespace

TEST(CacheHitRate, LayerAndPerKvHeadRatesDifferWhereHeadsDisagree) {
  // Head 0 attends to token 1 in prefill and decode, head 1 to token 4. Every token is visual, so
  // the post-vision strategy reads the last prompt query: 30/35 on token 1 in head 0, 60/65 on
  // token 4 in head 1; the head mean ranks token 4 first. In decode head 0 is the more peaked
  // (0.9 on token 1 against 0.5 on token 4), so the head-mean truth ranks token 1 first.
  const int T = 6;
  std::vector<std::vector<double>> mass = {{1, 30, 1, 1, 1, 1}, {1, 1, 1, 1, 60, 1}};
  std::vector<std::vector<float>> decode = {{0.02f, 0.9f, 0.02f, 0.02f, 0.02f, 0.02f},
                                            {0.1f, 0.1f, 0.1f, 0.1f, 0.5f, 0.1f}};
  const HandMade m(T, mass, decode);
  const HitRates h = m.rates(1.0 / 6);  // k = floor(1/6 · 6) = 1
  ASSERT_EQ(h.k, 1);
  ASSERT_EQ(h.strategies[3], "post_vision");
  EXPECT_EQ(h.rates[3][0][0], 0.0);       // layer level: strategy picks 4, truth is 1
  EXPECT_EQ(h.rates_head[3][0][0], 1.0);  // per KV head: each head predicts its own token
  // k = 2: the layer level holds {1, 4} on both sides; per head the second pick is token 0 on
  // both sides (first of the tied rest).
  const HitRates h2 = m.rates(2.0 / 6);
  ASSERT_EQ(h2.k, 2);
  EXPECT_EQ(h2.rates[3][0][0], 1.0);
  EXPECT_EQ(h2.rates_head[3][0][0], 1.0);
  // Accumulated attention favours token 0 in head 1 (1 + 1/2 + 1/3 + 1/4 from the first rows),
  // so per head it holds {1} and {0}: half of the truth {1}, {4}.
  EXPECT_EQ(h.rates_head[0][0][0], 0.5);
}

TEST(CacheHitRate, TiesGoToTheEarlierTokenAsInSelection) {
  // Uniform decode attention: the true top-k is the first k tokens (ties to the earlier, as
  // top_k in core/compress/select.h), so recency (the last k) misses every one of them.
  const int T = 8;
  std::vector<std::vector<double>> mass(2, std::vector<double>(T, 1.0));
  std::vector<std::vector<float>> decode(2, std::vector<float>(T, 1.0f / T));
  const HitRates h = HandMade(T, mass, decode).rates(0.25);
  ASSERT_EQ(h.k, 2);
  ASSERT_EQ(h.strategies[4], "recency");
  EXPECT_EQ(h.rates[4][0][0], 0.0);
  EXPECT_EQ(h.rates_head[4][0][0], 0.0);
  // Accumulated attention of uniform rows favours early tokens: tokens 0 and 1, both hits.
  EXPECT_EQ(h.rates[0][0][0], 1.0);
  EXPECT_EQ(h.rates_head[0][0][0], 1.0);
  EXPECT_THROW(HandMade(T, mass, decode).rates(1.5), InputError);  // a budget is a share of the prompt
}
