// KV cache kernels: append rows (fp32 projections → fp16 cache rows, or each row quantized per
// token into packed codes) and gather rows (the compaction after eviction). CPU twins:
// KVStore::append (with fp16 rounding), quant::quantize_block (Axis::PerToken) on those rows, and
// keep_rows/gather_head in core/compress/select.cpp.
#include <algorithm>
#include <string>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/quant_math.cuh"

namespace kvlens::cuda {

namespace {

// One block: every thread reads the row counter first, the block waits, writes its values,
// waits again, then thread 0 advances the counter, so the next kernel sees the new rows.
__global__ void kv_append_kernel(const float* qkv, int64_t stride, int64_t k_col, int64_t v_col, int T, int NKV,
                                 int D, const int32_t* pos_in, __half* k, __half* v, int32_t* pos, int cap, int row0,
                                 int32_t* counter) {
  const int base = row0 + (counter ? *counter : 0);
  __syncthreads();
  const int64_t n = static_cast<int64_t>(T) * NKV * D;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i % D), h = static_cast<int>((i / D) % NKV), t = static_cast<int>(i / (static_cast<int64_t>(D) * NKV));
    const int row = base + t;
    if (row >= cap) continue;  // the host reserves room; never write past it
    const float* src = qkv + t * stride;
    const int64_t at = (static_cast<int64_t>(h) * cap + row) * D + d;
    k[at] = __float2half_rn(src[k_col + static_cast<int64_t>(h) * D + d]);
    v[at] = __float2half_rn(src[v_col + static_cast<int64_t>(h) * D + d]);
    if (d == 0) pos[static_cast<int64_t>(h) * cap + row] = pos_in[t];
  }
  __syncthreads();
  if (counter && threadIdx.x == 0 && blockIdx.x == 0) *counter = base - row0 + T;
}

// Batched decode: row t to sequence t (arrays [B][NKV][cap][D]); every block reads the counter,
// a second kernel advances it once all have written.
__global__ void kv_append_batch_kernel(const float* qkv, int64_t stride, int64_t k_col, int64_t v_col, int B, int NKV,
                                       int D, const int32_t* pos_in, __half* k, __half* v, int32_t* pos, int cap,
                                       int row0, const int32_t* counter) {
  const int row = row0 + (counter ? *counter : 0);
  if (row >= cap) return;
  const int64_t n = static_cast<int64_t>(B) * NKV * D;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i % D), h = static_cast<int>((i / D) % NKV), t = static_cast<int>(i / (static_cast<int64_t>(D) * NKV));
    const float* src = qkv + t * stride;
    const int64_t at = ((static_cast<int64_t>(t) * NKV + h) * cap + row) * D + d;
    k[at] = __float2half_rn(src[k_col + static_cast<int64_t>(h) * D + d]);
    v[at] = __float2half_rn(src[v_col + static_cast<int64_t>(h) * D + d]);
    if (d == 0) pos[(static_cast<int64_t>(t) * NKV + h) * cap + row] = pos_in[t];
  }
}

__global__ void counter_add_kernel(int32_t* counter, int n) { *counter += n; }

// RoPE ("rotate half") of channel pair (j, j + half) of row r at position p, in place; the
// rotated pair is returned too.
__device__ __forceinline__ void rope_pair(float* r, int j, int half, float p, const float* inv_freq, float& na,
                                          float& nb) {
  float sn, cs;
  sincosf(p * inv_freq[j], &sn, &cs);
  const float a = r[j], b = r[j + half];
  na = rope_first(a, b, sn, cs);
  nb = rope_second(a, b, sn, cs);
  r[j] = na;
  r[j + half] = nb;
}

__global__ void rope_append_kernel(float* qkv, int64_t q_col, int nq, int64_t k_col, int64_t v_col, int nk, int D,
                                   const int32_t* pos_in, const float* inv_freq, __half* k, __half* v, int32_t* kpos,
                                   int cap, int32_t* counter, int32_t* done, KeptQueries keep) {
  pdl_wait();
  pdl_trigger();
  const int row = *counter;
  const int half = D / 2, n_rope = (nq + nk) * half, n_v = nk * D;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_rope) {
    const int hh = i / half, j = i % half;
    float* r = qkv + (hh < nq ? q_col + static_cast<int64_t>(hh) * D : k_col + static_cast<int64_t>(hh - nq) * D);
    float na, nb;
    rope_pair(r, j, half, static_cast<float>(pos_in[0]), inv_freq, na, nb);
    if (hh < nq && keep.slot && row < keep.rows) {
      const int s = keep.slot[row];
      if (s >= 0) {
        float* o = keep.q + (static_cast<int64_t>(s) * nq + hh) * D;
        o[j] = na;
        o[j + half] = nb;
      }
    }
    if (hh >= nq && row < cap) {
      const int64_t at = (static_cast<int64_t>(hh - nq) * cap + row) * D;
      k[at + j] = __float2half_rn(na);
      k[at + j + half] = __float2half_rn(nb);
      if (j == 0) kpos[static_cast<int64_t>(hh - nq) * cap + row] = pos_in[0];
    }
  } else if (i < n_rope + n_v) {
    const int t = i - n_rope, kh = t / D, d = t % D;
    if (row < cap) v[(static_cast<int64_t>(kh) * cap + row) * D + d] = __float2half_rn(qkv[v_col + t]);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
    *counter = row + 1;
    *done = 0;
  }
}

// Blocks [0, nk): KV head b's key rotated (written back to qkv, as rope_append does), the key and
// value rounded to fp16 as the cache keeps rows, then each quantized with its own range — warp 0
// the key, warp 1 the value — and packed at row *counter of the tail (quant_pack.cu's layout: 8
// codes of `bits` bits in `bits` bytes, least significant first). Blocks [nk, nk + nq): query
// head b − nk rotated. Every block reads the counter first; the last to finish advances it.
__global__ void rope_quant_append_kernel(float* qkv, int64_t q_col, int nq, int64_t k_col, int64_t v_col, int nk, int D,
                                         const int32_t* pos_in, const float* inv_freq, QuantTail t, int32_t* counter,
                                         int32_t* done) {
  pdl_wait();
  pdl_trigger();
  __shared__ float rows[2][kMaxQuantTailD];
  const int row = *counter;
  const int half = D / 2, b = blockIdx.x;
  const float p = static_cast<float>(pos_in[0]);
  float* r = qkv + (b < nk ? k_col + static_cast<int64_t>(b) * D : q_col + static_cast<int64_t>(b - nk) * D);
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    float na, nb;
    rope_pair(r, j, half, p, inv_freq, na, nb);
    if (b < nk) {
      rows[0][j] = __half2float(__float2half_rn(na));
      rows[0][j + half] = __half2float(__float2half_rn(nb));
    }
  }
  if (b >= nk && t.rotation) hadamard_in_place(r, rows[0], D, t.rotation);  // the query by the keys' blocks
  if (b < nk) {
    for (int c = threadIdx.x; c < D; c += blockDim.x)
      rows[1][c] = __half2float(__float2half_rn(qkv[v_col + static_cast<int64_t>(b) * D + c]));
    __syncthreads();
    if (t.rotation) {
      hadamard_blocks(rows[0], D, t.rotation);
      __syncthreads();
    }
    const int side = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (side < 2 && row < t.cap) {
      const int64_t at = static_cast<int64_t>(b) * t.cap + row;
      const int bits = side ? t.v_bits : t.k_bits;
      quantize_row_warp(rows[side], D, bits, lane, t.ranges + (2 * side) * static_cast<int64_t>(nk) * t.cap + at,
                        t.ranges + (2 * side + 1) * static_cast<int64_t>(nk) * t.cap + at,
                        (side ? t.v : t.k) + at * (D * bits / 8));
      if (side == 0 && lane == 0) t.pos[at] = pos_in[0];
    }
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(done, 1) == static_cast<int>(gridDim.x) - 1) {
    *counter = row + 1;
    *done = 0;
  }
}

__global__ void hadamard_rows_kernel(float* x, int D, int rotation) {
  __shared__ float row[kMaxQuantTailD];
  hadamard_in_place(x + static_cast<int64_t>(blockIdx.x) * D, row, D, rotation);
}

__global__ void gather_blocks_kernel(const int32_t* src, int32_t* dst, int64_t words, const int32_t* index, int n) {
  const int64_t total = static_cast<int64_t>(n) * words;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = src[static_cast<int64_t>(index[i / words]) * words + i % words];
}

__global__ void gather_rows_kernel(const __half* const* src, __half* dst, int n, int D) {
  const int64_t total = static_cast<int64_t>(n) * D;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = src[i / D][i % D];
}

// Gather blockIdx.y of jobs: 16 bytes a thread, rows one after another over the x blocks.
__global__ void gather_segments_kernel(const RowGather* jobs, const __half* const* src, const int32_t* pos_in, int D) {
  const RowGather j = jobs[blockIdx.y];
  const int per_row = D / 8;
  const int64_t total = j.rows * per_row;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row;
    const int c = static_cast<int>(i % per_row);
    if (j.k) {
      reinterpret_cast<uint4*>(j.k + r * D)[c] = reinterpret_cast<const uint4*>(src[j.first + r])[c];
      reinterpret_cast<uint4*>(j.v + r * D)[c] = reinterpret_cast<const uint4*>(src[j.first + j.rows + r])[c];
    }
    if (c == 0) j.pos[r] = pos_in[j.pos_first + r];
  }
}

}  // namespace

void gather_segments(const RowGather* jobs, int n, int64_t max_rows, const __half* const* src, const int32_t* pos_in,
                     int D, cudaStream_t s) {
  if (n == 0 || max_rows == 0) return;
  if (D % 8 != 0 || D <= 0) throw InternalError("gather_segments: rows of " + std::to_string(D) + " halves (a multiple of 8)");
  const int64_t work = max_rows * (D / 8);
  const unsigned gx = static_cast<unsigned>(std::clamp<int64_t>((work + 255) / 256, 1, 512));
  for (int at = 0; at < n; at += 65535) {  // (the grid's y extent)
    const int m = std::min(65535, n - at);
    gather_segments_kernel<<<dim3(gx, static_cast<unsigned>(m)), 256, 0, s>>>(jobs + at, src, pos_in, D);
    KV_LAUNCH("gather_segments_kernel", std::to_string(m) + " gathers of up to " + std::to_string(max_rows) + " rows");
  }
}

void kv_append(const float* qkv, int64_t stride, int64_t k_col, int64_t v_col, int T, int NKV, int D,
               const int32_t* pos_in, __half* k, __half* v, int32_t* pos, int cap, int row0, int32_t* counter,
               cudaStream_t s) {
  if (T == 0) return;
  // With a device counter the kernel must be one block (the counter is read once, then advanced).
  const int64_t n = static_cast<int64_t>(T) * NKV * D;
  const int blocks = counter ? 1 : static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  kv_append_kernel<<<blocks, counter ? 1024 : 256, 0, s>>>(qkv, stride, k_col, v_col, T, NKV, D, pos_in, k, v, pos,
                                                            cap, row0, counter);
  KV_LAUNCH("kv_append_kernel", std::to_string(T) + " rows x " + std::to_string(NKV) + " heads");
}

void kv_append_batch(const float* qkv, int64_t stride, int64_t k_col, int64_t v_col, int B, int NKV, int D,
                     const int32_t* pos_in, __half* k, __half* v, int32_t* pos, int cap, int row0, int32_t* counter,
                     cudaStream_t s) {
  if (B == 0) return;
  const int64_t n = static_cast<int64_t>(B) * NKV * D;
  kv_append_batch_kernel<<<static_cast<int>(std::min<int64_t>((n + 255) / 256, 8192)), 256, 0, s>>>(
      qkv, stride, k_col, v_col, B, NKV, D, pos_in, k, v, pos, cap, row0, counter);
  KV_LAUNCH("kv_append_batch_kernel", std::to_string(B) + " sequences x " + std::to_string(NKV) + " heads");
  if (counter) {
    counter_add_kernel<<<1, 1, 0, s>>>(counter, 1);
    KV_LAUNCH("counter_add_kernel", "KV row counter");
  }
}

void rope_append(float* qkv, int64_t q_col, int nq, int64_t k_col, int64_t v_col, int nk, int D,
                 const int32_t* pos_in, const float* inv_freq, __half* k, __half* v, int32_t* pos, int cap,
                 int32_t* counter, int32_t* done, cudaStream_t s, const KeptQueries& keep) {
  const int n = (nq + nk) * (D / 2) + nk * D;
  KV_CUDA(launch_dependent(rope_append_kernel, (n + 255) / 256, 256, 0, s, true, qkv, q_col, nq, k_col, v_col, nk, D,
                           pos_in, inv_freq, k, v, pos, cap, counter, done, keep),
          "rope_append_kernel for " + std::to_string(nk) + " KV heads");
}

void rope_quant_append(float* qkv, int64_t q_col, int nq, int64_t k_col, int64_t v_col, int nk, int D,
                       const int32_t* pos_in, const float* inv_freq, const QuantTail& t, int32_t* counter, int32_t* done,
                       cudaStream_t s) {
  if (!quant_tail_ok(D, t.rotation) || t.k_bits < 1 || t.k_bits > 8 || t.v_bits < 1 || t.v_bits > 8)
    throw InternalError("rope_quant_append: head size " + std::to_string(D) + " (a multiple of 8, at most " +
                        std::to_string(kMaxQuantTailD) + "), bits " + std::to_string(t.k_bits) + "/" +
                        std::to_string(t.v_bits) + " (1 to 8) and rotation " + std::to_string(t.rotation) +
                        " (0, or a power of two dividing the head size)");
  KV_CUDA(launch_dependent(rope_quant_append_kernel, nk + nq, 64, 0, s, true, qkv, q_col, nq, k_col, v_col, nk, D,
                           pos_in, inv_freq, t, counter, done),
          "rope_quant_append_kernel for " + std::to_string(nk) + " KV heads");
}

void hadamard_rows(float* x, int n, int D, int rotation, cudaStream_t s) {
  if (!quant_tail_ok(D, rotation) || rotation == 0)
    throw InternalError("hadamard_rows: head size " + std::to_string(D) + " (a multiple of 8, at most " +
                        std::to_string(kMaxQuantTailD) + ") and rotation " + std::to_string(rotation) +
                        " (a power of two dividing the head size)");
  if (n == 0) return;
  hadamard_rows_kernel<<<n, 64, 0, s>>>(x, D, rotation);
  KV_LAUNCH("hadamard_rows_kernel", std::to_string(n) + " rows");
}

void gather_blocks(const void* src, void* dst, int64_t bytes, const int32_t* index, int n, cudaStream_t s) {
  if (n == 0 || bytes == 0) return;
  if (bytes % 4 != 0) throw InternalError("gather_blocks: blocks of " + std::to_string(bytes) + " bytes (a multiple of 4)");
  const int64_t total = static_cast<int64_t>(n) * (bytes / 4);
  gather_blocks_kernel<<<static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096)), 256, 0, s>>>(
      static_cast<const int32_t*>(src), static_cast<int32_t*>(dst), bytes / 4, index, n);
  KV_LAUNCH("gather_blocks_kernel", std::to_string(n) + " blocks");
}

void gather_rows(const __half* const* src, __half* dst, int n, int D, cudaStream_t s) {
  if (n == 0) return;
  const int64_t total = static_cast<int64_t>(n) * D;
  gather_rows_kernel<<<static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096)), 256, 0, s>>>(src, dst, n, D);
  KV_LAUNCH("gather_rows_kernel", std::to_string(n) + " rows");
}

}  // namespace kvlens::cuda
