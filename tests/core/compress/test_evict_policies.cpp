// Eviction / merge policies and the stack, on hand-made and seeded random prompts. Expected
// kept sets and merged values are derived by hand or recomputed here from the paper formulas;
// every run also checks the store invariants (k/v/pos aligned, kept rows exact copies unless
// merged, bytes = dense bytes of the kept rows).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "core/errors.h"
#include "core/compress/method.h"
#include "core/compress/evict_methods.h"
#include "core/half.h"
#include "core/compress/select.h"
#include "tests/evict_fixture.h"
#include "tests/layout_check.h"

using namespace kvlens;
using namespace kvlens::testing;


TEST(Select, BudgetAndTopK) {
  EXPECT_EQ(budget_rows(0.1, 40), 4);
  EXPECT_EQ(budget_rows(0.29, 100), 29);  // 0.29·100 is 28.999… in binary
  EXPECT_EQ(budget_rows(0.0, 40), 1);     // at least one row
  EXPECT_EQ(budget_rows(1.0, 40), 40);
  EXPECT_THROW(budget_rows(1.5, 40), InputError);
  // Ties go to the earlier index; the result is ascending.
  EXPECT_EQ(top_k({1, 3, 3, 0, 3}, 2), (std::vector<int>{1, 2}));
  EXPECT_EQ(select_recent_topk({9, 1, 5, 7, 0, 0}, make_plan(4, 2, 6)), (std::vector<int>{0, 3, 4, 5}));
}

TEST(VLCache, SparsityOnTinyMatrixByHand) {
  // S V V P P: post-vision rows are 3 and 4; rows 0-2 (full of tiny entries) must not count.
  Prompt P(1, 1, 1, 4, layout(1, 2, 2), 1);
  P.set_row(0, 0, 0, {1});
  P.set_row(0, 0, 1, {0.999, 0.001});
  P.set_row(0, 0, 2, {0.998, 0.001, 0.001});
  P.set_row(0, 0, 3, {0.5, 0.004, 0.3, 0.196});
  P.set_row(0, 0, 4, {0.6, 0.2, 0.001, 0.1, 0.099});
  const PrefillContext c = P.contexts()[0];
  EXPECT_EQ(post_vision_begin(c), 3);
  // p = 0.01: thresholds 0.005 and 0.006 zero one entry in each row: 2 zeros of 4 + 5 entries.
  EXPECT_DOUBLE_EQ(post_vision_sparsity(c, 0.01), 2.0 / 9.0);
  // p = 0.5: thresholds 0.25 (keeps 0.5, 0.3) and 0.3 (keeps 0.6): 2 + 4 zeros of 9.
  EXPECT_DOUBLE_EQ(post_vision_sparsity(c, 0.5), 6.0 / 9.0);
}

TEST(VLCache, LayerSparsityIsTheMeanOfItsHeadsFromOneReduction) {
  // Four query heads with different rows: γ(l) is the mean of the heads' shares, each head's
  // share is its own, and the layer's γ asks the attention for one reduction.
  Prompt P(1, 4, 2, 4, layout(1, 2, 3), 3);
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(-4.0, 4.0);
  for (int h = 0; h < 4; ++h) {
    std::vector<std::vector<double>> logits(static_cast<size_t>(P.T), std::vector<double>(static_cast<size_t>(P.T)));
    for (auto& row : logits)
      for (double& x : row) x = u(rng) * (h + 1);
    P.set_logits(0, h, logits);
  }
  const PrefillContext c = P.contexts()[0];
  const size_t before = P.held->asked().size();
  const double g = post_vision_sparsity(c, 0.05);
  EXPECT_EQ(P.held->asked().size(), before + 1);
  double mean = 0;
  std::set<double> shares;
  for (int h = 0; h < 4; ++h) {
    const double s = post_vision_head_sparsity(c, h, 0.05);
    shares.insert(s);
    mean += s / 4;
  }
  EXPECT_GT(shares.size(), 1u);  // (the heads differ, so a head's share read from another would show)
  EXPECT_DOUBLE_EQ(g, mean);
  EXPECT_THROW(post_vision_head_sparsity(c, 4, 0.05), InputError);
}

TEST(VLCache, BudgetsSumToAlphaLWithinClipping) {
  std::mt19937 rng(7);
  // γ in [0.3, 0.9]: every raw share (1−γ)/Z·αL lies in [0.1/8.4·1.2, 0.7/1.2·1.2] ⊂ (0.01, 1).
  std::uniform_real_distribution<double> u(0.3, 0.9);
  std::vector<double> gamma(12);
  for (double& g : gamma) g = u(rng);
  const double alpha = 0.1, L = 12;
  const std::vector<double> beta = sparsity_budgets(gamma, alpha);
  double sum = 0, Z = 0;
  for (double g : gamma) Z += 1 - g;
  int clipped_layers = 0;
  for (size_t l = 0; l < beta.size(); ++l) {
    sum += beta[l];
    EXPECT_GE(beta[l], 0.01);
    EXPECT_LE(beta[l], 1.0);
    const double raw = (1 - gamma[l]) / Z * alpha * L;
    clipped_layers += raw < 0.01 || raw > 1;
    EXPECT_NEAR(beta[l], std::clamp(raw, 0.01, 1.0), 4 * DBL_EPSILON);
  }
  // Nothing clipped with these γ, so Σβ = α·L up to the rounding of L terms of size ≤ 1.
  ASSERT_EQ(clipped_layers, 0);
  EXPECT_NEAR(sum, alpha * L, 4 * L * DBL_EPSILON);
  // A dense layer under a large α clips at 1; a nearly empty one at 0.01.
  const std::vector<double> c = sparsity_budgets({0.0, 0.9, 0.999999}, 0.6);
  EXPECT_EQ(c[0], 1.0);
  EXPECT_NEAR(c[1], 0.1 / (1 + 0.1 + 1e-6) * 1.8, 1e-12);
  EXPECT_EQ(c[2], 0.01);
}

TEST(VLCache, LayerBudgetsAndPsiRankingEndToEnd) {
  // 4 layers of different sharpness, GQA: 4 query heads over 2 KV heads; post-vision from 31.
  Prompt P(4, 4, 2, 8, layout(3, 28, 9), 11);
  P.random_logits(12, 0.5, 6.0);
  const Prompt U0 = P;
  const KVStore before = P.store;
  const double alpha = 0.3, p = 0.01;
  make(vlcache_method(), {{"budget", "0.3"}})->on_prefill(P.contexts(), P.store);
  expect_consistent(before, P.store, true);
  // γ(l) recomputed here from the probabilities, then Algorithm 1.
  std::vector<double> gamma(P.L);
  for (int l = 0; l < P.L; ++l) {
    double acc = 0;
    for (int h = 0; h < P.H; ++h) {
      int zeros = 0, total = 0;
      for (int i = 31; i < P.T; ++i) {
        float mx = 0;
        for (int j = 0; j <= i; ++j) mx = std::max(mx, P.prob(l, h, i, j));
        for (int j = 0; j <= i; ++j) zeros += P.prob(l, h, i, j) < p * mx;
        total += i + 1;
      }
      acc += static_cast<double>(zeros) / total;
    }
    gamma[l] = acc / P.H;
  }
  double Z = 0;
  for (double g : gamma) Z += 1 - g;
  std::set<int> sizes;
  for (int l = 0; l < P.L; ++l) {
    const double beta = std::clamp((1 - gamma[l]) / Z * alpha * P.L, 0.01, 1.0);
    const int keep = std::max(1, static_cast<int>(std::floor(beta * P.T + 1e-6)));
    const int recent = static_cast<int>(std::floor(0.1 * keep + 1e-6));
    sizes.insert(keep);
    for (int h = 0; h < P.Hkv; ++h)
      EXPECT_EQ(kept_pos(P.store, l, h), ref_keep(ref_colsum(P, l, h, 31), keep, recent))
          << "layer " << l << " head " << h;
  }
  EXPECT_GT(sizes.size(), 1u) << "layers of different sparsity should get different budgets";
  // uniform mode: every layer keeps floor(α·T) = 12.
  Prompt U = U0;
  make(vlcache_method(), {{"budget", "0.3"}, {"budget_mode", "uniform"}})->on_prefill(U.contexts(), U.store);
  for (int l = 0; l < U.L; ++l) EXPECT_EQ(U.store.n_rows(l, 0), 12);
}

TEST(Eviction, Fp16StoresKeepHalfRowsAndCountTwoBytes) {
  // The decode cache stores dense rows as fp16 by default: eviction keeps them (2 B a value)
  // and a merged row is rounded to half precision again, as the segment stores rows.
  Prompt P(2, 4, 2, 8, layout(3, 30, 7), 41);
  P.random_logits(42, 1.0, 3.0);
  Prompt E = P, M = P, R = P;
  for (Prompt* x : {&E, &M, &R}) x->store.set_row_storage(RowStorage::Fp16);
  make(h2o_method(), {{"budget", "0.3"}})->on_prefill(E.contexts(), E.store);
  expect_consistent(R.store, E.store, true);
  make(lookm_method(), {{"merge", "pivotal"}})->on_prefill(M.contexts(), M.store);
  expect_consistent(R.store, M.store, false);
  int merged_rows = 0;
  for (int l = 0; l < P.L; ++l)
    for (int h = 0; h < P.Hkv; ++h) {
      std::vector<float> k, v, km, vm;
      std::vector<int32_t> pos, pm;
      R.store.gather(l, h, k, v, pos);
      M.store.gather(l, h, km, vm, pm);
      const std::vector<int> keep(pm.begin(), pm.end());
      lookm_merge(MergeKind::Pivotal, P.D, keep, k, v);  // on the fp16 rows, in fp32
      for (size_t r = 0; r < keep.size(); ++r)
        for (int t = 0; t < P.D; ++t) {
          EXPECT_EQ(km[r * P.D + t], round_half(k[keep[r] * P.D + t]));
          EXPECT_EQ(vm[r * P.D + t], round_half(v[keep[r] * P.D + t]));
          merged_rows += km[r * P.D + t] != k[keep[r] * P.D + t];
        }
    }
  EXPECT_GT(merged_rows, 0) << "some merged values are not half-representable before rounding";
  for (const KVStore* s : {&E.store, &M.store})
    for (int l = 0; l < P.L; ++l)
      for (const KVSegment& seg : s->layer(l).segments) EXPECT_EQ(seg.storage, "fp16");
}

TEST(H2O, KeepsHeavyHittersAndRecentOnDesignedMatrix) {
  // Every query puts logit 5 on columns 2 and 5 (once visible): column sums rank 2 (≈5.4),
  // then 5 (≈2.5), then 0 (≈1.5).
  Prompt P(1, 1, 1, 4, layout(10, 0, 0), 41);
  std::vector<std::vector<double>> lg(10, std::vector<double>(10, 0.0));
  for (auto& row : lg) row[2] = row[5] = 5.0;
  P.set_logits(0, 0, lg);
  const KVStore before = P.store;
  // budget 0.4 → 4 rows; recent_ratio 0.5 → tokens 8, 9; heavy hitters among 0..7: 2, 5.
  make(h2o_method(), {{"budget", "0.4"}})->on_prefill(P.contexts(), P.store);
  EXPECT_EQ(kept_pos(P.store, 0, 0), (std::vector<int32_t>{2, 5, 8, 9}));
  expect_consistent(before, P.store, true);
}

TEST(SnapKV, MaxPoolSpreadsTheVoteToNeighbours) {
  // Window rows 16..19 give 0.4 to column 7, 0.3 to column 3, 0.2 to column 12, 0.1 spread
  // over the rest: votes 1.6, 1.2, 0.8 and ≈0.03 elsewhere.
  auto build = [] {
    auto P = std::make_unique<Prompt>(1, 1, 1, 4, layout(20, 0, 0), 51);
    for (int i = 0; i < 20; ++i) {
      std::vector<double> row(i + 1, 1.0 / (i + 1));
      if (i >= 16) {
        for (double& x : row) x = 0.1 / (i + 1 - 3);
        row[7] = 0.4, row[3] = 0.3, row[12] = 0.2;
      }
      P->set_row(0, 0, i, row);
    }
    return P;
  };
  // budget 0.3 → 6 rows = the window of 4 + 2 voted. Kernel 1 (no pooling): 7 and 3.
  auto A = build();
  make(snapkv_method(), {{"budget", "0.3"}, {"window", "4"}, {"kernel", "1"}})->on_prefill(A->contexts(), A->store);
  EXPECT_EQ(kept_pos(A->store, 0, 0), (std::vector<int32_t>{3, 7, 16, 17, 18, 19}));
  // Kernel 3: 6, 7, 8 all pool to 1.6 (above 1.2 around 3); ties go to the earlier: 6, 7.
  auto B = build();
  const KVStore before = B->store;
  make(snapkv_method(), {{"budget", "0.3"}, {"window", "4"}, {"kernel", "3"}})->on_prefill(B->contexts(), B->store);
  EXPECT_EQ(kept_pos(B->store, 0, 0), (std::vector<int32_t>{6, 7, 16, 17, 18, 19}));
  expect_consistent(before, B->store, true);
  // The pooled scores themselves: max ignores the padding, avg divides by the kernel (padding
  // counts as 0); window keys are always kept (+inf). Votes are sums of 4 float probabilities,
  // each rounded once (relative 2^-24), so 8·2^-24 bounds their error.
  const auto C = build();  // the contexts point into it: keep it alive
  const PrefillContext c = C->contexts()[0];
  double r = 0;  // what a column other than 3, 7, 12 receives from the window
  for (int i = 16; i < 20; ++i) r += 0.1 / (i + 1 - 3);
  const std::vector<double> mx = snapkv_scores(c, 0, 4, 3, Pooling::Max);
  const std::vector<double> av = snapkv_scores(c, 0, 4, 3, Pooling::Avg);
  const double tol = 8 * std::ldexp(1.0, -24);
  EXPECT_NEAR(mx[8], 1.6, tol);
  EXPECT_NEAR(mx[0], r, tol);
  EXPECT_NEAR(av[0], 2 * r / 3, tol);            // padding on the left
  EXPECT_NEAR(av[15], (r + r) / 3, tol);         // padding at the window's edge
  EXPECT_NEAR(av[13], (0.8 + 2 * r) / 3, tol);
  EXPECT_NEAR(av[10], 3 * r / 3, tol);
  for (int j = 16; j < 20; ++j) EXPECT_TRUE(std::isinf(mx[j]) && std::isinf(av[j]));
  EXPECT_THROW(make(snapkv_method(), {{"kernel", "4"}}), InputError);
}

TEST(StreamingLLM, KeepsSinksAndRecent) {
  Prompt P(2, 2, 1, 4, layout(5, 40, 5), 61);
  const KVStore before = P.store;
  make(streamingllm_method(), {{"budget", "0.2"}})->on_prefill(P.contexts(), P.store);
  const std::vector<int32_t> want = {0, 1, 2, 3, 44, 45, 46, 47, 48, 49};
  for (int l = 0; l < 2; ++l) EXPECT_EQ(kept_pos(P.store, l, 0), want);
  expect_consistent(before, P.store, true);
}

TEST(PyramidKV, BudgetsDecreaseWithDepthAndAverageAlpha) {
  for (double alpha : {0.1, 0.3, 0.7}) {
    const std::vector<double> b = pyramid_budgets(8, alpha, 20);
    double sum = 0;
    for (size_t l = 0; l < b.size(); ++l) {
      sum += b[l];
      if (l) {
        EXPECT_LT(b[l], b[l - 1]);
      }
      EXPECT_GE(b[l], 0.0);
      EXPECT_LE(b[l], 1.0);
    }
    // A few roundings per term, each at most an ulp of 1.
    EXPECT_NEAR(sum / 8, alpha, 8 * DBL_EPSILON);
    if (alpha < 0.5) {
      EXPECT_NEAR(b.back(), alpha / 20, 4 * DBL_EPSILON);
      EXPECT_NEAR(b.front(), 2 * alpha - alpha / 20, 4 * DBL_EPSILON);
    } else {
      EXPECT_EQ(b.front(), 1.0);  // capped; the last layer takes 2α − 1 so the mean stays α
    }
  }
  Prompt P(6, 2, 2, 4, layout(4, 80, 16), 71);
  P.random_logits(72, 1.0, 2.0);
  const KVStore before = P.store;
  make(pyramidkv_method(), {{"budget", "0.2"}, {"window", "8"}})->on_prefill(P.contexts(), P.store);
  const std::vector<double> b = pyramid_budgets(6, 0.2, 20);
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(P.store.n_rows(l, 0), std::max(1, static_cast<int>(std::floor(b[l] * 100 + 1e-6))));
    if (l) {
      EXPECT_LE(P.store.n_rows(l, 0), P.store.n_rows(l - 1, 0));
    }
  }
  EXPECT_GT(P.store.n_rows(0, 0), P.store.n_rows(5, 0));
  expect_consistent(before, P.store, true);
}

TEST(EveryMethod, InvariantsOnRandomGQAPrompt) {
  const std::vector<std::pair<MethodSpec, std::map<std::string, std::string>>> runs = {
      {vlcache_method(), {}},
      {vlcache_method(), {{"budget_mode", "uniform"}}},
      {lookm_method(), {{"merge", "none"}}},
      {lookm_method(), {{"merge", "average"}}},
      {lookm_method(), {}},
      {lookm_method(), {{"merge", "weighted"}, {"text_keep", "all"}}},
      {h2o_method(), {}},
      {snapkv_method(), {{"window", "8"}}},
      {streamingllm_method(), {}},
      {pyramidkv_method(), {{"window", "8"}}}};
  for (const auto& [m, set] : runs) {
    Prompt P(3, 6, 2, 8, layout(5, 50, 10), 81);
    P.random_logits(82, 0.5, 4.0);
    const KVStore before = P.store;
    SCOPED_TRACE(m.name);
    make(m, set)->on_prefill(P.contexts(), P.store);
    const bool merges = m.name == "lookm" && (!set.count("merge") || set.at("merge") != "none");
    expect_consistent(before, P.store, !merges);
    for (int l = 0; l < P.L; ++l)
      for (int h = 0; h < P.Hkv; ++h) {
        EXPECT_LT(P.store.n_rows(l, h), P.T);
        // Every method but VL-Cache (10 % of a small budget rounds to no window here) keeps a
        // recent window, so the last prompt token.
        if (m.name != "vlcache") {
          EXPECT_EQ(kept_pos(P.store, l, h).back(), P.T - 1);
        }
      }
  }
}

// Every method that scores by column sums has every layer's sums (and VL-Cache its counts)
// prepared at once before any layer asks for its own: each reduction a method asks is over rows
// prepared earlier for that layer, with the same counts.
TEST(EveryMethod, ScoringMethodsPrepareEveryLayerBeforeAsking) {
  const std::vector<std::pair<MethodSpec, std::map<std::string, std::string>>> runs = {
      {vlcache_method(), {}},
      {vlcache_method(), {{"budget_mode", "uniform"}}},
      {lookm_method(), {}},
      {h2o_method(), {}},
      {snapkv_method(), {{"window", "8"}}},
      {pyramidkv_method(), {{"window", "8"}}}};
  for (const auto& [m, set] : runs) {
    Prompt P(4, 6, 2, 8, layout(5, 50, 10), 91);
    P.random_logits(92, 0.5, 4.0);
    SCOPED_TRACE(m.name + (set.empty() ? "" : " " + set.begin()->second));
    const std::vector<PrefillContext> cs = P.contexts();
    make(m, set)->on_prefill(cs, P.store);
    const auto asked = P.held->asked();
    int prepared = 0, reductions = 0;
    for (size_t i = 0; i < asked.size(); ++i) {
      const auto& a = asked[i];
      if (a.prepare) {
        ++prepared;
        EXPECT_EQ(a.layers, std::vector<int>({0, 1, 2, 3})) << "every layer, in order";
        continue;
      }
      ++reductions;
      bool covered = false;
      for (size_t j = 0; j < i; ++j) {
        const auto& b = asked[j];
        covered = covered || (b.prepare && b.queries == a.queries &&
                              std::count(b.layers.begin(), b.layers.end(), a.layers[0]) &&
                              (!a.below || (b.below && b.p == a.p && b.zeros_below == a.zeros_below)));
      }
      EXPECT_TRUE(covered) << "a reduction of layer " << a.layers[0] << " over " << a.queries.size()
                           << " rows from " << (a.queries.empty() ? -1 : a.queries[0]) << " was not prepared";
    }
    EXPECT_GE(prepared, 1);
    EXPECT_GE(reductions, P.L);
  }
}

// On a device backend a method that reads no rows acts on the store's layout alone (the device
// gathers the kept rows): the same kept positions, kinds and bytes as on the rows, and no rows
// appear. None reads rows on the host; LOOK-M's merge on the layout alone needs a device cache
// to merge in (Backend::kv_lookm_merge) and is refused without one.
TEST(Eviction, MethodsThatReadNoRowsActOnTheLayoutAlone) {
  const std::vector<std::pair<MethodSpec, std::map<std::string, std::string>>> runs = {
      {vlcache_method(), {}},      {lookm_method(), {{"merge", "none"}}}, {h2o_method(), {}},
      {snapkv_method(), {{"window", "8"}}}, {streamingllm_method(), {}}, {pyramidkv_method(), {{"window", "8"}}},
      {lookm_method(), {}}};
  for (const auto& [m, set] : runs) {
    SCOPED_TRACE(m.name + (set.count("merge") ? " merge=" + set.at("merge") : ""));
    Prompt P(3, 6, 2, 8, layout(5, 50, 10), 83);
    P.random_logits(84, 0.5, 4.0);
    P.store.set_row_storage(RowStorage::Fp16);
    KVStore layout_only = P.store.without_rows();
    EXPECT_FALSE(layout_only.has_rows());
    const std::unique_ptr<KVPolicy> policy = make(m, set);
    EXPECT_FALSE(policy->reads_rows());
    if (m.name == "lookm" && !set.count("merge")) {
      EXPECT_THROW(policy->on_prefill(P.contexts(), layout_only), InternalError);
      continue;
    }
    make(m, set)->on_prefill(P.contexts(), P.store);
    policy->on_prefill(P.contexts(), layout_only);
    for (int l = 0; l < P.L; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      expect_layout_of(layout_only.layer(l), P.store.layer(l));
      EXPECT_EQ(layout_only.bytes(l).total(), P.store.bytes(l).total());
    }
  }
}

TEST(Eviction, RejectsAStoreThatIsNotThePrompt) {
  Prompt P(1, 2, 2, 4, layout(2, 6, 2), 91);
  std::vector<PrefillContext> cs = P.contexts();
  cs[0].prompt_len = 9;  // the store holds 10 rows
  EXPECT_THROW(make(h2o_method())->on_prefill(cs, P.store), InputError);
  cs = P.contexts();
  cs[0].attention = nullptr;
  EXPECT_THROW(make(vlcache_method())->on_prefill(cs, P.store), InputError);
}

TEST(Stack, EvictsThenQuantizesAndRoutesParameters) {
  Prompt P(2, 4, 2, 8, layout(3, 40, 7), 101);
  P.random_logits(102, 1.0, 3.0);
  Prompt A = P, B = P, C = P;
  make_policy("vlcache:budget=0.2")->on_prefill(A.contexts(), A.store);
  make_policy("stack:evict=vlcache,quant=none,budget=0.2")->on_prefill(B.contexts(), B.store);
  make_policy("stack:evict=vlcache,quant=calibquant,budget=0.2,bits=1")->on_prefill(C.contexts(), C.store);
  for (int l = 0; l < P.L; ++l) {
    for (int h = 0; h < P.Hkv; ++h) {
      EXPECT_EQ(kept_pos(B.store, l, h), kept_pos(A.store, l, h));
      EXPECT_EQ(kept_pos(C.store, l, h), kept_pos(A.store, l, h));
    }
    EXPECT_EQ(B.store.bytes(l).total(), A.store.bytes(l).total());
  }
  expect_consistent(P.store, B.store, true);
  bool quantized = false;
  for (int l = 0; l < P.L; ++l)
    for (const KVSegment& s : C.store.layer(l).segments) quantized = quantized || !s.dense();
  EXPECT_TRUE(quantized);
  EXPECT_LT(C.store.bytes().total(), A.store.bytes().total()) << "1-bit visual rows are smaller";
  // Parameters reach the inner method that declares them, validated by its own schema.
  EXPECT_THROW(make_policy("stack:evict=h2o,quant=none,alpha1=0.2"), InputError);
  EXPECT_THROW(make_policy("stack:evict=vlcache,quant=none,budget=2"), InputError);
  EXPECT_THROW(make_policy("stack:evict=vlcache,quant=calibquant,bits=3"), InputError);
  EXPECT_NO_THROW(make_policy("stack:evict=lookm,quant=calibquant,evict_preset=official,quant_preset=paper"));
  // "evict.<name>" reaches the eviction side only (recent_ratio is also a ZipCache parameter).
  Prompt D = P, E = P;
  make_policy("h2o:budget=0.3,recent_ratio=0.2")->on_prefill(D.contexts(), D.store);
  make_policy("stack:evict=h2o,quant=none,budget=0.3,evict.recent_ratio=0.2")->on_prefill(E.contexts(), E.store);
  for (int l = 0; l < P.L; ++l) EXPECT_EQ(kept_pos(E.store, l, 1), kept_pos(D.store, l, 1));
  EXPECT_THROW(make_policy("stack:evict=h2o,quant=none,quant.recent_ratio=0.2"), InputError);
  // Every eviction method is registered with a schema whose defaults validate.
  for (const char* name : {"vlcache", "lookm", "h2o", "snapkv", "streamingllm", "pyramidkv", "stack"})
    EXPECT_NO_THROW(parse_method_spec(name)) << name;
}

TEST(Select, KeepRowsCarriesRowAnnotations) {
  Prompt P(1, 2, 2, 4, layout(2, 5, 3), 51);
  LayerKV& L = P.store.layer(0);
  // Visual rows annotated (bits 16 and merged = position), the text segment only partly (a row
  // appended after the annotation was written), the system segment not at all.
  for (HeadRows& r : L.segments[1].heads) {
    for (int32_t p : r.pos) r.bits.push_back(16), r.merged.push_back(static_cast<uint16_t>(p));
    r.bits[1] = 32;
  }
  for (HeadRows& r : L.segments[2].heads) r.merged = {7, 8};
  const std::vector<std::vector<int>> keep = {{0, 3, 4, 6, 8, 9}, {1, 2, 5, 9}};
  keep_rows("test", L, P.D, keep);
  for (int h = 0; h < 2; ++h) {
    std::vector<int> bits, merged;
    std::vector<int32_t> pos;
    for (const KVSegment& s : L.segments) {
      const HeadRows& r = s.heads[h];
      EXPECT_TRUE(r.bits.empty() || r.bits.size() == static_cast<size_t>(r.n()));
      EXPECT_TRUE(r.merged.empty() || r.merged.size() == static_cast<size_t>(r.n()));
      for (int i = 0; i < r.n(); ++i) {
        pos.push_back(r.pos[i]);
        bits.push_back(r.bits.empty() ? -1 : r.bits[i]);
        merged.push_back(r.merged.empty() ? -1 : r.merged[i]);
      }
    }
    EXPECT_EQ(pos, std::vector<int32_t>(keep[h].begin(), keep[h].end()));
    if (h == 0) {  // rows 0 | 3 4 6 | 8 9
      EXPECT_EQ(bits, (std::vector<int>{-1, 32, 16, 16, -1, -1}));
      EXPECT_EQ(merged, (std::vector<int>{-1, 3, 4, 6, 8, 0}));
    } else {  // rows 1 | 2 5 | 9
      EXPECT_EQ(bits, (std::vector<int>{-1, 16, 16, -1}));
      EXPECT_EQ(merged, (std::vector<int>{-1, 2, 5, 0}));
    }
  }
}
