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
inline void attention_refs(const std::vector<float>& qkv, const AttnLayout& l, Dt in, std::vector<float>& ref,
                           std::vector<float>& naive) {
  const int T = l.T, NH = l.n_heads, D = l.head_dim, G = NH / l.n_kv_heads;
  ref.assign(static_cast<size_t>(T) * NH * D, 0.0f);
  naive = ref;
  auto Q = [&](int i, int h, int c) { return qkv[i * l.row_stride + l.q_col + h * D + c]; };
  auto K = [&](int j, int h, int c) { return qkv[j * l.row_stride + l.k_col + (h / G) * D + c]; };
  auto V = [&](int j, int h, int c) { return qkv[j * l.row_stride + l.v_col + (h / G) * D + c]; };
  for (int h = 0; h < NH; ++h)
    for (int i = 0; i < T; ++i) {
      const int n = l.causal ? i + 1 : T;
      std::vector<double> s(n);
      std::vector<float> sn(n);
      double mx = -INFINITY;
      float mxn = -INFINITY;
      for (int j = 0; j < n; ++j) {
        double d = 0;
        float dn = 0;
        for (int c = 0; c < D; ++c) {
          d += static_cast<double>(Q(i, h, c)) * K(j, h, c);
          dn += round_to(in, Q(i, h, c)) * round_to(in, K(j, h, c));
        }
        s[j] = d * l.scale;
        sn[j] = dn * l.scale;
        mx = std::max(mx, s[j]);
        mxn = std::max(mxn, sn[j]);
      }
      double z = 0;
      float zn = 0;
      for (int j = 0; j < n; ++j) {
        z += (s[j] = std::exp(s[j] - mx));
        zn += (sn[j] = std::exp(sn[j] - mxn));
      }
      for (int c = 0; c < D; ++c) {
        double o = 0;
        float on = 0;
        for (int j = 0; j < n; ++j) {
          o += s[j] / z * V(j, h, c);
          on += round_to(in, sn[j]) * round_to(in, V(j, h, c));
        }
        ref[(static_cast<size_t>(i) * NH + h) * D + c] = static_cast<float>(o);
        naive[(static_cast<size_t>(i) * NH + h) * D + c] = on / zn;
      }
    }
}

// Error allowed against fp64: twice the naive implementation's worst error, plus the rounding
// of the output to odt.
inline std::vector<double> attention_bound(const std::vector<float>& ref, const std::vector<float>& naive, Dt odt) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::abs(double(naive[i]) - ref[i]));
  std::vector<double> bound(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) bound[i] = 2 * worst + unit(odt) * std::abs(ref[i]) + tiny(odt) + 1e-7;
  return bound;
}

}  // namespace kvlens::testing
