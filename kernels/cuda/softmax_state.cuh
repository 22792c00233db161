// The online softmax, written once for every attention kernel (prefill, vision and decode): a
// query row's running state — maximum m, sum d and unnormalized outputs o — moved to a new
// maximum by rescale, joined with another state by merge, grown by one key by add. Each kernel
// passes the exponential it pays for (__expf, expf, or exp2 with log2 e folded into its scores);
// multi-way merges of many states (a block's groups, a head's splits) weigh each state by
// exp(m − softmax_shift(M)).
#pragma once
#include <cmath>

namespace kvlens::cuda {

// The shift of a merge's exponentials: the joint maximum M, or 0 when every state joined is
// empty (m = −∞), so that exp(m − shift) weighs an empty state 0 without a branch or a NaN.
__device__ __forceinline__ float softmax_shift(float M) { return M == -INFINITY ? 0.0f : M; }

template <int N>
struct SoftmaxState {
  float m = -INFINITY, d = 0.0f;
  float o[N] = {};

  // Moves the state to a new running maximum mx, given alpha = exp(m − mx): d and o (and a
  // caller's own accumulators acc[N] and psum, when given) are scaled by alpha.
  __device__ __forceinline__ void rescale(float mx, float alpha, float* acc = nullptr, float* psum = nullptr) {
    d *= alpha;
    if (psum) *psum *= alpha;
#pragma unroll
    for (int c = 0; c < N; ++c) {
      o[c] *= alpha;
      if (acc) acc[c] *= alpha;
    }
    m = mx;
  }

  // Joins the state (m2, d2, o2): M = max(m, m2), each side weighted by exp(its m − M).
  template <class Exp>
  __device__ __forceinline__ void merge(float m2, float d2, const float (&o2)[N], Exp exp) {
    const float M = fmaxf(m, m2), shift = softmax_shift(M);
    const float a = exp(m - shift), b = exp(m2 - shift);
    d = d * a + d2 * b;
#pragma unroll
    for (int c = 0; c < N; ++c) o[c] = o[c] * a + o2[c] * b;
    m = M;
  }

  // Adds one key of score s whose value channel c is v(c): the state moves to max(m, s), the key
  // weighs exp(s − max).
  template <class Exp, class V>
  __device__ __forceinline__ void add(float s, V v, Exp exp) {
    const float mn = fmaxf(m, s);
    const float alpha = exp(m - mn), p = exp(s - mn);
    d = d * alpha + p;
#pragma unroll
    for (int c = 0; c < N; ++c) o[c] = o[c] * alpha + p * v(c);
    m = mn;
  }
};

}  // namespace kvlens::cuda
