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
#include "core/method.h"
#include "core/policies/evict_methods.h"
#include "core/half.h"
#include "core/policies/select.h"

using namespace kvlens;
using K = SegmentKind;

namespace {

// A prefilled prompt: per-layer probs [H][T][T], scores, queries, and the store holding it.
struct Prompt {
  int L = 1, H = 1, Hkv = 1, D = 4, T = 0;
  std::vector<K> kinds;
  std::vector<int> ids;
  std::vector<std::vector<float>> q, probs, scores;
  KVStore store;

  Prompt(int L_, int H_, int Hkv_, int D_, std::vector<K> kinds_, uint32_t seed)
      : L(L_), H(H_), Hkv(Hkv_), D(D_), T(static_cast<int>(kinds_.size())), kinds(kinds_),
        store(L_, Hkv_, D_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> g(0.f, 1.f);
    ids.resize(T);
    for (int t = 0; t < T; ++t) ids[t] = 3 + t;
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; ++t) pos[t] = t;
    q.assign(L, std::vector<float>(static_cast<size_t>(T) * H * D));
    probs.assign(L, std::vector<float>(static_cast<size_t>(H) * T * T, 0.f));
    scores.assign(L, std::vector<float>(static_cast<size_t>(H) * T * T, -INFINITY));
    for (int l = 0; l < L; ++l) {
      std::vector<float> k(static_cast<size_t>(T) * Hkv * D), v(k.size());
      for (float& x : k) x = g(rng);
      for (float& x : v) x = g(rng);
      for (float& x : q[l]) x = g(rng);
      store.append(l, k.data(), v.data(), pos.data(), kinds.data(), T);
    }
  }
  // Causal softmax of logits[i][j] (j ≤ i) into head h of layer l.
  void set_logits(int l, int h, const std::vector<std::vector<double>>& logits) {
    for (int i = 0; i < T; ++i) {
      double mx = -INFINITY, z = 0;
      for (int j = 0; j <= i; ++j) mx = std::max(mx, logits[i][j]);
      for (int j = 0; j <= i; ++j) z += std::exp(logits[i][j] - mx);
      for (int j = 0; j <= i; ++j) {
        const size_t at = (static_cast<size_t>(h) * T + i) * T + j;
        probs[l][at] = static_cast<float>(std::exp(logits[i][j] - mx) / z);
        scores[l][at] = static_cast<float>(logits[i][j]);
      }
    }
  }
  // Gaussian logits whose scale grows over layers and heads (different sparsity each).
  void random_logits(uint32_t seed, double sigma_min, double sigma_max) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> g(0., 1.);
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h) {
        const double sigma =
            sigma_min + (sigma_max - sigma_min) * (l * H + h) / std::max(1, L * H - 1);
        std::vector<std::vector<double>> lg(T, std::vector<double>(T));
        for (auto& row : lg)
          for (double& x : row) x = sigma * g(rng);
        set_logits(l, h, lg);
      }
  }
  // Row i of head h, layer l, set directly (causal, sums to 1).
  void set_row(int l, int h, int i, const std::vector<double>& row) {
    for (int j = 0; j < T; ++j)
      probs[l][(static_cast<size_t>(h) * T + i) * T + j] = j <= i ? static_cast<float>(row[j]) : 0.f;
  }
  std::vector<PrefillContext> contexts() const {
    std::vector<PrefillContext> cs(L);
    for (int l = 0; l < L; ++l) {
      PrefillContext& c = cs[l];
      c.layer = l, c.n_layers = L, c.n_heads = H, c.n_kv_heads = Hkv, c.head_dim = D;
      c.prompt_len = T, c.q = q[l].data(), c.probs = probs[l].data(), c.scores = scores[l].data();
      c.token_kinds = &kinds, c.token_ids = &ids;
    }
    return cs;
  }
  float prob(int l, int h, int i, int j) const {
    return probs[l][(static_cast<size_t>(h) * T + i) * T + j];
  }
};

std::vector<K> layout(int sys, int vis, int post) {
  std::vector<K> k(sys, K::System);
  k.insert(k.end(), vis, K::Visual);
  k.insert(k.end(), post, K::PostVisionText);
  return k;
}

// A policy from its schema with defaults filled in (the registry is not needed).
std::unique_ptr<KVPolicy> make(const MethodSpec& m, std::map<std::string, std::string> set = {}) {
  std::map<std::string, std::string> v;
  for (const ParamSpec& p : m.params) v[p.name] = validate_param(m.name, p, p.def);
  for (const auto& [k, x] : set) {
    EXPECT_TRUE(v.count(k)) << m.name << " has no " << k;
    v[k] = validate_param(m.name, *std::find_if(m.params.begin(), m.params.end(),
                                                [&](const ParamSpec& p) { return p.name == k; }),
                          x);
  }
  return m.make(Params(m.name, v));
}

std::vector<int32_t> kept_pos(const KVStore& s, int l, int h) {
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  s.gather(l, h, k, v, pos);
  return pos;
}

// Invariants after any eviction: rows aligned and ascending, kinds preserved, kept rows exact
// copies (when `exact`), segment bytes = dense bytes (4 B per fp32 value, 2 B per fp16 value) of
// the rows it holds.
void expect_consistent(const KVStore& before, const KVStore& after, bool exact) {
  const int D = before.head_dim();
  for (int l = 0; l < before.n_layers(); ++l) {
    for (int h = 0; h < before.n_kv_heads(); ++h) {
      std::vector<float> kb, vb, ka, va;
      std::vector<int32_t> pb, pa;
      std::vector<K> sb, sa;
      before.gather(l, h, kb, vb, pb, &sb);
      after.gather(l, h, ka, va, pa, &sa);
      ASSERT_EQ(ka.size(), pa.size() * D);
      ASSERT_EQ(va.size(), pa.size() * D);
      ASSERT_GE(pa.size(), 1u) << "layer " << l << " head " << h << " kept nothing";
      for (size_t r = 0; r < pa.size(); ++r) {
        if (r) {
          EXPECT_LT(pa[r - 1], pa[r]);
        }
        const int src = pa[r];  // positions are prompt indices in these prompts
        ASSERT_GE(src, 0);
        ASSERT_LT(src, static_cast<int>(pb.size()));
        EXPECT_EQ(sa[r], sb[src]);
        if (exact) {
          EXPECT_EQ(0, std::memcmp(&ka[r * D], &kb[src * D], D * sizeof(float)));
          EXPECT_EQ(0, std::memcmp(&va[r * D], &vb[src * D], D * sizeof(float)));
        }
      }
    }
    for (const KVSegment& s : after.layer(l).segments) {
      int64_t rows = 0;
      for (const HeadRows& r : s.heads) rows += r.n();
      EXPECT_GT(rows, 0) << "a segment empty in every head should be dropped";
      ASSERT_TRUE(s.dense()) << s.storage;
      const int bpv = s.storage == "fp16" ? 2 : 4;
      EXPECT_EQ(s.bytes.codes, rows * 2 * D * bpv);
      EXPECT_EQ(s.bytes.indices, rows * 4);
      EXPECT_EQ(s.bytes.total(), rows * (2 * D * bpv + 4));
    }
  }
}

// Recomputed here: mean over a KV head's query group of Σ_{i in [a, T)} probs[h][i][j].
std::vector<double> ref_colsum(const Prompt& P, int l, int kvh, int a) {
  const int g = P.H / P.Hkv;
  std::vector<double> s(P.T, 0.0);
  for (int j = 0; j < P.T; ++j) {
    for (int h = kvh * g; h < (kvh + 1) * g; ++h) {
      double col = 0;
      for (int i = std::max(a, j); i < P.T; ++i) col += P.prob(l, h, i, j);
      s[j] += col;
    }
    s[j] /= g;
  }
  return s;
}

// Recomputed here: the last r tokens plus the best (k − r) of the others (ties: earlier).
std::vector<int32_t> ref_keep(const std::vector<double>& s, int k, int r) {
  const int n = static_cast<int>(s.size());
  std::vector<std::pair<double, int>> c;
  for (int j = 0; j < n - r; ++j) c.push_back({-s[j], j});
  std::sort(c.begin(), c.end());
  std::vector<int32_t> out;
  for (int i = 0; i < k - r; ++i) out.push_back(c[i].second);
  for (int j = n - r; j < n; ++j) out.push_back(j);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

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

TEST(LookM, MergeRulesOnHandMadeExample) {
  // Like Fig. 4: kept tokens 1 and 3; evicted 4 and 5 are closest to 1, evicted 0 and 2 to 3.
  const int d = 3;
  const std::vector<float> k0 = {0.1f, 0.2f, 2.0f,    // 0 → 3
                                 1.0f, 0.0f, 0.0f,    // 1 kept
                                 0.0f, 0.3f, 1.0f,    // 2 → 3
                                 0.0f, 0.0f, 1.0f,    // 3 kept
                                 2.0f, 0.5f, 0.0f,    // 4 → 1
                                 1.0f, -0.4f, 0.3f};  // 5 → 1
  std::vector<float> v0(k0.size());
  for (size_t i = 0; i < v0.size(); ++i) v0[i] = static_cast<float>(i % 7) - 2.5f;
  const std::vector<int> keep = {1, 3};
  auto cosine = [&](int a, int b) {
    double ab = 0, aa = 0, bb = 0;
    for (int t = 0; t < d; ++t) {
      ab += static_cast<double>(k0[a * d + t]) * k0[b * d + t];
      aa += static_cast<double>(k0[a * d + t]) * k0[a * d + t];
      bb += static_cast<double>(k0[b * d + t]) * k0[b * d + t];
    }
    return ab / std::sqrt(aa * bb);
  };
  for (int e : {4, 5}) ASSERT_GT(cosine(e, 1), cosine(e, 3));
  for (int e : {0, 2}) ASSERT_GT(cosine(e, 3), cosine(e, 1));
  const std::map<int, std::vector<int>> sets = {{1, {4, 5}}, {3, {0, 2}}};
  for (MergeKind kind : {MergeKind::Average, MergeKind::Pivotal, MergeKind::Weighted}) {
    std::vector<float> k = k0, v = v0;
    lookm_merge(kind, d, keep, k, v);
    for (const auto& [c, E] : sets) {
      const double Ls = static_cast<double>(E.size());
      for (int t = 0; t < d; ++t)
        for (int which = 0; which < 2; ++which) {
          const std::vector<float>& x = which ? v0 : k0;
          double sum = 0;  // Eq. 10 / 11 / 12, written out
          for (int e : E) {
            if (kind == MergeKind::Average) sum += x[e * d + t];
            if (kind == MergeKind::Pivotal) sum += 0.5 * (x[e * d + t] + x[c * d + t]);
            if (kind == MergeKind::Weighted) sum += cosine(e, c) * x[e * d + t];
          }
          const double want = (x[c * d + t] + sum) / (Ls + 1);
          const float got = (which ? v : k)[c * d + t];
          // One float rounding of a value computed in double: half an ulp of |want| (plus the
          // double rounding, far below that).
          EXPECT_NEAR(got, want, FLT_EPSILON * std::max(std::fabs(want), 1e-30))
              << "merge " << static_cast<int>(kind) << " row " << c << " ch " << t;
        }
    }
    for (int e : {0, 2, 4, 5})  // evicted rows are not touched (they are dropped afterwards)
      for (int t = 0; t < d; ++t) EXPECT_EQ(k[e * d + t], k0[e * d + t]);
  }
  // The three rules give different kept rows here, so the test tells them apart.
  std::vector<float> ka = k0, va = v0, kp = k0, vp = v0, kw = k0, vw = v0;
  lookm_merge(MergeKind::Average, d, keep, ka, va);
  lookm_merge(MergeKind::Pivotal, d, keep, kp, vp);
  lookm_merge(MergeKind::Weighted, d, keep, kw, vw);
  EXPECT_NE(ka[1 * d], kp[1 * d]);
  EXPECT_NE(ka[1 * d], kw[1 * d]);
}

TEST(LookM, TextPriorKeepsAllTextWhenBudgetAllows) {
  // Tokens 0-1 system, 2-16 visual, 17-19 post-vision; visual columns get most attention.
  Prompt P(1, 2, 2, 4, layout(2, 15, 3), 21);
  std::vector<std::vector<double>> lg(P.T, std::vector<double>(P.T, 0.0));
  for (int i = 0; i < P.T; ++i)
    for (int j = 2; j < 17; ++j) lg[i][j] = 3.0 + 0.1 * j;
  P.set_logits(0, 0, lg);
  P.set_logits(0, 1, lg);
  auto text_kept = [&](const KVStore& s) {
    int n = 0;
    for (int32_t p : kept_pos(s, 0, 0)) n += P.kinds[p] != K::Visual;
    return n;
  };
  // alpha1 = 0.1 → M = 2 recent (tokens 18, 19); alpha2 = 0.25 → N = 5 of tokens 0..17.
  const std::map<std::string, std::string> base = {{"alpha1", "0.1"}, {"alpha2", "0.25"}, {"merge", "none"}};
  Prompt A = P;
  auto off = base;
  off["text_prior"] = "off";
  make(lookm_method(), off)->on_prefill(A.contexts(), A.store);
  EXPECT_EQ(A.store.n_rows(0, 0), 7);
  EXPECT_LT(text_kept(A.store), 5) << "without the prior, visual tokens should win";
  Prompt B = P;
  make(lookm_method(), base)->on_prefill(B.contexts(), B.store);
  EXPECT_EQ(B.store.n_rows(0, 0), 7);
  EXPECT_EQ(text_kept(B.store), 5);  // 18, 19 recent; 0, 1, 17 first in N by the prior
  expect_consistent(P.store, B.store, true);
  // text_keep=all keeps every text token beyond a budget that has no room for them:
  // budget 2 rows (token 19 recent + token 0 on top), plus text tokens 1, 17, 18.
  Prompt C = P;
  make(lookm_method(), {{"alpha1", "0.05"}, {"alpha2", "0.05"}, {"merge", "none"}, {"text_keep", "all"}})
      ->on_prefill(C.contexts(), C.store);
  EXPECT_EQ(text_kept(C.store), 5);
  EXPECT_EQ(C.store.n_rows(0, 0), 5);
}

TEST(LookM, PolicyMergesIntoKeptRows) {
  Prompt P(2, 4, 2, 8, layout(3, 30, 7), 31);
  P.random_logits(32, 1.0, 3.0);
  Prompt M = P, N = P;
  make(lookm_method(), {{"merge", "pivotal"}})->on_prefill(M.contexts(), M.store);
  make(lookm_method(), {{"merge", "none"}})->on_prefill(N.contexts(), N.store);
  expect_consistent(P.store, N.store, true);
  expect_consistent(P.store, M.store, false);
  for (int l = 0; l < P.L; ++l)
    for (int h = 0; h < P.Hkv; ++h) {
      // Same kept set; merged values = lookm_merge applied to the original rows of the head.
      ASSERT_EQ(kept_pos(M.store, l, h), kept_pos(N.store, l, h));
      std::vector<float> k, v, km, vm;
      std::vector<int32_t> pos, pm;
      P.store.gather(l, h, k, v, pos);
      M.store.gather(l, h, km, vm, pm);
      const std::vector<float> k_orig = k;
      const std::vector<int> keep(pm.begin(), pm.end());
      lookm_merge(MergeKind::Pivotal, P.D, keep, k, v);
      bool changed = false;
      for (size_t r = 0; r < keep.size(); ++r)
        for (int t = 0; t < P.D; ++t) {
          EXPECT_EQ(km[r * P.D + t], k[keep[r] * P.D + t]);
          EXPECT_EQ(vm[r * P.D + t], v[keep[r] * P.D + t]);
          changed = changed || km[r * P.D + t] != k_orig[keep[r] * P.D + t];
        }
      EXPECT_TRUE(changed) << "evicted rows should have been merged somewhere";
    }
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
  const PrefillContext c = build()->contexts()[0];
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

TEST(Eviction, RejectsAStoreThatIsNotThePrompt) {
  Prompt P(1, 2, 2, 4, layout(2, 6, 2), 91);
  std::vector<PrefillContext> cs = P.contexts();
  cs[0].prompt_len = 9;  // the store holds 10 rows
  EXPECT_THROW(make(h2o_method())->on_prefill(cs, P.store), InputError);
  cs = P.contexts();
  cs[0].probs = nullptr;
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

TEST(LookM, MergedCountsAnnotateKeptRows) {
  Prompt P(2, 4, 2, 8, layout(3, 30, 7), 41);
  P.random_logits(42, 1.0, 3.0);
  for (const char* merge : {"none", "average", "pivotal", "weighted"}) {
    SCOPED_TRACE(merge);
    for (int per_layer = 0; per_layer < 2; ++per_layer) {
      Prompt M = P;
      auto pol = make(lookm_method(), {{"merge", merge}});
      if (per_layer) {
        for (const PrefillContext& c : M.contexts()) pol->on_prefill_layer(c, M.store.layer(c.layer));
      } else {
        pol->on_prefill(M.contexts(), M.store);
      }
      for (int l = 0; l < P.L; ++l)
        for (int h = 0; h < P.Hkv; ++h) {
          int kept = 0, merged = 0;
          for (const KVSegment& s : M.store.layer(l).segments) {
            const HeadRows& r = s.heads[h];
            kept += r.n();
            if (std::string(merge) != "none") {
              EXPECT_EQ(r.merged.size(), static_cast<size_t>(r.n()));
            }
            for (uint16_t m : r.merged) merged += m;
          }
          ASSERT_LT(kept, P.T);
          EXPECT_EQ(merged, std::string(merge) == "none" ? 0 : P.T - kept) << l << " " << h;
        }
    }
  }
  // Counts accumulate onto rows that already absorbed some (e.g. from an earlier merge).
  Prompt A = P;
  for (int l = 0; l < P.L; ++l)
    for (KVSegment& s : A.store.layer(l).segments)
      for (HeadRows& r : s.heads) r.merged.assign(r.n(), 2);
  make(lookm_method(), {{"merge", "average"}})->on_prefill(A.contexts(), A.store);
  for (int h = 0; h < P.Hkv; ++h) {
    int kept = 0, merged = 0;
    for (const KVSegment& s : A.store.layer(0).segments) {
      kept += s.heads[h].n();
      for (uint16_t m : s.heads[h].merged) merged += m;
    }
    EXPECT_EQ(merged, 2 * kept + P.T - kept);
  }
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
