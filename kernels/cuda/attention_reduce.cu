// Reductions of a layer's causal attention probabilities in device memory, P holding a pass of
// the listed query rows ([n_heads][nq][T]; a device list, or null for the rows q0, q0 + 1, ...;
// core/attention_reduce.h; reduce_attention is the host reference): column sums over the listed
// query rows and the sums of a pooled heatmap's blocks (the counts below a share of a row's
// maximum come with the softmax: softmax_below_rows, elementwise.cu). Passes run in ascending
// rows and each sum goes on from the previous pass's, in the reference's order (double, rows
// ascending; a block's: rows, heads, keys), so all equal the reference's bit for bit on the same
// probabilities.
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

// One thread per (key column j, head): Σ over the pass's rows, from 0.0 or from `out`, in
// ascending row. A row's masked entries (j > i) are 0, and adding 0 leaves a sum of probabilities
// as it was, so every row is added: the sum over the rows i ≥ j, bit for bit. Eight rows' loads
// are in flight before their sums.
__global__ void attn_column_sums_kernel(const float* __restrict__ P, int T, int nq, int go_on, double* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
  if (j >= T) return;
  const float* p = P + static_cast<int64_t>(h) * nq * T + j;
  double acc = go_on ? out[static_cast<int64_t>(h) * T + j] : 0.0;
  int a = 0;
  for (; a + 8 <= nq; a += 8) {
    float v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = p[static_cast<int64_t>(a + u) * T];
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += static_cast<double>(v[u]);
  }
  for (; a < nq; ++a) acc += static_cast<double>(p[static_cast<int64_t>(a) * T]);
  out[static_cast<int64_t>(h) * T + j] = acc;
}

// One thread per (row bin r0 + blockIdx.y, column bin c): adds to the block's sum the pass's
// rows i in that row bin (ascending), each head's entries j of the column bin with j ≤ i
// (heads ascending, keys ascending).
__global__ void attn_map_kernel(const float* __restrict__ P, int n_heads, int T, const int* __restrict__ q, int q0, int nq,
                                int rows, int cols, int keys, int r0, double* __restrict__ sums) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x, r = r0 + blockIdx.y;
  if (c >= cols) return;
  const int64_t b = (static_cast<int64_t>(c) * keys + cols - 1) / cols;
  const int64_t e = (static_cast<int64_t>(c + 1) * keys + cols - 1) / cols;
  double acc = sums[static_cast<int64_t>(r) * cols + c];
  for (int a = 0; a < nq; ++a) {
    const int i = q ? q[a] : q0 + a;
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

void attention_column_sums(const float* P, int n_heads, int T, int nq, bool go_on, double* out, cudaStream_t s) {
  if (T == 0 || n_heads == 0) return;
  dim3 grid((T + 127) / 128, n_heads);
  attn_column_sums_kernel<<<grid, 128, 0, s>>>(P, T, nq, go_on ? 1 : 0, out);
  KV_LAUNCH("attn_column_sums_kernel", std::to_string(n_heads) + " heads x " + std::to_string(T) + " keys");
}

void attention_map_sums(const float* P, int n_heads, int T, const int* queries, int q0, int nq, int rows, int cols,
                        int keys, int first_bin, int n_bins, double* sums, cudaStream_t s) {
  if (nq == 0 || n_bins <= 0 || cols == 0) return;
  dim3 grid((cols + 127) / 128, n_bins);
  attn_map_kernel<<<grid, 128, 0, s>>>(P, n_heads, T, queries, q0, nq, rows, cols, keys, first_bin, sums);
  KV_LAUNCH("attn_map_kernel", std::to_string(n_bins) + " x " + std::to_string(cols) + " blocks");
}

}  // namespace kvlens::cuda
