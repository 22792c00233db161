// The prefilled prompts the eviction tests share: per-layer attention set by hand or at random
// over a store that holds the prompt, and the invariants every eviction keeps.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/compress/method.h"
#include "core/compress/policy.h"
#include "tests/held_attention.h"

namespace kvlens::testing {

using K = SegmentKind;

// A prefilled prompt: per-layer probs [H][T][T], scores, queries, and the store holding it.
struct Prompt {
  int L = 1, H = 1, Hkv = 1, D = 4, T = 0;
  std::vector<K> kinds;
  std::vector<int> ids;
  std::vector<std::vector<float>> q, probs, scores;
  mutable std::shared_ptr<kvlens::testing::HeldAttention> held;  // over probs, for contexts()
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
    held = std::make_shared<kvlens::testing::HeldAttention>(probs, H, T);
    std::vector<PrefillContext> cs(L);
    for (int l = 0; l < L; ++l) {
      PrefillContext& c = cs[l];
      c.layer = l, c.n_layers = L, c.n_heads = H, c.n_kv_heads = Hkv, c.head_dim = D;
      c.prompt_len = T, c.attention = held.get();
      c.token_kinds = &kinds, c.token_ids = &ids;
    }
    return cs;
  }
  float prob(int l, int h, int i, int j) const {
    return probs[l][(static_cast<size_t>(h) * T + i) * T + j];
  }
};

inline std::vector<K> layout(int sys, int vis, int post) {
  std::vector<K> k(sys, K::System);
  k.insert(k.end(), vis, K::Visual);
  k.insert(k.end(), post, K::PostVisionText);
  return k;
}

// A policy from its schema with defaults filled in (the registry is not needed).
inline std::unique_ptr<KVPolicy> make(const MethodSpec& m, std::map<std::string, std::string> set = {}) {
  std::map<std::string, std::string> v;
  for (const ParamSpec& p : m.params) v[p.name] = validate_param(m.name, p, p.def);
  for (const auto& kx : set) {
    const std::string& k = kx.first;
    EXPECT_TRUE(v.count(k)) << m.name << " has no " << k;
    v[k] = validate_param(m.name, *std::find_if(m.params.begin(), m.params.end(),
                                                [&](const ParamSpec& p) { return p.name == k; }),
                          kx.second);
  }
  return m.make(Params(m.name, v));
}

inline std::vector<int32_t> kept_pos(const KVStore& s, int l, int h) {
  std::vector<float> k, v;
  std::vector<int32_t> pos;
  s.gather(l, h, k, v, pos);
  return pos;
}

// Invariants after any eviction: rows aligned and ascending, kinds preserved, kept rows exact
// copies (when `exact`), segment bytes = dense bytes (4 B per fp32 value, 2 B per fp16 value) of
// the rows it holds.
inline void expect_consistent(const KVStore& before, const KVStore& after, bool exact) {
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
inline std::vector<double> ref_colsum(const Prompt& P, int l, int kvh, int a) {
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
inline std::vector<int32_t> ref_keep(const std::vector<double>& s, int k, int r) {
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

}  // namespace kvlens::testing
