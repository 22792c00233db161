// Decode rows coded by a row codebook where they are appended (codec_tail_rows, kernels.h):
// TurboQuant's rotation, Lloyd-Max codes and QJL residual sketch, with the host coder's
// operations in its order so that the codes, scales and dequantized rows are the host's.
#include <cuda_fp16.h>

#include <mutex>
#include <set>
#include <string>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kCodecThreads = 128;
constexpr int kCodecWords = kMaxCodecDp * 8 / 32 + kMaxCodecDp / 32;  // codes of up to 8 bits, then sign bits
constexpr int kCodecStagedD = 128;  // the largest d whose S is staged in shared memory
constexpr int kCodecStagedBytes = kCodecStagedD * (kCodecStagedD + 1) * 4;

// The orthonormal Walsh–Hadamard transform of x[n] (shared memory) by the whole block: each
// span's butterflies side by side — a pair's sum and difference are the ones quant::hadamard
// computes, in whatever order a span's pairs are taken — then the scale 1/√n.
__device__ void hadamard_shared(float* x, int n) {
  for (int len = 1; len < n; len <<= 1) {
    for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int j = (p / len) * (len << 1) + p % len;
      const float a = x[j], b = x[j + len];
      x[j] = a + b;
      x[j + len] = a - b;
    }
    __syncthreads();
  }
  const float s = 1.0f / sqrtf(static_cast<float>(n));
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] *= s;
  __syncthreads();
}

// quant::nearest_level: the level whose midpoints with its neighbours bracket x.
__device__ uint32_t nearest_level(const float* levels, int n, float x) {
  uint32_t lo = 0, hi = static_cast<uint32_t>(n) - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (x > 0.5f * (levels[mid] + levels[mid + 1])) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Code `bits` wide at index i of a little-endian bit stream of 32-bit words.
__device__ void put_code(uint32_t* words, int i, int bits, uint32_t code) {
  const int bit = i * bits, w = bit >> 5, o = bit & 31;
  atomicOr(&words[w], code << o);
  if (o + bits > 32) atomicOr(&words[w + 1], code >> (32 - o));
}

__device__ uint8_t byte_of(const uint32_t* words, int k) { return static_cast<uint8_t>(words[k >> 2] >> (8 * (k & 3))); }

// Block (side, KV head): side 0 the key row, 1 the value row.
// staged_d > 0: the key codec's S (staged_d × staged_d) is staged in dynamic shared memory.
__global__ void codec_tail_kernel(CodecDev kc, CodecDev vc, __half* K, __half* V, int NKV, int D, int cap,
                                  const int32_t* counter, uint8_t* kcodes, uint8_t* vcodes, __half* scales,
                                  int staged_d) {
  __shared__ float x[kMaxCodecDp], y[kMaxCodecDp], xm[kMaxCodecDp], sg[kMaxCodecDp], lv[256];
  __shared__ uint32_t words[kCodecWords];
  __shared__ float norm_s, gamma_s;
  __shared__ __half norm_h, gamma_h;
  const int side = blockIdx.x / NKV, h = blockIdx.x % NKV;
  const CodecDev c = side ? vc : kc;
  // Before the wait (the codec depends on no kernel): the signs and levels into shared memory,
  // and a key block's S too where it fits (rows d + 1 apart: S·r down a row and Sᵀ·sign down a
  // column both read distinct banks) — by the time this layer runs, the decode step's weights
  // have streamed through L2, and S read from memory a row at a time costs a round trip each.
  extern __shared__ float sS[];
  const bool staged = staged_d > 0 && side == 0;
  for (int j = threadIdx.x; j < c.dp; j += blockDim.x) sg[j] = c.signs[j];
  for (int j = threadIdx.x; c.mse_bits > 0 && j < (1 << c.mse_bits); j += blockDim.x) lv[j] = c.levels[j];
  if (staged) {
    const int d = c.d, n4 = d * d / 4;
#pragma unroll 8
    for (int q = threadIdx.x; q < n4; q += blockDim.x) {
      const float4 w = reinterpret_cast<const float4*>(c.S)[q];
      const int i = (4 * q) / d, j = (4 * q) % d;
      float* o = sS + i * (d + 1) + j;
      o[0] = w.x;
      o[1] = w.y;
      o[2] = w.z;
      o[3] = w.w;
    }
  }
  // S[i][j] as S·r reads it (i·ri + j·rj from sr) and as Sᵀ·sign reads it (from sa).
  const float* sr = staged ? sS : c.St;
  const float* sa = staged ? sS : c.S;
  const int64_t ri = staged ? c.d + 1 : 1, rj = staged ? 1 : c.d, ai = staged ? c.d + 1 : c.d;
  pdl_wait();
  pdl_trigger();
  const int row = *counter - 1;
  if (row < 0 || row >= cap) return;
  const int64_t at = static_cast<int64_t>(h) * cap + row;
  __half* xr = (side ? V : K) + at * D;
  const int d = c.d, dp = c.dp, mb = c.mse_bits;
  const int code_words = (dp * mb + 31) / 32, sign_words = c.qjl ? (d + 31) / 32 : 0;
  for (int j = threadIdx.x; j < dp; j += blockDim.x) x[j] = j < d ? __half2float(xr[j]) : 0.0f;
  for (int i = threadIdx.x; i < code_words + sign_words; i += blockDim.x) words[i] = 0;
  __syncthreads();
  if (threadIdx.x == 0) {
    double nn = 0;
#pragma unroll 16
    for (int j = 0; j < d; ++j) nn = fma(static_cast<double>(x[j]), static_cast<double>(x[j]), nn);
    norm_h = __float2half_rn(static_cast<float>(sqrt(nn)));
    norm_s = __half2float(norm_h);
  }
  __syncthreads();
  const float norm = norm_s;
  if (mb > 0) {
    for (int j = threadIdx.x; j < dp; j += blockDim.x) y[j] = j < d ? x[j] * sg[j] : 0.0f;
    __syncthreads();
    hadamard_shared(y, dp);
    const float sq = sqrtf(static_cast<float>(dp));
    const float to_unit = norm > 0 ? sq / norm : 0.0f, from_unit = norm / sq;
    for (int j = threadIdx.x; j < dp; j += blockDim.x) {
      const uint32_t code = nearest_level(lv, 1 << mb, y[j] * to_unit);
      xm[j] = lv[code] * from_unit;
      put_code(words, j, mb, code);
    }
    __syncthreads();
    hadamard_shared(xm, dp);
    for (int j = threadIdx.x; j < d; j += blockDim.x) xm[j] = xm[j] * sg[j];
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) xm[j] = 0.0f;
  }
  __syncthreads();
  if (c.qjl) {
    for (int j = threadIdx.x; j < d; j += blockDim.x) y[j] = x[j] - xm[j];  // r
    __syncthreads();
    if (threadIdx.x == 0) {
      double rr = 0;
#pragma unroll 16
      for (int j = 0; j < d; ++j) rr = fma(static_cast<double>(y[j]), static_cast<double>(y[j]), rr);
      gamma_h = __float2half_rn(static_cast<float>(sqrt(rr)));
      gamma_s = __half2float(gamma_h);
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {  // sign(S·r), row i of S read down St's column
      double s = 0;  // (unrolled: the loads of S go out together; the sum stays in index order)
#pragma unroll 16
      for (int j = 0; j < d; ++j) s = fma(static_cast<double>(sr[i * ri + j * rj]), static_cast<double>(y[j]), s);
      if (s >= 0) atomicOr(&words[code_words + (i >> 5)], 1u << (i & 31));
    }
    __syncthreads();
    const double cc = sqrt(M_PI / 2.0) * static_cast<double>(gamma_s) / d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      double acc = 0;
#pragma unroll 16
      for (int i = 0; i < d; ++i) {
        const double sij = sa[i * ai + j];
        acc += (words[code_words + (i >> 5)] >> (i & 31)) & 1u ? sij : -sij;
      }
      xr[j] = __float2half_rn(static_cast<float>(fma(cc, acc, static_cast<double>(xm[j]))));
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) xr[j] = __float2half_rn(xm[j]);
  }
  uint8_t* out = (side ? vcodes : kcodes) + at * c.row_bytes;
  const int code_bytes = (dp * mb + 7) / 8, sign_bytes = c.qjl ? (d + 7) / 8 : 0;
  for (int k = threadIdx.x; k < code_bytes; k += blockDim.x) out[k] = byte_of(words, k);
  for (int k = threadIdx.x; k < sign_bytes; k += blockDim.x) out[code_bytes + k] = byte_of(words + code_words, k);
  if (threadIdx.x == 0) {
    const int64_t plane = static_cast<int64_t>(NKV) * cap;
    scales[(side ? 2 : 0) * plane + at] = norm_h;
    if (c.qjl) scales[plane + at] = gamma_h;
  }
}

}  // namespace

void codec_tail_rows(const CodecDev& kc, const CodecDev& vc, __half* k, __half* v, int NKV, int D, int cap,
                     const int32_t* counter, uint8_t* kcodes, uint8_t* vcodes, __half* scales, cudaStream_t s) {
  for (const CodecDev* c : {&kc, &vc})
    if (c->d != D || c->dp < D || c->dp > kMaxCodecDp || (c->dp & (c->dp - 1)) || c->mse_bits < 0 || c->mse_bits > 8 ||
        (c->qjl && c->d > kMaxCodecDp) || (c->mse_bits == 0 && !c->qjl))
      throw InternalError("codec_tail_rows: a codec of " + std::to_string(c->d) + " values padded to " +
                          std::to_string(c->dp) + ", " + std::to_string(c->mse_bits) + " code bits" +
                          (c->qjl ? " and a sign sketch" : "") + " for head size " + std::to_string(D) +
                          " (the head size, a power of two up to " + std::to_string(kMaxCodecDp) + ", 0 to 8 bits)");
  if (NKV == 0) return;
  const int staged_d = kc.qjl && kc.d <= kCodecStagedD && kc.d % 4 == 0 ? kc.d : 0;
  const size_t smem = staged_d ? static_cast<size_t>(staged_d) * (staged_d + 1) * 4 : 0;
  if (smem) {
    static std::mutex mu;
    static std::set<int> ready;  // devices whose kernel may take kCodecStagedBytes
    int dev = 0;
    KV_CUDA(cudaGetDevice(&dev), "codec_tail_rows: the current device");
    const std::lock_guard<std::mutex> lock(mu);
    if (!ready.count(dev)) {
      KV_CUDA(cudaFuncSetAttribute(codec_tail_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kCodecStagedBytes),
              "codec_tail_kernel: shared memory for S");
      ready.insert(dev);
    }
  }
  KV_CUDA(launch_dependent(codec_tail_kernel, 2 * NKV, kCodecThreads, smem, s, true, kc, vc, k, v, NKV, D, cap, counter,
                           kcodes, vcodes, scales, staged_d),
          "codec_tail_kernel for " + std::to_string(NKV) + " KV heads");
}

}  // namespace kvlens::cuda
