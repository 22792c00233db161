// Reductions of a layer's causal attention probabilities in device memory, P holding the listed
// query rows alone ([n_heads][nq][T]; core/attention_reduce.h; reduce_attention is the host
// reference): column sums over the listed query rows, and per head the entries below
// p · (their row's maximum). The sums are added in
// double in ascending query order from 0.0 and the counts are integers, so both equal the
// reference's bit for bit on the same probabilities.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

// One thread per (key column j, head): Σ over the listed rows i ≥ j.
__global__ void attn_column_sums_kernel(const float* __restrict__ P, int T, const int* __restrict__ q, int nq,
                                        double* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
  if (j >= T) return;
  const float* Ph = P + static_cast<int64_t>(h) * nq * T;
  double acc = 0.0;
  for (int a = 0; a < nq; ++a) {
    const int i = q[a];
    if (j <= i) acc += static_cast<double>(Ph[static_cast<int64_t>(a) * T + j]);
  }
  out[static_cast<int64_t>(h) * T + j] = acc;
}

// One block per (listed row, head): the row's maximum over j ≤ i, then its entries below
// p · max (or equal to 0 with zeros_below), added to below[h].
__global__ void attn_below_kernel(const float* __restrict__ P, int T, const int* __restrict__ q, double p,
                                  int zeros_below, unsigned long long* __restrict__ below) {
  __shared__ float shm[32];
  __shared__ unsigned int shc[32];
  const int h = blockIdx.y, i = q[blockIdx.x];
  const float* row = P + (static_cast<int64_t>(h) * gridDim.x + blockIdx.x) * T;
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = warp_max(mx);
  if (l == 0) shm[w] = mx;
  __syncthreads();
  mx = l < nw ? shm[l] : -INFINITY;
  mx = warp_max(mx);
  const double thr = p * static_cast<double>(mx);
  unsigned int n = 0;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) {
    const float x = row[j];
    n += (static_cast<double>(x) < thr || (zeros_below && x == 0.0f)) ? 1u : 0u;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
  if (l == 0) shc[w] = n;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long s = 0;
    for (int k = 0; k < nw; ++k) s += shc[k];
    atomicAdd(below + h, s);
  }
}

}  // namespace

void attention_column_sums(const float* P, int n_heads, int T, const int* queries, int nq, double* out,
                           cudaStream_t s) {
  if (T == 0 || n_heads == 0) return;
  dim3 grid((T + 255) / 256, n_heads);
  attn_column_sums_kernel<<<grid, 256, 0, s>>>(P, T, queries, nq, out);
  KV_LAUNCH("attn_column_sums_kernel", std::to_string(n_heads) + " heads x " + std::to_string(T) + " keys");
}

void attention_below(const float* P, int n_heads, int T, const int* queries, int nq, double p, bool zeros_below,
                     unsigned long long* below, cudaStream_t s) {
  if (nq == 0 || n_heads == 0) return;
  dim3 grid(nq, n_heads);
  attn_below_kernel<<<grid, 256, 0, s>>>(P, T, queries, p, zeros_below ? 1 : 0, below);
  KV_LAUNCH("attn_below_kernel", std::to_string(n_heads) + " heads x " + std::to_string(nq) + " rows");
}

}  // namespace kvlens::cuda
