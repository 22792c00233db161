// Norms, activations, RoPE, embedding gather and softmax. CPU twins: kernels/cpu/ops.cpp.
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v, float* sh) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  float t = l < nw ? sh[l] : 0.0f;
  t = warp_sum(t);
  return t;
}

template <class T>
__global__ void rms_norm_kernel(const float* __restrict__ x, T* __restrict__ y, int D, const float* __restrict__ g,
                                float eps) {
  __shared__ float sh[32];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * D;
  T* yr = y + static_cast<int64_t>(blockIdx.x) * D;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, sh);
  const float inv = rsqrtf(ss / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) yr[i] = from_f<T>(g[i] * (xr[i] * inv));
}

template <class T>
__global__ void layer_norm_kernel(const float* x, T* y, int D, const float* __restrict__ g,
                                  const float* __restrict__ b, float eps) {
  __shared__ float sh[32];
  const float* xr = x + static_cast<int64_t>(blockIdx.x) * D;
  T* yr = y + static_cast<int64_t>(blockIdx.x) * D;
  float s = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) s += xr[i];
  const float mean = block_sum(s, sh) / D;
  float v = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
  const float inv = rsqrtf(block_sum(v, sh) / D + eps);
  __syncthreads();  // every read of the row is done before an in-place write
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    yr[i] = from_f<T>((xr[i] - mean) * inv * g[i] + (b ? b[i] : 0.0f));
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

template <class T>
__global__ void bias_act_kernel(const float* y, const float* bias, int64_t M, int64_t N, int act, T* out) {
  const int64_t n = M * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = y[i];
    if (bias) v += bias[i % N];
    if (act >= 0) v = activate(v, act);
    out[i] = from_f<T>(v);
  }
}

__global__ void add_bias_rows_kernel(float* y, const float* bias, int64_t M, int64_t N, int accumulate) {
  const int64_t n = M * N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = accumulate ? y[i] + bias[i % N] : bias[i % N];
}

template <class T>
__global__ void gated_act_kernel(const float* gu, int64_t M, int64_t I, int act, T* out) {
  const int64_t n = M * I;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = i / I, c = i % I;
    const float* r = gu + m * 2 * I;
    out[i] = from_f<T>(activate(r[c], act) * r[I + c]);
  }
}

__global__ void rope_kernel(float* x, int T, int64_t stride, int64_t q_col, int nq, int64_t k_col, int nk, int D,
                            const int32_t* pos, const float* inv_freq, const int32_t* row_of, int64_t row_stride) {
  const int half = D / 2;
  const int64_t n = static_cast<int64_t>(T) * (nq + nk) * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const int hh = static_cast<int>((idx / half) % (nq + nk));
    const int t = static_cast<int>(idx / (static_cast<int64_t>(half) * (nq + nk)));
    float* r = x + t * stride + (hh < nq ? q_col + static_cast<int64_t>(hh) * D : k_col + static_cast<int64_t>(hh - nq) * D);
    const int32_t p = row_of ? pos[row_of[i] * row_stride + t] : pos[t];
    const float ang = static_cast<float>(p) * inv_freq[i];
    float s, c;
    sincosf(ang, &s, &c);
    const float a = r[i], b = r[i + half];
    r[i] = rope_first(a, b, s, c);
    r[i + half] = rope_second(a, b, s, c);
  }
}

template <class T>
__global__ void embed_kernel(const T* table, int64_t V, int64_t H, const int32_t* ids, int T_, float* out) {
  const int64_t n = static_cast<int64_t>(T_) * H;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(i / H);
    int id = ids[t];
    id = id < 0 ? 0 : (id >= V ? static_cast<int>(V - 1) : id);  // ids are checked on the host
    out[i] = to_f<T>(table[static_cast<int64_t>(id) * H + i % H]);
  }
}

// The greedy token of one row of logits, as std::max_element picks it (the first index of the
// largest value; NaN never compares larger, and a NaN first value is kept), then the position
// advanced: the next decode step's input, left on the device. One block.
constexpr int kNextTokenThreads = 1024;
__global__ void __launch_bounds__(kNextTokenThreads) next_token_kernel(const float* x, int n, int32_t* ids, int32_t* pos) {
  pdl_wait();
  // (w, j) replaces (v, i) when larger, or equal at a smaller index: the order of visits does
  // not matter.
  auto take = [](float& v, int& i, float w, int j) {
    if (j >= 0 && !isnan(w) && (i < 0 || v < w || (v == w && j < i))) v = w, i = j;
  };
  float bv = 0.0f;
  int bi = -1;  // none yet
  // 16-byte loads, eight of them in flight a thread; the rest one by one.
  const int n4 = (reinterpret_cast<uintptr_t>(x) & 15) == 0 ? n / 4 : 0;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int i0 = threadIdx.x; i0 < n4; i0 += 8 * kNextTokenThreads) {
    float4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = i0 + u * kNextTokenThreads;
      v[u] = i < n4 ? x4[i] : make_float4(NAN, NAN, NAN, NAN);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int i = 4 * (i0 + u * kNextTokenThreads);
      take(bv, bi, v[u].x, i), take(bv, bi, v[u].y, i + 1), take(bv, bi, v[u].z, i + 2), take(bv, bi, v[u].w, i + 3);
    }
  }
  for (int i = 4 * n4 + threadIdx.x; i < n; i += kNextTokenThreads) take(bv, bi, x[i], i);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    take(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  __shared__ float sv[32];
  __shared__ int si[32];
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  if (l == 0) sv[w] = bv, si[w] = bi;
  __syncthreads();
  if (w != 0) return;
  bv = sv[l], bi = si[l];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    take(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  if (l == 0) {
    ids[0] = bi < 0 || isnan(x[0]) ? 0 : bi;
    pos[0] += 1;
  }
}

// The softmax of row[0..n) in place by one warp, lane l taking the entries l, l + 32, ...: the
// maximum, each exp(x − max) summed by its lane in that order and the lanes' sums by warp_sum,
// each entry times 1/sum. A row of up to 32 · kSoftmaxPer entries is read once and held in v
// (v[c]: entry l + 32c, its probability on return); a longer one is read from memory at each
// step. Either way the same operations in the same order: the same values. A row without a
// finite maximum becomes zeros. A block of kSoftmaxThreads takes kSoftmaxThreads / 32 rows.
constexpr int kSoftmaxThreads = 256, kSoftmaxRows = kSoftmaxThreads / 32, kSoftmaxPer = 32;
__device__ __forceinline__ bool softmax_row_held(int n) { return n <= 32 * kSoftmaxPer; }
__device__ __forceinline__ void softmax_row(float* row, int n, float (&v)[kSoftmaxPer]) {
  const bool held = softmax_row_held(n);
  const int l = threadIdx.x & 31;
  float mx = -INFINITY;
  if (held) {
#pragma unroll
    for (int c = 0; c < kSoftmaxPer; ++c) {
      const int j = l + 32 * c;
      v[c] = j < n ? row[j] : -INFINITY;
      mx = fmaxf(mx, v[c]);
    }
  } else {
    for (int j = l; j < n; j += 32) mx = fmaxf(mx, row[j]);
  }
  mx = warp_max(mx);
  if (!isfinite(mx)) {
#pragma unroll
    for (int c = 0; c < kSoftmaxPer; ++c) v[c] = 0.0f;
    for (int j = l; j < n; j += 32) row[j] = 0.0f;
    return;
  }
  float s = 0.0f;
  if (held) {
#pragma unroll
    for (int c = 0; c < kSoftmaxPer; ++c) {
      if (l + 32 * c < n) {
        const float e = expf(v[c] - mx);
        v[c] = e;
        s += e;
      }
    }
  } else {
    for (int j = l; j < n; j += 32) {
      const float e = expf(row[j] - mx);
      row[j] = e;
      s += e;
    }
  }
  s = warp_sum(s);
  const float inv = 1.0f / s;
  if (held) {
#pragma unroll
    for (int c = 0; c < kSoftmaxPer; ++c) {
      const int j = l + 32 * c;
      if (j < n) row[j] = v[c] = v[c] * inv;
    }
  } else {
    for (int j = l; j < n; j += 32) row[j] *= inv;
  }
}

__global__ void __launch_bounds__(kSoftmaxThreads) softmax_rows_kernel(float* x, int64_t rows, int n) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kSoftmaxRows + (threadIdx.x >> 5);
  if (r >= rows) return;
  float v[kSoftmaxPer];
  softmax_row(x + r * n, n, v);
}

// softmax_row of each of P's rows ([n_heads][na][n], row a of a head being query row i = q[a],
// or q0 + a without a list), then the row's entries j ≤ i below p · (their maximum), or equal to
// 0 with zeros_below, added to below[head] (the counts from the values in hand).
__global__ void __launch_bounds__(kSoftmaxThreads) softmax_below_kernel(float* P, int64_t rows, int n, int na,
                                                                     const int* __restrict__ q, int q0, double p,
                                                                     int zeros_below,
                                                                     unsigned long long* __restrict__ below) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kSoftmaxRows + (threadIdx.x >> 5);
  if (r >= rows) return;
  float v[kSoftmaxPer];
  float* row = P + r * n;
  softmax_row(row, n, v);
  const int a = static_cast<int>(r % na), h = static_cast<int>(r / na);
  const int i = q ? q[a] : q0 + a, l = threadIdx.x & 31;
  // f(x) for each of the lane's probabilities x of the keys j ≤ i, held or read back (each lane
  // reads back only entries it wrote).
  auto seen = [&](auto&& f) {
    if (softmax_row_held(n)) {
#pragma unroll
      for (int c = 0; c < kSoftmaxPer; ++c)
        if (l + 32 * c <= i) f(v[c]);
    } else {
      for (int j = l; j <= i; j += 32) f(row[j]);
    }
  };
  float m = -INFINITY;
  seen([&](float x) { m = fmaxf(m, x); });
  m = warp_max(m);
  const double thr = p * static_cast<double>(m);
  unsigned int cnt = 0;
  seen([&](float x) { cnt += (static_cast<double>(x) < thr || (zeros_below && x == 0.0f)) ? 1u : 0u; });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  if (l == 0 && cnt) atomicAdd(below + h, static_cast<unsigned long long>(cnt));
}

__global__ void first_nonfinite_kernel(const float* x, int64_t n, unsigned long long* slot) {
  pdl_wait();
  pdl_trigger();  // the next product may start its weight reads
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    if (!isfinite(x[i]))
      atomicMin(slot, (static_cast<unsigned long long>(i) << 32) | __float_as_uint(x[i]));
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 65535)); }

}  // namespace

void rms_norm(const float* x, void* y, Dt ydt, int M, int D, const float* g, float eps, cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(ydt, [&](auto t) {
    using T = decltype(t);
    rms_norm_kernel<T><<<M, 256, 0, s>>>(x, static_cast<T*>(y), D, g, eps);
  });
  KV_LAUNCH("rms_norm_kernel", std::to_string(M) + "x" + std::to_string(D));
}

void layer_norm(const float* x, void* y, Dt ydt, int M, int D, const float* g, const float* b, float eps,
                cudaStream_t s) {
  if (M == 0) return;
  dispatch_float(ydt, [&](auto t) {
    using T = decltype(t);
    layer_norm_kernel<T><<<M, 256, 0, s>>>(x, static_cast<T*>(y), D, g, b, eps);
  });
  KV_LAUNCH("layer_norm_kernel", std::to_string(M) + "x" + std::to_string(D));
}

void add(float* x, const float* y, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_kernel<<<grid_for(n), 256, 0, s>>>(x, y, n);
  KV_LAUNCH("add_kernel", std::to_string(n) + " values");
}

void bias_act(const float* y, const float* bias, int64_t M, int64_t N, int act, void* out, Dt odt, cudaStream_t s) {
  if (M * N == 0) return;
  dispatch_float(odt, [&](auto t) {
    using T = decltype(t);
    bias_act_kernel<T><<<grid_for(M * N), 256, 0, s>>>(y, bias, M, N, act, static_cast<T*>(out));
  });
  KV_LAUNCH("bias_act_kernel", std::to_string(M) + "x" + std::to_string(N));
}

void add_bias_rows(float* y, const float* bias, int64_t M, int64_t N, bool accumulate, cudaStream_t s) {
  if (M * N == 0) return;
  add_bias_rows_kernel<<<grid_for(M * N), 256, 0, s>>>(y, bias, M, N, accumulate ? 1 : 0);
  KV_LAUNCH("add_bias_rows_kernel", std::to_string(M) + "x" + std::to_string(N));
}

void gated_act(const float* gu, int64_t M, int64_t I, int act, void* out, Dt odt, cudaStream_t s) {
  if (M * I == 0) return;
  dispatch_float(odt, [&](auto t) {
    using T = decltype(t);
    gated_act_kernel<T><<<grid_for(M * I), 256, 0, s>>>(gu, M, I, act, static_cast<T*>(out));
  });
  KV_LAUNCH("gated_act_kernel", std::to_string(M) + "x" + std::to_string(I));
}

void rope(float* x, int T, int64_t stride, int64_t q_col, int nq, int64_t k_col, int nk, int D, const int32_t* pos,
          const float* inv_freq, const int32_t* row_of, cudaStream_t s) {
  const int64_t n = static_cast<int64_t>(T) * (nq + nk) * (D / 2);
  if (n == 0) return;
  rope_kernel<<<grid_for(n), 256, 0, s>>>(x, T, stride, q_col, nq, k_col, nk, D, pos, inv_freq, row_of, T);
  KV_LAUNCH("rope_kernel", std::to_string(T) + " tokens");
}

void embed(const void* table, Dt tdt, int64_t V, int64_t H, const int32_t* ids, int T, float* out, cudaStream_t s) {
  if (T == 0) return;
  dispatch_float(tdt, [&](auto t) {
    using TT = decltype(t);
    embed_kernel<TT><<<grid_for(T * H), 256, 0, s>>>(static_cast<const TT*>(table), V, H, ids, T, out);
  });
  KV_LAUNCH("embed_kernel", std::to_string(T) + " tokens");
}

void first_nonfinite(const float* x, int64_t n, unsigned long long* slot, cudaStream_t s) {
  if (n == 0) return;
  KV_CUDA(launch_dependent(first_nonfinite_kernel, grid_for(n), 256, 0, s, true, x, n, slot),
          "first_nonfinite_kernel over " + std::to_string(n) + " values");
}

void next_token(const float* logits, int n, int32_t* ids, int32_t* pos, cudaStream_t s) {
  if (n <= 0) throw InternalError("next_token: no logits");
  KV_CUDA(launch_dependent(next_token_kernel, 1, kNextTokenThreads, 0, s, true, logits, n, ids, pos),
          "next_token_kernel over " + std::to_string(n) + " logits");
}

void softmax_rows(float* x, int64_t rows, int n, cudaStream_t s) {
  if (rows == 0 || n == 0) return;
  softmax_rows_kernel<<<static_cast<unsigned>((rows + kSoftmaxRows - 1) / kSoftmaxRows), kSoftmaxThreads, 0, s>>>(x, rows, n);
  KV_LAUNCH("softmax_rows_kernel", std::to_string(rows) + "x" + std::to_string(n));
}

void softmax_below_rows(float* P, int n_heads, int na, int n, const int* queries, int q0, double p, bool zeros_below,
                        unsigned long long* below, cudaStream_t s) {
  if (n_heads == 0 || na == 0 || n == 0) return;
  const int64_t rows = static_cast<int64_t>(n_heads) * na;
  softmax_below_kernel<<<static_cast<unsigned>((rows + kSoftmaxRows - 1) / kSoftmaxRows), kSoftmaxThreads, 0, s>>>(
      P, rows, n, na, queries, q0, p, zeros_below ? 1 : 0, below);
  KV_LAUNCH("softmax_below_kernel", std::to_string(n_heads) + " heads x " + std::to_string(na) + " rows");
}

}  // namespace kvlens::cuda
