// Prefill attention references for the op and kernel tests: fp64 attention, and a naive
// implementation at a given precision whose error against fp64 sets the tests' bound.
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/backend.h"
#include "tests/op_harness.h"

namespace kvlens::testing {

// fp64 attention, and a naive implementation at a given precision: inputs rounded to `in`,
// dot products, softmax and output accumulated in fp32 in order, probabilities rounded to `in`.
// err32, when given: a bound on the error of any fp32 implementation (any order of sums, an
// online softmax) of each output. A score is within dot_rel(D) of scale·Σ|q·k| of the exact one
// plus its own rounding; an unnormalized weight then within E = twice the row's largest score
// error, the subtraction's and exp's rounding; the output, Σ P_j·|v_j| times twice (E + the
// sums' 2·γ_n + 2u) — rescaling steps and second-order terms inside the factor of two.
// score_mag, when given: scale·Σ|q·k| of each score, [n_heads][T][T] (0 where masked).
inline void attention_refs(const std::vector<float>& qkv, const AttnLayout& l, Dt in, std::vector<float>& ref,
                           std::vector<float>& naive, std::vector<double>* err32 = nullptr,
                           std::vector<double>* score_mag = nullptr) {
  const int T = l.T, NH = l.n_heads, D = l.head_dim, G = NH / l.n_kv_heads;
  const double u = std::ldexp(1.0, -24);
  ref.assign(static_cast<size_t>(T) * NH * D, 0.0f);
  naive = ref;
  if (err32) err32->assign(ref.size(), 0.0);
  if (score_mag) score_mag->assign(static_cast<size_t>(NH) * T * T, 0.0);
  auto Q = [&](int i, int h, int c) { return qkv[i * l.row_stride + l.q_col + h * D + c]; };
  auto K = [&](int j, int h, int c) { return qkv[j * l.row_stride + l.k_col + (h / G) * D + c]; };
  auto V = [&](int j, int h, int c) { return qkv[j * l.row_stride + l.v_col + (h / G) * D + c]; };
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < T; ++i) {
      const int n = l.causal ? i + 1 : T;
      std::vector<double> s(n);
      std::vector<float> sn(n);
      double mx = -INFINITY, ds = 0;
      float mxn = -INFINITY;
      for (int j = 0; j < n; ++j) {
        double d = 0, mag = 0;
        float dn = 0;
        for (int c = 0; c < D; ++c) {
          d += static_cast<double>(Q(i, h, c)) * K(j, h, c);
          mag += std::abs(static_cast<double>(Q(i, h, c)) * K(j, h, c));
          dn += round_to(in, Q(i, h, c)) * round_to(in, K(j, h, c));
        }
        s[j] = d * l.scale;
        sn[j] = dn * l.scale;
        ds = std::max(ds, dot_rel(D) * mag * l.scale + u * std::abs(s[j]));
        if (score_mag) (*score_mag)[(static_cast<size_t>(h) * T + i) * T + j] = mag * l.scale;
        mx = std::max(mx, s[j]);
        mxn = std::max(mxn, sn[j]);
      }
      double E = 2 * ds + 2 * u;
      for (int j = 0; j < n; ++j) E = std::max(E, 2 * ds + u * std::abs(s[j] - mx) + 2 * u);
      const double gamma = n * u / (1.0 - n * u);
      double z = 0;
      float zn = 0;
      for (int j = 0; j < n; ++j) {
        z += (s[j] = std::exp(s[j] - mx));
        zn += (sn[j] = std::exp(sn[j] - mxn));
      }
      for (int c = 0; c < D; ++c) {
        double o = 0, mag = 0;
        float on = 0;
        for (int j = 0; j < n; ++j) {
          o += s[j] / z * V(j, h, c);
          mag += s[j] / z * std::abs(V(j, h, c));
          on += round_to(in, sn[j]) * round_to(in, V(j, h, c));
        }
        if (err32) (*err32)[(static_cast<size_t>(i) * NH + h) * D + c] = 2 * mag * (E + 2 * gamma + 2 * u);
        ref[(static_cast<size_t>(i) * NH + h) * D + c] = static_cast<float>(o);
        naive[(static_cast<size_t>(i) * NH + h) * D + c] = on / zn;
      }
    }
}

// Error allowed against fp64: twice the naive implementation's worst error (at least an fp32
// implementation's own bound, err32, where given: the naive one's worst error is a sample that
// another order of sums can pass), plus the rounding of the output to odt.
inline std::vector<double> attention_bound(const std::vector<float>& ref, const std::vector<float>& naive, Dt odt,
                                           const std::vector<double>* err32 = nullptr) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::abs(double(naive[i]) - ref[i]));
  std::vector<double> bound(ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    bound[i] = std::max(2 * worst, err32 ? (*err32)[i] : 0.0) + unit(odt) * std::abs(ref[i]) + tiny(odt) + 1e-7;
  return bound;
}

}  // namespace kvlens::testing
