// Cases where a method's formula is easy to get subtly wrong and a random fixture would not
// notice: CalibQuant's γ, δ taken over the visual keys only while a text or generated key holds
// the extreme score; VL-Cache's sparsity on rows whose maximum sits on the diagonal; the
// Hadamard block size that `auto` resolves to.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/compress/method.h"
#include "core/compress/evict_methods.h"
#include "tests/option_bench.h"

using namespace kvlens;
using kvlens::testing::Bench;
using kvlens::testing::Scene;
using K = SegmentKind;

// γ, δ are the min and max of the visual scores only (Eq. 7). Here the system key holds a
// larger score and the text key a smaller one than any visual key, and a generated key the
// largest of all; a range over every key would map the visual scores differently.
TEST(CalibQuantEdges, RangeComesFromVisualKeysOnlyWhenOtherKeysHoldTheExtremes) {
  const std::vector<K> kinds = {K::System, K::Visual, K::Visual, K::Visual, K::PostVisionText, K::Generated};
  const std::vector<float> orig = {9.0f, 1.0f, 2.5f, -0.5f, -7.0f, 12.0f};
  std::vector<float> s = orig;
  auto p = make_policy("calibquant:bits=1,tau1=1,tau2=3");
  ASSERT_TRUE(p->has_score_transform());
  p->transform_scores(0, 0, s.data(), kinds.data(), static_cast<int>(s.size()));
  // γ = −0.5, δ = 2.5: g(x) = (δ − γ + τ1 − τ2)/(δ − γ)·(x − γ) + γ − τ1 = (x + 0.5)/3 − 1.5.
  EXPECT_FLOAT_EQ(s[3], -1.5f);  // γ − τ1
  EXPECT_FLOAT_EQ(s[2], -0.5f);  // δ − τ2
  EXPECT_FLOAT_EQ(s[1], -1.0f);
  for (int j : {0, 4, 5}) EXPECT_EQ(s[j], orig[j]) << "non-visual key " << j << " must not move";
  // The same with the visual keys at the far ends of the list and the extremes in the middle.
  const std::vector<K> k2 = {K::Visual, K::Generated, K::System, K::Visual};
  std::vector<float> s2 = {0.0f, -100.0f, 100.0f, 4.0f};
  p->transform_scores(0, 0, s2.data(), k2.data(), 4);
  EXPECT_FLOAT_EQ(s2[0], -1.0f);  // γ = 0 → −τ1
  EXPECT_FLOAT_EQ(s2[3], 1.0f);   // δ = 4 → 4 − τ2
  EXPECT_EQ(s2[1], -100.0f);
  EXPECT_EQ(s2[2], 100.0f);
}

// ThresholdFilter(A', p) zeroes A'_ij < p · max_j A'_ij over the unmasked row (j ≤ i, the
// diagonal included). Rows whose maximum is on the diagonal tell a max or a count that stops
// before the diagonal apart.
TEST(VLCacheEdges, SparsityWithRowMaximaOnTheDiagonal) {
  // S V P P: post-vision rows 2 and 3.
  Scene sc;
  sc.L = 1, sc.H = 1, sc.KH = 1, sc.D = 4, sc.n_sys = 1, sc.n_vis = 1, sc.n_txt = 2, sc.decode = 0;
  Bench b(sc);
  std::vector<float>& P = b.probs[0];
  std::fill(P.begin(), P.end(), 0.0f);
  const std::vector<std::vector<float>> rows = {{1}, {0.5f, 0.5f}, {0.1f, 0.2f, 0.7f}, {0.05f, 0.01f, 0.04f, 0.9f}};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j <= i; ++j) P[i * 4 + j] = rows[i][j];
  const PrefillContext c = b.contexts()[0];
  ASSERT_EQ(post_vision_begin(c), 2);
  // p = 0.2: thresholds 0.14 and 0.18 → zeros 0.1 | 0.05, 0.01, 0.04: 4 of 3 + 4 entries.
  EXPECT_DOUBLE_EQ(post_vision_head_sparsity(c, 0, 0.2), 4.0 / 7.0);
  // p = 0.1: thresholds 0.07 and 0.09 → zeros none | 0.05, 0.01, 0.04: 3 of 7.
  EXPECT_DOUBLE_EQ(post_vision_head_sparsity(c, 0, 0.1), 3.0 / 7.0);
  EXPECT_DOUBLE_EQ(post_vision_sparsity(c, 0.2), 4.0 / 7.0);
}

// `block=auto` is 16 halved until it divides head_dim: 8 for head_dim 24; an explicit block
// that does not divide head_dim is refused.
TEST(HadamardInt4Edges, AutoBlockFollowsHeadDim) {
  Scene sc;
  sc.D = 24, sc.L = 1, sc.n_vis = 10, sc.n_txt = 3;
  const Bench b(sc);
  using kvlens::testing::run_methods;
  using kvlens::testing::same_outcome;
  EXPECT_TRUE(same_outcome(run_methods(b, {"hadamard_int4"}), run_methods(b, {"hadamard_int4:block=8"})));
  EXPECT_THROW(run_methods(b, {"hadamard_int4:block=16"}), InputError);
  Scene s32 = sc;
  s32.D = 32;
  const Bench b32(s32);
  EXPECT_TRUE(same_outcome(run_methods(b32, {"hadamard_int4"}), run_methods(b32, {"hadamard_int4:block=16"})));
  EXPECT_FALSE(same_outcome(run_methods(b32, {"hadamard_int4"}), run_methods(b32, {"hadamard_int4:block=8"})));
}
