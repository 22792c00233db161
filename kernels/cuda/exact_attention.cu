// The exact attention of one decode query (core/exact_attention.h; host reference:
// exact_attention): each query head over the prompt's captured keys and values and then the
// extra rows of its KV head. One block per query head.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kThreads = 256;

__device__ float block_max(float v, float* red) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? red[lane] : -INFINITY;
    v = warp_max(v);
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  const float r = red[0];
  __syncthreads();
  return r;
}

__device__ double block_sum(double v, double* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? red[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) red[0] = v;
  }
  __syncthreads();
  const double r = red[0];
  __syncthreads();
  return r;
}

// Rows of values a block stages at once for the output (exact_attention_head), and the shared
// memory it needs: the query, the tile of values, their probabilities and flags.
__host__ __device__ inline int exact_tile_rows(int D) { return D <= 256 ? 32 : D <= 8192 ? 8192 / D : 1; }
inline size_t exact_shared_bytes(int D) {
  const int t = exact_tile_rows(D);
  return (static_cast<size_t>(D) + static_cast<size_t>(t) * D + 2 * static_cast<size_t>(t)) * sizeof(float);
}

// Query head hd of one query: the block's whole work (qs: exact_shared_bytes(D) of shared
// memory, the query first).
__device__ void exact_attention_head(const ExactArgs& a, int hd, float* qs) {
  __shared__ float red_f[kThreads / 32];
  __shared__ double red_d[kThreads / 32];
  const int h = hd / (a.NH / a.NKV), n = a.T + a.n_extra, D = a.D;
  for (int c = threadIdx.x; c < D; c += kThreads) qs[c] = a.q[static_cast<int64_t>(hd) * D + c];
  __syncthreads();
  auto valid = [&](int j) { return j < a.T || a.xpos[static_cast<int64_t>(h) * a.n_extra + (j - a.T)] >= 0; };
  auto key = [&](int j) {
    return j < a.T ? a.prompt + static_cast<int64_t>(j) * a.stride + a.k_col + static_cast<int64_t>(h) * D
                   : a.xk + (static_cast<int64_t>(h) * a.n_extra + (j - a.T)) * D;
  };
  auto value = [&](int j) {
    return j < a.T ? a.prompt + static_cast<int64_t>(j) * a.stride + a.v_col + static_cast<int64_t>(h) * D
                   : a.xv + (static_cast<int64_t>(h) * a.n_extra + (j - a.T)) * D;
  };
  float* s = a.scores + static_cast<int64_t>(hd) * n;
  float* p = a.probs + static_cast<int64_t>(hd) * n;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    float v = -INFINITY;
    if (valid(j)) {
      const float* kj = key(j);
      float dot = 0.0f;
      for (int c = 0; c < D; ++c) dot += qs[c] * kj[c];
      v = dot * a.scale;
      mx = fmaxf(mx, v);
    }
    s[j] = v;
  }
  mx = block_max(mx, red_f);
  double sum = 0.0;
  for (int j = threadIdx.x; j < n; j += kThreads) {
    float e = 0.0f;
    if (valid(j)) {
      e = expf(s[j] - mx);
      sum += e;
    }
    p[j] = e;
  }
  sum = block_sum(sum, red_d);
  for (int j = threadIdx.x; j < n; j += kThreads)
    if (valid(j)) p[j] = static_cast<float>(p[j] / sum);
  __syncthreads();  // every thread's probabilities, before the output reads them all
  // The output, channel c a thread: Σ_j double(p_j · v_j[c]) in ascending j. The rows come a
  // tile at a time into shared memory (the block's loads all in flight at once), each row's
  // probability with them (0 marks a row to skip: only valid rows are added).
  const int tile = exact_tile_rows(D);
  float* vt = qs + D;         // [tile][D]
  float* pt = vt + tile * D;  // [tile]
  int* ok = reinterpret_cast<int*>(pt + tile);
  for (int c0 = 0; c0 < D; c0 += kThreads) {
    const int c = c0 + static_cast<int>(threadIdx.x);
    double o = 0.0;
    for (int j0 = 0; j0 < n; j0 += tile) {
      const int m = min(tile, n - j0);
      for (int x = threadIdx.x; x < m * D; x += kThreads) {
        const int r = x / D, j = j0 + r;
        vt[x] = valid(j) ? value(j)[x - r * D] : 0.0f;
      }
      for (int r = threadIdx.x; r < m; r += kThreads) {
        pt[r] = p[j0 + r];
        ok[r] = valid(j0 + r);
      }
      __syncthreads();
      if (c < D)
        for (int r = 0; r < m; ++r)
          if (ok[r]) o += static_cast<double>(pt[r] * vt[r * D + c]);
      __syncthreads();
    }
    if (c < D) a.out[static_cast<int64_t>(hd) * D + c] = o;
  }
}

// Block (hd, i): query head hd of query i.
__global__ void __launch_bounds__(kThreads) exact_attention_layers_kernel(const ExactArgs* __restrict__ a) {
  extern __shared__ float qs[];
  const ExactArgs one = a[blockIdx.y];
  exact_attention_head(one, blockIdx.x, qs);
}

// One block per query head: its scores to the host's row order (a scatter), then their softmax
// (max and exp in float, the sum in double) scattered alike.
__global__ void __launch_bounds__(kThreads)
    scores_in_order_kernel(const float* __restrict__ scores, int G, int64_t stride, const int32_t* __restrict__ seg_rows,
                           int tail_rows, const int32_t* __restrict__ tail_first, const int32_t* __restrict__ map,
                           int64_t map_stride, float* __restrict__ raw, float* __restrict__ probs) {
  __shared__ float red_f[kThreads / 32];
  __shared__ double red_d[kThreads / 32];
  const int hd = blockIdx.x, kv = hd / G, seg = seg_rows[kv], n = seg + tail_rows - (tail_first ? tail_first[kv] : 0);
  const float* in = scores + static_cast<int64_t>(hd) * stride;
  float* r = raw + static_cast<int64_t>(hd) * stride;
  float* o = probs ? probs + static_cast<int64_t>(hd) * stride : nullptr;
  for (int64_t j = threadIdx.x; j < stride; j += kThreads) {
    r[j] = -INFINITY;
    if (o) o[j] = 0.0f;
  }
  __syncthreads();
  auto at = [&](int i) { return i < seg ? map[static_cast<int64_t>(kv) * map_stride + i] : i; };
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float v = in[i];
    r[at(i)] = v;
    mx = fmaxf(mx, v);
  }
  if (!o) return;
  mx = block_max(mx, red_f);
  double sum = 0.0;
  for (int i = threadIdx.x; i < n; i += kThreads) sum += static_cast<double>(expf(in[i] - mx));
  sum = block_sum(sum, red_d);
  for (int i = threadIdx.x; i < n; i += kThreads) o[at(i)] = static_cast<float>(static_cast<double>(expf(in[i] - mx)) / sum);
}

}  // namespace

void exact_attention_many(const ExactArgs* args, int n, int n_heads, int head_dim, cudaStream_t s) {
  if (n <= 0 || n_heads <= 0) return;
  const size_t shared = exact_shared_bytes(head_dim);
  if (shared > 48 * 1024)
    KV_CUDA(cudaFuncSetAttribute(exact_attention_layers_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(shared)),
            "exact_attention kernel's shared memory");
  exact_attention_layers_kernel<<<dim3(n_heads, n), kThreads, shared, s>>>(args);
  KV_CUDA(cudaGetLastError(), "exact_attention kernel (several queries)");
}

void scores_in_order(const float* scores, int n_heads, int group, int64_t stride, const int32_t* seg_rows, int tail_rows,
                     const int32_t* tail_first, const int32_t* map, int64_t map_stride, float* raw, float* probs,
                     cudaStream_t s) {
  if (n_heads <= 0) return;
  scores_in_order_kernel<<<n_heads, kThreads, 0, s>>>(scores, group, stride, seg_rows, tail_rows, tail_first, map,
                                                        map_stride, raw, probs);
  KV_CUDA(cudaGetLastError(), "scores_in_order kernel");
}

}  // namespace kvlens::cuda
