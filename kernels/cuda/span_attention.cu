// Recorded decode queries' attention reduced to one span of key positions (Backend::
// recorded_span_attention; host reference: recorded_attention's transform and softmax, then
// span_attention_sums). One block per (query, query head): the row maximum (and with
// calibration the visual rows' range, then the calibrated maximum), the softmax's sum in double,
// and each row's probability added at its span index. Also ZipCache's streamed-gap saliency
// (host reference: zipcache::gap_saliency), the same reduction summed over probes and heads.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"

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

// ZipCache's streamed-gap saliency: one block per (KV head, layer) over its query heads (outer)
// and probes (inner), each softmax's maximum and sum (double) over the rows its probe saw, each
// gap row's probability added by the thread that owns the row (so in the host's order).
__global__ void __launch_bounds__(kThreads)
    zip_gap_saliency_kernel(const float* __restrict__ scores, int64_t stride, int S, int NH, int NKV, int gap,
                            const int32_t* __restrict__ n_probes, const int32_t* __restrict__ seen,
                            const int32_t* __restrict__ before, bool accumulated, double* __restrict__ out) {
  __shared__ float redf[kThreads / 32];
  __shared__ double redd[kThreads / 32];
  const int kh = blockIdx.x, l = blockIdx.y, G = NH / NKV, np = n_probes[l];
  const int nb = before[l * NKV + kh];
  double* o = out + (static_cast<int64_t>(l) * NKV + kh) * gap;
  for (int j = threadIdx.x; j < gap; j += kThreads) o[j] = 0.0;
  for (int h = kh * G; h < (kh + 1) * G; ++h)
    for (int k = 0; k < np; ++k) {
      const int b = l * S + k, n_seen = min(seen[b], gap), rows = nb + n_seen;
      const float* x = scores + (static_cast<int64_t>(b) * NH + h) * stride;
      float mx = -INFINITY;
      for (int r = threadIdx.x; r < rows; r += kThreads) mx = fmaxf(mx, x[r]);
      mx = block_reduce(mx, redf, Max{});
      double z = 0.0;
      for (int r = threadIdx.x; r < rows; r += kThreads) z += exp(static_cast<double>(x[r]) - mx);
      z = block_reduce(z, redd, Sum{});
      if (!(z > 0)) continue;
      for (int j = threadIdx.x; j < n_seen; j += kThreads) o[j] += exp(static_cast<double>(x[nb + j]) - mx) / z;
    }
  if (accumulated) return;
  // Each row's (probe, head) pairs: the heads times the probes that saw it (z > 0 always: a
  // probe sees at least its own row).
  for (int j = threadIdx.x; j < gap; j += kThreads) {
    int c = 0;
    for (int k = 0; k < np; ++k) c += seen[l * S + k] > j;
    o[j] = c > 0 ? o[j] / (static_cast<double>(c) * G) : 0.0;
  }
}

}  // namespace

void zip_gap_saliency(const float* scores, int64_t stride, int L, int S, int NH, int NKV, int gap,
                      const int32_t* n_probes, const int32_t* seen, const int32_t* before, bool accumulated, double* out,
                      cudaStream_t s) {
  if (L <= 0 || NKV <= 0 || gap <= 0) return;
  zip_gap_saliency_kernel<<<dim3(NKV, L), kThreads, 0, s>>>(scores, stride, S, NH, NKV, gap, n_probes, seen, before,
                                                            accumulated, out);
  KV_CUDA(cudaGetLastError(), "zip_gap_saliency launch");
}

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
