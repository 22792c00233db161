// LOOK-M against direct computations: the merge rules (Eq. 9-12), the text prior (Eq. 5, 8),
// merge counts, and the authors' code paths the `official` preset follows (similarity filter,
// average-merge source rows, sink tokens).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <map>
#include <set>

#include "core/errors.h"
#include "core/compress/method.h"
#include "core/compress/evict_methods.h"
#include "core/compress/select.h"
#include "tests/evict_fixture.h"

using namespace kvlens;
using namespace kvlens::testing;

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
            if (kind == MergeKind::Pivotal) sum += 0.5 * (double(x[e * d + t]) + x[c * d + t]);
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


TEST(LookM, AboveMeanFilterAveragesOverHeadsAtTheSameEvictedIndex) {
  // Two heads, three evicted rows each: index means 0.85, 0.45, 0.55; overall mean 0.6167.
  const std::vector<std::vector<double>> s = {{0.9, 0.5, 0.2}, {0.8, 0.4, 0.9}};
  EXPECT_EQ(lookm_above_mean(s), (std::vector<char>{1, 0, 0}));
  // A head with fewer evicted rows: index 1 is averaged over the heads that have it (0.7 ≥ 0.5).
  EXPECT_EQ(lookm_above_mean({{0.1, 0.7}, {0.7}}), (std::vector<char>{0, 1}));
  EXPECT_EQ(lookm_above_mean({{0.3, 0.3}}), (std::vector<char>{1, 1}));  // ties pass (≥)
}

namespace {

// The authors' merge written out for one layer from the kept sets: Eq. 9 assignments (first
// best kept row), the similarity filter over heads, the average path's prefix source rows, and
// the scatter mean including the kept row. Returns the merged rows of every head and, per head,
// how many rows each kept row absorbed.
struct Merged {
  std::vector<std::vector<double>> k, v;
  std::vector<std::map<int, int>> count;
};
Merged code_merge(const Prompt& P, int l, const std::vector<std::vector<int>>& keep, const std::string& kind,
                  bool filter, bool prefix) {
  const int D = P.D;
  Merged out;
  std::vector<std::vector<int>> ev(P.Hkv), best(P.Hkv);
  std::vector<std::vector<double>> sim(P.Hkv);
  std::vector<std::vector<float>> K(P.Hkv), V(P.Hkv);
  for (int h = 0; h < P.Hkv; ++h) {
    std::vector<int32_t> pos;
    P.store.gather(l, h, K[h], V[h], pos);
    auto cosine = [&](int a, int b) {
      double ab = 0, aa = 0, bb = 0;
      for (int t = 0; t < D; ++t)
        ab += double(K[h][a * D + t]) * K[h][b * D + t], aa += double(K[h][a * D + t]) * K[h][a * D + t],
            bb += double(K[h][b * D + t]) * K[h][b * D + t];
      return ab / std::sqrt(aa * bb);
    };
    const std::set<int> kept(keep[h].begin(), keep[h].end());
    for (int e = 0; e < P.T; ++e) {
      if (kept.count(e)) continue;
      int b = keep[h][0];
      for (int c : keep[h])
        if (cosine(e, c) > cosine(e, b)) b = c;
      ev[h].push_back(e), best[h].push_back(b), sim[h].push_back(cosine(e, b));
    }
  }
  std::vector<char> pass(ev[0].size(), 1);
  if (filter) {
    double all = 0;
    int n = 0;
    for (int h = 0; h < P.Hkv; ++h)
      for (double x : sim[h]) all += x, ++n;
    for (size_t j = 0; j < pass.size(); ++j) {
      double m = 0;
      for (int h = 0; h < P.Hkv; ++h) m += sim[h][j] / P.Hkv;
      pass[j] = m >= all / n;
    }
  }
  out.k.resize(P.Hkv), out.v.resize(P.Hkv), out.count.resize(P.Hkv);
  for (int h = 0; h < P.Hkv; ++h) {
    std::map<int, std::vector<std::pair<int, double>>> into;  // kept row → (source row, weight)
    int f = 0;
    for (size_t j = 0; j < ev[h].size(); ++j) {
      if (!pass[j]) continue;
      const int src = prefix && kind == "average" ? ev[h][f] : ev[h][j];
      into[best[h][j]].push_back({src, sim[h][j]});
      ++f;
    }
    out.k[h].assign(K[h].begin(), K[h].end()), out.v[h].assign(V[h].begin(), V[h].end());
    for (const auto& [c, src] : into) {
      out.count[h][c] = static_cast<int>(src.size());
      for (int t = 0; t < D; ++t)
        for (int which = 0; which < 2; ++which) {
          const std::vector<float>& X = which ? V[h] : K[h];
          double sum = X[c * D + t];
          for (const auto& [e, w] : src) {
            if (kind == "average") sum += X[e * D + t];
            if (kind == "pivotal") sum += 0.5 * (double(X[e * D + t]) + X[c * D + t]);
            if (kind == "weighted") sum += w * X[e * D + t];
          }
          (which ? out.v : out.k)[h][c * D + t] = sum / (src.size() + 1);
        }
    }
  }
  return out;
}

}  // namespace

TEST(LookM, OfficialPresetFollowsTheAuthorsMergeCode) {
  Prompt P(1, 4, 2, 8, layout(3, 40, 5), 61);
  P.random_logits(62, 1.0, 3.0);
  // The kept sets do not depend on the merge; take them from a run without merging.
  Prompt N = P;
  make(lookm_method(), {{"merge", "none"}, {"text_keep", "all"}})->on_prefill(N.contexts(), N.store);
  std::vector<std::vector<int>> keep(P.Hkv);
  for (int h = 0; h < P.Hkv; ++h) {
    const std::vector<int32_t> pos = kept_pos(N.store, 0, h);
    keep[h].assign(pos.begin(), pos.end());
  }
  int filtered_differs = 0, prefix_differs = 0;
  for (const std::string kind : {"average", "weighted", "pivotal"}) {
    for (const std::string& spec : {std::string("preset=official"), std::string("merge_filter=above_mean"),
                                    std::string("merge_filter=all,text_keep=all")}) {
      SCOPED_TRACE(kind + " " + spec);
      std::map<std::string, std::string> set = {{"merge", kind}};
      for (const std::string& kv : {spec.substr(0, spec.find(',')), spec.find(',') == std::string::npos ? "" : spec.substr(spec.find(',') + 1)})
        if (!kv.empty()) set[kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
      if (set.count("preset")) set = {{"merge", kind}, {"text_keep", "all"}, {"merge_filter", "code"}, {"average_source", "prefix"}};
      const bool filter = set["merge_filter"] == "above_mean" || (set["merge_filter"] == "code" && kind != "pivotal");
      const bool prefix = set.count("average_source") && set["average_source"] == "prefix";
      Prompt M = P;
      make(lookm_method(), set)->on_prefill(M.contexts(), M.store);
      const Merged want = code_merge(P, 0, keep, kind, filter, prefix);
      const Merged plain = code_merge(P, 0, keep, kind, false, false);
      for (int h = 0; h < P.Hkv; ++h) {
        std::vector<float> k, v;
        std::vector<int32_t> pos;
        M.store.gather(0, h, k, v, pos);
        ASSERT_EQ(std::vector<int>(pos.begin(), pos.end()), keep[h]);
        int row = 0;
        for (const KVSegment& s : M.store.layer(0).segments)
          for (int i = 0; i < s.heads[h].n(); ++i, ++row) {
            const int c = keep[h][row];
            const auto it = want.count[h].find(c);
            EXPECT_EQ(s.heads[h].merged.at(i), it == want.count[h].end() ? 0 : it->second) << "row " << c;
            for (int t = 0; t < P.D; ++t) {
              const double wk = want.k[h][c * P.D + t], wv = want.v[h][c * P.D + t];
              EXPECT_NEAR(k[row * P.D + t], wk, 2 * FLT_EPSILON * std::max(std::fabs(wk), 1e-6)) << "row " << c;
              EXPECT_NEAR(v[row * P.D + t], wv, 2 * FLT_EPSILON * std::max(std::fabs(wv), 1e-6)) << "row " << c;
              if (filter && std::fabs(want.k[h][c * P.D + t] - plain.k[h][c * P.D + t]) > 1e-4) ++filtered_differs;
            }
          }
        if (prefix) {
          const Merged assigned = code_merge(P, 0, keep, kind, filter, false);
          for (size_t x = 0; x < want.k[h].size(); ++x) prefix_differs += std::fabs(want.k[h][x] - assigned.k[h][x]) > 1e-4;
        }
      }
    }
  }
  EXPECT_GT(filtered_differs, 0) << "the filter should drop some evicted rows here";
  EXPECT_GT(prefix_differs, 0) << "prefix sources should differ from the assigned rows here";
}

TEST(LookM, SinksKeepTheFirstTokens) {
  // Visual columns draw the attention; without the prior the first (system) tokens compete on
  // A_s alone, unless they are sinks (score +inf inside N, as the authors' no-prior code forces
  // 4 of them).
  Prompt P(1, 2, 2, 4, layout(4, 20, 2), 71);
  std::vector<std::vector<double>> lg(P.T, std::vector<double>(P.T, 0.0));
  for (int i = 0; i < P.T; ++i)
    for (int j = 4; j < 24; ++j) lg[i][j] = 4.0;
  P.set_logits(0, 0, lg);
  P.set_logits(0, 1, lg);
  int first_without = 0;
  for (const int sinks : {0, 4}) {
    Prompt M = P;
    make(lookm_method(), {{"text_prior", "off"}, {"merge", "none"}, {"alpha1", "0.1"}, {"alpha2", "0.3"},
                          {"sinks", std::to_string(sinks)}})
        ->on_prefill(M.contexts(), M.store);
    for (int h = 0; h < P.Hkv; ++h) {
      std::vector<double> s = ref_colsum(P, 0, h, 0);
      for (int j = 0; j < sinks; ++j) s[j] = INFINITY;
      const std::vector<int32_t> pos = kept_pos(M.store, 0, h);
      EXPECT_EQ(pos, ref_keep(s, 2 + 7, 2));  // M = floor(2.6) = 2, N = floor(7.8) = 7
      const int first = static_cast<int>(std::count_if(pos.begin(), pos.end(), [](int32_t p) { return p < 4; }));
      if (sinks) {
        EXPECT_EQ(first, 4) << "head " << h;
      } else {
        first_without += first;
      }
    }
  }
  EXPECT_LT(first_without, 2 * 4) << "without sinks some first tokens should be evicted here";
}
