// Recorded decode queries' attention reduced to one span of key positions (Backend::
// recorded_span_attention; host reference: recorded_attention's transform and softmax, then
// span_attention_sums). One block per (query, query head): the row maximum (and with
// calibration the visual rows' range, then the calibrated maximum), the softmax's sum in double,
// and each row's probability added at its span index.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kThreads = 256;

template <typename T, typename Op>
__device__ T block_reduce(T v, T* red, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
  for (int w = 1; w < kThreads / 32; ++w) r = op(r, red[w]);
  __syncthreads();
  return r;
}

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Min {
  __device__ float operator()(float a, float b) const { return fminf(a, b); }
};
struct Sum {
  __device__ double operator()(double a, double b) const { return a + b; }
};

// calibquant::calibrate_visual's g(x) for one row (code bit 0: a visual row) once the visual
// rows' range [gamma, delta] is known (gamma > delta: no visual row, nothing changes).
__device__ __forceinline__ float transformed(float x, int code, bool cal, float gamma, float delta, float tau1,
                                             float tau2) {
  if (!cal || !(code & 1) || !isfinite(x) || !(gamma <= delta)) return x;
  if (!(delta > gamma)) return gamma - tau1;
  return (delta - gamma + tau1 - tau2) / (delta - gamma) * (x - gamma) + gamma - tau1;
}

__global__ void __launch_bounds__(kThreads)
    span_softmax_sums_kernel(const float* __restrict__ scores, int64_t stride, const int32_t* __restrict__ codes,
                             const int32_t* __restrict__ segs, const int32_t* __restrict__ seen, int n_heads, int G,
                             bool cal, float tau1, float tau2, int n_span, float* __restrict__ out) {
  __shared__ float redf[kThreads / 32];
  __shared__ double redd[kThreads / 32];
  const int h = blockIdx.x, i = blockIdx.y, kv = h / G;
  const float* s = scores + (static_cast<int64_t>(i) * n_heads + h) * stride;
  const int32_t* c = codes + static_cast<int64_t>(kv) * stride;
  const int rows = segs[kv] + seen[i];
  float gamma = INFINITY, delta = -INFINITY;
  if (cal) {
    for (int j = threadIdx.x; j < rows; j += kThreads)
      if ((c[j] & 1) && isfinite(s[j])) {
        gamma = fminf(gamma, s[j]);
        delta = fmaxf(delta, s[j]);
      }
    gamma = block_reduce(gamma, redf, Min{});
    delta = block_reduce(delta, redf, Max{});
  }
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < rows; j += kThreads)
    mx = fmaxf(mx, transformed(s[j], c[j], cal, gamma, delta, tau1, tau2));
  mx = block_reduce(mx, redf, Max{});
  double sum = 0.0;
  for (int j = threadIdx.x; j < rows; j += kThreads)
    sum += static_cast<double>(expf(transformed(s[j], c[j], cal, gamma, delta, tau1, tau2) - mx));
  sum = block_reduce(sum, redd, Sum{});
  float* o = out + (static_cast<int64_t>(i) * n_heads + h) * n_span;
  for (int j = threadIdx.x; j < rows; j += kThreads) {
    const int at = (c[j] >> 1) - 1;
    if (at < 0) continue;
    const float e = expf(transformed(s[j], c[j], cal, gamma, delta, tau1, tau2) - mx);
    atomicAdd(o + at, static_cast<float>(static_cast<double>(e) / sum));
  }
}

}  // namespace

void span_softmax_sums(const float* scores, int64_t stride, const int32_t* codes, const int32_t* segs,
                       const int32_t* seen, int n, int n_heads, int n_kv_heads, bool calibrate, float tau1, float tau2,
                       int n_span, float* out, cudaStream_t s) {
  if (n <= 0 || n_heads <= 0) return;
  KV_CUDA(cudaMemsetAsync(out, 0, static_cast<size_t>(n) * n_heads * n_span * sizeof(float), s), "span sums");
  span_softmax_sums_kernel<<<dim3(n_heads, n), kThreads, 0, s>>>(scores, stride, codes, segs, seen, n_heads,
                                                                 n_heads / n_kv_heads, calibrate, tau1, tau2, n_span,
                                                                 out);
  KV_CUDA(cudaGetLastError(), "span_softmax_sums launch");
}

}  // namespace kvlens::cuda
