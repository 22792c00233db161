// A small prefilled prompt for running any compression method end to end without a model:
// L layers of GQA attention (seeded keys, values and queries, causal softmax), a system /
// visual / post-vision text prompt, a few generated tokens fed through the decode hook, and a
// final decode query whose scores go through the method's score transform. Used by the option
// table (tests/app/cli/test_options.cpp) to see what each parameter value changes.
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/kv_store.h"
#include "core/compress/method.h"
#include "core/compress/policy.h"
#include "tests/held_attention.h"

namespace kvlens::testing {

struct Scene {
  int L = 3, H = 4, KH = 2, D = 16;
  int n_sys = 3, n_vis = 48, n_txt = 9;
  int decode = 4;  // generated tokens
  uint32_t seed = 17;
  bool operator==(const Scene& o) const {
    return L == o.L && H == o.H && KH == o.KH && D == o.D && n_sys == o.n_sys && n_vis == o.n_vis &&
           n_txt == o.n_txt && decode == o.decode && seed == o.seed;
  }
};

class Bench {
 public:
  explicit Bench(const Scene& s) : sc(s), T(s.n_sys + s.n_vis + s.n_txt), store(s.L, s.KH, s.D) {
    std::mt19937_64 rng(s.seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (int t = 0; t < T; ++t) {
      kinds.push_back(t < s.n_sys ? SegmentKind::System
                                  : t < s.n_sys + s.n_vis ? SegmentKind::Visual : SegmentKind::PostVisionText);
      ids.push_back(t == 0 ? 1 : 100 + t);
    }
    const int N = T + s.decode;  // every token's K/V, prompt then generated
    k.assign(s.L, std::vector<float>(static_cast<size_t>(N) * s.KH * s.D));
    v = k;
    q.assign(s.L, std::vector<float>(static_cast<size_t>(N + 1) * s.H * s.D));  // + the final query
    for (int l = 0; l < s.L; ++l) {
      for (size_t i = 0; i < k[l].size(); ++i) {  // keys with outlier channels
        const int c = static_cast<int>(i % s.D);
        k[l][i] = g(rng) * (c % 5 == 0 ? 4.0f : 1.0f) + (c % 3 == 0 ? 1.5f : 0.0f);
        v[l][i] = g(rng);
      }
      // Sharper attention in deeper layers, so layers differ in sparsity.
      const float sharp = 0.5f + 1.5f * l;
      for (float& x : q[l]) x = g(rng) * sharp;
    }
    probs.assign(s.L, std::vector<float>(static_cast<size_t>(s.H) * T * T, 0.0f));
    scores.assign(s.L, std::vector<float>(static_cast<size_t>(s.H) * T * T, -INFINITY));
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
    for (int l = 0; l < s.L; ++l)
      for (int h = 0; h < s.H; ++h)
        for (int i = 0; i < T; ++i) {
          const size_t row = (static_cast<size_t>(h) * T + i) * T;
          double mx = -INFINITY, z = 0;
          for (int j = 0; j <= i; ++j) {
            double d = 0;
            for (int c = 0; c < s.D; ++c) d += static_cast<double>(query(l, i, h)[c]) * key(l, j, h / group())[c];
            scores[l][row + j] = static_cast<float>(d * scale);
            mx = std::max(mx, d * scale);
          }
          for (int j = 0; j <= i; ++j) z += std::exp(scores[l][row + j] - mx);
          for (int j = 0; j <= i; ++j) probs[l][row + j] = static_cast<float>(std::exp(scores[l][row + j] - mx) / z);
        }
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; ++t) pos[t] = t;
    for (int l = 0; l < s.L; ++l) store.append(l, k[l].data(), v[l].data(), pos.data(), kinds.data(), T);
  }

  int group() const { return sc.H / sc.KH; }
  // Token t's key / value (t < T: prompt, t ≥ T: generated) and query (t = T + decode: the
  // final query whose scores go through the score transform).
  const float* key(int l, int t, int kh) const { return &k[l][(static_cast<size_t>(t) * sc.KH + kh) * sc.D]; }
  const float* val(int l, int t, int kh) const { return &v[l][(static_cast<size_t>(t) * sc.KH + kh) * sc.D]; }
  const float* query(int l, int t, int h) const { return &q[l][(static_cast<size_t>(t) * sc.H + h) * sc.D]; }
  double prob(int l, int h, int i, int j) const { return probs[l][(static_cast<size_t>(h) * T + i) * T + j]; }

  std::vector<PrefillContext> contexts() const {
    held = std::make_shared<kvlens::testing::HeldAttention>(probs, sc.H, T);
    std::vector<PrefillContext> cs(sc.L);
    for (int l = 0; l < sc.L; ++l) {
      PrefillContext& c = cs[l];
      c.layer = l, c.n_layers = sc.L, c.n_heads = sc.H, c.n_kv_heads = sc.KH, c.head_dim = sc.D;
      c.prompt_len = T, c.attention = held.get();
      c.token_kinds = &kinds, c.token_ids = &ids;
    }
    return cs;
  }

  Scene sc;
  int T;
  std::vector<SegmentKind> kinds;
  std::vector<int> ids;
  std::vector<std::vector<float>> k, v, q, probs, scores;  // per layer
  mutable std::shared_ptr<kvlens::testing::HeldAttention> held;  // over probs, for contexts()
  KVStore store;                                           // the prompt, as prefill leaves it
};

// What running a method on a bench leaves behind.
struct Outcome {
  KVStore prefill;  // right after on_prefill
  KVStore final;    // after the generated tokens and their decode hooks
  // The final query's pre-softmax scores over the final store's keys, per (layer, query head)
  // [l·H + h]: before (raw) and after (scores) the score transforms; kinds of those keys.
  std::vector<std::vector<float>> raw, scores;
  std::vector<std::vector<SegmentKind>> kinds;
};

// Runs the methods in order as one composition (each prefill hook, then per decode step and
// layer each decode hook, then each score transform), as `stack` composes its two methods.
inline Outcome run_methods(const Bench& b, const std::vector<std::string>& specs) {
  std::vector<std::unique_ptr<KVPolicy>> ps;
  for (const std::string& s : specs) ps.push_back(make_policy(s));
  const Scene& s = b.sc;
  Outcome o;
  KVStore st = b.store;
  // Dense rows as a decode stores them: exact (fp32, the bench's store) unless a method asks
  // for other (the last one that asks wins, as in a stack).
  RowStorage rows = RowStorage::Fp32;
  for (auto& p : ps) rows = decode_row_storage(p.get(), rows);
  st.set_row_storage(rows);
  const std::vector<PrefillContext> cs = b.contexts();
  for (auto& p : ps) p->on_prefill(cs, st);
  o.prefill = st;
  for (int step = 0; step < s.decode; ++step) {
    int32_t pos = b.T + step;
    const SegmentKind gen = SegmentKind::Generated;
    for (int l = 0; l < s.L; ++l) {
      st.append(l, b.key(l, pos, 0), b.val(l, pos, 0), &pos, &gen, 1);
      DecodeContext d;
      d.layer = l, d.step = step, d.position = pos, d.n_heads = s.H, d.n_kv_heads = s.KH, d.head_dim = s.D;
      d.q = b.query(l, pos, 0);
      for (auto& p : ps) p->on_decode_step(d, st.layer(l));
    }
  }
  o.final = st;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
  for (int l = 0; l < s.L; ++l)
    for (int h = 0; h < s.H; ++h) {
      std::vector<float> kk, vv;
      std::vector<int32_t> pos;
      std::vector<SegmentKind> kd;
      st.gather(l, h / b.group(), kk, vv, pos, &kd);
      const int n = static_cast<int>(pos.size());
      const float* qf = b.query(l, b.T + s.decode, h);
      std::vector<float> sc(n);
      for (int j = 0; j < n; ++j) {
        double d = 0;
        for (int c = 0; c < s.D; ++c) d += static_cast<double>(qf[c]) * kk[static_cast<size_t>(j) * s.D + c];
        sc[j] = static_cast<float>(d * scale);
      }
      o.raw.push_back(sc);
      for (auto& p : ps)
        if (p->has_score_transform()) p->transform_scores(l, h, sc.data(), kd.data(), n);
      o.scores.push_back(sc);
      o.kinds.push_back(kd);
    }
  return o;
}

// Whether two stores hold the same segments, rows, annotations and bytes.
inline bool same_store(const KVStore& a, const KVStore& b) {
  if (a.n_layers() != b.n_layers()) return false;
  for (int l = 0; l < a.n_layers(); ++l) {
    const auto& x = a.layer(l).segments;
    const auto& y = b.layer(l).segments;
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i].kind != y[i].kind || x[i].storage != y[i].storage || x[i].heads.size() != y[i].heads.size())
        return false;
      const KVBytes& p = x[i].bytes;
      const KVBytes& r = y[i].bytes;
      if (p.codes != r.codes || p.scales != r.scales || p.zeros != r.zeros || p.indices != r.indices || p.meta != r.meta)
        return false;
      for (size_t h = 0; h < x[i].heads.size(); ++h) {
        const HeadRows& u = x[i].heads[h];
        const HeadRows& w = y[i].heads[h];
        if (u.k != w.k || u.v != w.v || u.pos != w.pos || u.bits != w.bits || u.merged != w.merged) return false;
      }
    }
  }
  return true;
}

inline bool same_outcome(const Outcome& a, const Outcome& b) {
  return same_store(a.prefill, b.prefill) && same_store(a.final, b.final) && a.scores == b.scores;
}

// One row of a store as a test reads it.
struct RowView {
  int32_t pos;
  SegmentKind kind;
  std::string storage;
  int bits;  // the row's annotation, or 0 when the segment has none
  int merged;
  const float* k;
  const float* v;
  int segment;  // index of its segment in the layer
};

inline std::vector<RowView> rows_of(const KVStore& s, int l, int kh) {
  std::vector<RowView> out;
  const auto& segs = s.layer(l).segments;
  for (size_t i = 0; i < segs.size(); ++i) {
    const HeadRows& r = segs[i].heads.at(kh);
    for (int j = 0; j < r.n(); ++j)
      out.push_back({r.pos[j], segs[i].kind, segs[i].storage,
                     static_cast<size_t>(j) < r.bits.size() ? r.bits[j] : 0,
                     static_cast<size_t>(j) < r.merged.size() ? r.merged[j] : 0,
                     r.k.data() + static_cast<size_t>(j) * s.head_dim(),
                     r.v.data() + static_cast<size_t>(j) * s.head_dim(), static_cast<int>(i)});
  }
  return out;
}

inline std::vector<int32_t> positions(const KVStore& s, int l, int kh) {
  std::vector<int32_t> p;
  for (const RowView& r : rows_of(s, l, kh)) p.push_back(r.pos);
  return p;
}

// Number of distinct values, counting values closer than `tol` as one.
inline int levels(std::vector<double> x, double tol = 0.0) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  int n = 1;
  for (size_t i = 1; i < x.size(); ++i) n += x[i] - x[i - 1] > tol;
  return n;
}

}  // namespace kvlens::testing
