// The decode-ops tests' case (heads, head size, the prompt's segments), its projections and the
// fp64 attention every backend's decode attention is compared with, with its derived bound.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/compress/policy.h"
#include "core/compress/quantize.h"
#include "core/kv_store.h"
#include "tests/op_harness.h"

namespace kvlens::testing {

struct DecodeCase {
  int NH = 8, NKV = 2, D = 128;
  int n_sys = 5, n_vis = 150, n_post = 48;
  std::string method;  // empty = full cache
  int steps = 5;
  bool capture = false;
  int reserve = 2;  // decode rows reserved up front (fewer than steps: the tail must grow)
  bool packed = false;  // every quantized segment must be held packed on the device
};

inline AttnLayout layout_of(const DecodeCase& c, int T) {
  AttnLayout l;
  l.T = T;
  l.n_heads = c.NH;
  l.n_kv_heads = c.NKV;
  l.head_dim = c.D;
  l.row_stride = static_cast<int64_t>(c.NH + 2 * c.NKV) * c.D;
  l.q_col = 0;
  l.k_col = static_cast<int64_t>(c.NH) * c.D;
  l.v_col = static_cast<int64_t>(c.NH + c.NKV) * c.D;
  l.causal = true;
  l.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  return l;
}

// Random projections; K and V columns rounded to fp16 so both caches hold the same rows. Keys
// get a per-channel offset, as real keys have (outlier channels), so ranges differ by channel.
inline std::vector<float> projections(const DecodeCase& c, const AttnLayout& l, int T) {
  std::vector<float> x = randn(static_cast<size_t>(T) * l.row_stride);
  std::vector<float> off = randn(static_cast<size_t>(c.D), 2.0f);
  for (int t = 0; t < T; ++t)
    for (int64_t i = l.k_col; i < l.row_stride; ++i) {
      float& v = x[t * l.row_stride + i];
      if (i < l.v_col) v += off[(i - l.k_col) % c.D];
      v = quant::round_half(v);
    }
  return x;
}

// fp64 attention of one query over a head's rows as the host store holds them (after a
// transform of the scores when the policy has one), with the scale of the scores it saw.
inline void reference(const KVStore& st, const std::vector<float>& q, const DecodeCase& c, const AttnLayout& l,
                      const KVPolicy* policy, std::vector<float>& out, std::vector<double>& out_bound,
                      std::vector<std::vector<float>>& ref_scores) {
  const int G = c.NH / c.NKV;
  out.assign(static_cast<size_t>(c.NH) * c.D, 0.0f);
  out_bound.assign(out.size(), 0.0);
  ref_scores.assign(c.NH, {});
  for (int hd = 0; hd < c.NH; ++hd) {
    std::vector<float> K, V;
    std::vector<int32_t> P;
    std::vector<SegmentKind> kinds;
    st.gather(0, hd / G, K, V, P, &kinds);
    const int n = static_cast<int>(P.size());
    std::vector<double> s(n);
    double smag = 0, vmag = 0;
    for (int j = 0; j < n; ++j) {
      double d = 0, m = 0;
      for (int e = 0; e < c.D; ++e) {
        d += static_cast<double>(q[hd * c.D + e]) * K[static_cast<size_t>(j) * c.D + e];
        m += std::abs(static_cast<double>(q[hd * c.D + e]) * K[static_cast<size_t>(j) * c.D + e]);
      }
      s[j] = d * l.scale;
      smag = std::max(smag, m * l.scale);
      for (int e = 0; e < c.D; ++e) vmag = std::max(vmag, std::abs(double(V[static_cast<size_t>(j) * c.D + e])));
    }
    // Score error of fp32 dot products on either side (post-scaling regroups the sum: ×4).
    double amp = 1.0;
    std::vector<float> sf(s.begin(), s.end());
    const ScoreTransform tr = policy ? policy->score_transform() : ScoreTransform{};
    if (tr.any()) {
      const float t1 = tr.tau1, t2 = tr.tau2;
      if (tr.kind == ScoreTransform::Kind::Calibrate) {
        double lo = INFINITY, hi = -INFINITY;
        for (int j = 0; j < n; ++j)
          if (kinds[j] == SegmentKind::Visual) lo = std::min(lo, s[j]), hi = std::max(hi, s[j]);
        if (hi > lo) {
          const double t = (hi - lo + t1 - t2) / (hi - lo);
          amp = 2 + 2 * std::abs(t) + 2 * std::abs(t2 - t1) / (hi - lo);
        }
      }
      tr.apply(0, hd, sf.data(), kinds.data(), n);
      for (int j = 0; j < n; ++j) s[j] = sf[j];
    }
    ref_scores[hd] = sf;
    const double ds = amp * 4 * dot_rel(c.D) * smag;  // score error bound
    double mx = -INFINITY;
    for (double x : s) mx = std::max(mx, x);
    double z = 0;
    for (double& x : s) z += (x = std::exp(x - mx));
    for (int e = 0; e < c.D; ++e) {
      double o = 0;
      for (int j = 0; j < n; ++j) o += s[j] / z * V[static_cast<size_t>(j) * c.D + e];
      out[static_cast<size_t>(hd) * c.D + e] = static_cast<float>(o);
      // exp turns a score error ds into a relative weight error ≈ 2·ds; then the weighted sum.
      out_bound[static_cast<size_t>(hd) * c.D + e] = (2.5 * ds + 2 * dot_rel(n)) * vmag + 4 * unit(Dt::F32) * vmag;
    }
  }
}

// T prompt rows of kind System at positions 0 … T − 1, from c's random projections, appended to
// layer 0 of kv on `be`.
inline void append_prompt(Backend& be, SeqKV& kv, const DecodeCase& c, int T) {
  const AttnLayout lp = layout_of(c, T);
  std::vector<int32_t> pos(T);
  std::vector<SegmentKind> kinds(T, SegmentKind::System);
  for (int t = 0; t < T; ++t) pos[t] = t;
  Buffer X = make(be, "qkv", {T, lp.row_stride}, Dt::F32, projections(c, lp, T));
  Buffer P = make_ids(be, "pos", pos);
  be.kv_append(kv, 0, X, lp, P, pos.data(), kinds.data(), T);
}

}  // namespace kvlens::testing
