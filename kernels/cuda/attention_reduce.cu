// Reductions of a layer's causal attention probabilities in device memory, P holding a pass of
// the listed query rows ([n_heads][nq][T]; core/attention_reduce.h; reduce_attention is the host
// reference): column sums over the listed query rows, per head the entries below p · (their
// row's maximum), and the sums of a pooled heatmap's blocks. Passes run in ascending rows and
// each sum goes on from the previous pass's, in the reference's order (double, rows ascending;
// a block's: rows, heads, keys), and the counts are integers, so all equal the reference's bit
// for bit on the same probabilities.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

// One thread per (key column j, head): Σ over the pass's rows i ≥ j, from 0.0 or from `out`.
__global__ void attn_column_sums_kernel(const float* __restrict__ P, int T, const int* __restrict__ q, int nq,
                                        int go_on, double* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
  if (j >= T) return;
  const float* Ph = P + static_cast<int64_t>(h) * nq * T;
  double acc = go_on ? out[static_cast<int64_t>(h) * T + j] : 0.0;
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

// One thread per (row bin r0 + blockIdx.y, column bin c): adds to the block's sum the pass's
// rows i in that row bin (ascending), each head's entries j of the column bin with j ≤ i
// (heads ascending, keys ascending).
__global__ void attn_map_kernel(const float* __restrict__ P, int n_heads, int T, const int* __restrict__ q, int nq,
                                int rows, int cols, int keys, int r0, double* __restrict__ sums) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, r = r0 + blockIdx.y;
  if (c >= cols) return;
  const int64_t b = (static_cast<int64_t>(c) * keys + cols - 1) / cols;
  const int64_t e = (static_cast<int64_t>(c + 1) * keys + cols - 1) / cols;
  double acc = sums[static_cast<int64_t>(r) * cols + c];
  for (int a = 0; a < nq; ++a) {
    const int i = q[a];
    if (static_cast<int>(static_cast<int64_t>(i) * rows / T) != r) continue;
    const int64_t end = e < i + 1 ? e : i + 1;
    for (int h = 0; h < n_heads; ++h) {
      const float* row = P + (static_cast<int64_t>(h) * nq + a) * T;
      for (int64_t j = b; j < end; ++j) acc += static_cast<double>(row[j]);
    }
  }
  sums[static_cast<int64_t>(r) * cols + c] = acc;
}

}  // namespace

void attention_column_sums(const float* P, int n_heads, int T, const int* queries, int nq, bool go_on, double* out,
                           cudaStream_t s) {
  if (T == 0 || n_heads == 0) return;
  dim3 grid((T + 255) / 256, n_heads);
  attn_column_sums_kernel<<<grid, 256, 0, s>>>(P, T, queries, nq, go_on ? 1 : 0, out);
  KV_LAUNCH("attn_column_sums_kernel", std::to_string(n_heads) + " heads x " + std::to_string(T) + " keys");
}

void attention_below(const float* P, int n_heads, int T, const int* queries, int nq, double p, bool zeros_below,
                     unsigned long long* below, cudaStream_t s) {
  if (nq == 0 || n_heads == 0) return;
  dim3 grid(nq, n_heads);
  attn_below_kernel<<<grid, 256, 0, s>>>(P, T, queries, p, zeros_below ? 1 : 0, below);
  KV_LAUNCH("attn_below_kernel", std::to_string(n_heads) + " heads x " + std::to_string(nq) + " rows");
}

void attention_map_sums(const float* P, int n_heads, int T, const int* queries, int nq, int rows, int cols, int keys,
                        int first_bin, int n_bins, double* sums, cudaStream_t s) {
  if (nq == 0 || n_bins <= 0 || cols == 0) return;
  dim3 grid((cols + 127) / 128, n_bins);
  attn_map_kernel<<<grid, 128, 0, s>>>(P, n_heads, T, queries, nq, rows, cols, keys, first_bin, sums);
  KV_LAUNCH("attn_map_kernel", std::to_string(n_bins) + " x " + std::to_string(cols) + " blocks");
}

}  // namespace kvlens::cuda
