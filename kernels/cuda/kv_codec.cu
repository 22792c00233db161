// Decode rows coded by a row codebook where they are appended (codec_tail_rows, kernels.h):
// TurboQuant's rotation, Lloyd-Max codes and QJL residual sketch, with the host coder's
// operations in its order so that the codes, scales and dequantized rows are the host's.
#include <cuda_fp16.h>

#include <algorithm>
#include <map>
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

// Thread 0: ‖x[0, d)‖ as the host's coder takes it (fused double sums in index order), rounded
// to fp16, into *h and as a float into *f (read after the block's next barrier).
__device__ void norm_of(const float* x, int d, __half* h, float* f) {
  if (threadIdx.x != 0) return;
  double s = 0;
#pragma unroll 16
  for (int j = 0; j < d; ++j) s = fma(static_cast<double>(x[j]), static_cast<double>(x[j]), s);
  *h = __float2half_rn(static_cast<float>(sqrt(s)));
  *f = __half2float(*h);
}

__device__ uint8_t byte_of(const uint32_t* words, int k) { return static_cast<uint8_t>(words[k >> 2] >> (8 * (k & 3))); }

// A coding block's shared memory (besides S, staged in dynamic shared memory).
struct CodecShared {
  float x[kMaxCodecDp], y[kMaxCodecDp], xm[kMaxCodecDp], sg[kMaxCodecDp], lv[256];
  uint32_t words[kCodecWords];
  float norm_s, gamma_s;
  __half norm_h, gamma_h;
};

// The codec's tables into shared memory: its signs and levels, and with `staged` its S (rows
// d + 1 apart: S·r down a row and Sᵀ·sign down a column both read distinct banks). No kernel
// writes them, so a dependent kernel loads them before its wait.
__device__ void load_codec(const CodecDev& c, bool staged, CodecShared& sh, float* sS) {
  for (int j = threadIdx.x; j < c.dp; j += blockDim.x) sh.sg[j] = c.signs[j];
  for (int j = threadIdx.x; c.mse_bits > 0 && j < (1 << c.mse_bits); j += blockDim.x) sh.lv[j] = c.levels[j];
  if (!staged) return;
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

// Codes the row in sh.x (x[j] for j < d, zeros up to dp, written by the caller) as
// turboquant::Codec::encode_row does: its dequantization rounded to fp16 into out[d], its codes
// into codes[row_bytes], ‖x‖ into *norm and with QJL ‖r‖ into *gamma. Every thread of the block
// calls it; shared memory may be written again when it returns.
__device__ void code_row(const CodecDev& c, bool staged, const float* sS, CodecShared& sh, __half* out, uint8_t* codes,
                         __half* norm_out, __half* gamma_out) {
  // S[i][j] as S·r reads it (i·ri + j·rj from sr) and as Sᵀ·sign reads it (from sa).
  const float* sr = staged ? sS : c.St;
  const float* sa = staged ? sS : c.S;
  const int64_t ri = staged ? c.d + 1 : 1, rj = staged ? 1 : c.d, ai = staged ? c.d + 1 : c.d;
  const int d = c.d, dp = c.dp, mb = c.mse_bits;
  float *x = sh.x, *y = sh.y, *xm = sh.xm;
  uint32_t* words = sh.words;
  const int code_words = (dp * mb + 31) / 32, sign_words = c.qjl ? (d + 31) / 32 : 0;
  for (int i = threadIdx.x; i < code_words + sign_words; i += blockDim.x) words[i] = 0;
  __syncthreads();
  norm_of(x, d, &sh.norm_h, &sh.norm_s);
  __syncthreads();
  const float norm = sh.norm_s;
  if (mb > 0) {
    for (int j = threadIdx.x; j < dp; j += blockDim.x) y[j] = j < d ? x[j] * sh.sg[j] : 0.0f;
    __syncthreads();
    hadamard_shared(y, dp);
    const float sq = sqrtf(static_cast<float>(dp));
    const float to_unit = norm > 0 ? sq / norm : 0.0f, from_unit = norm / sq;
    for (int j = threadIdx.x; j < dp; j += blockDim.x) {
      const uint32_t code = nearest_level(sh.lv, 1 << mb, y[j] * to_unit);
      xm[j] = sh.lv[code] * from_unit;
      put_code(words, j, mb, code);
    }
    __syncthreads();
    hadamard_shared(xm, dp);
    for (int j = threadIdx.x; j < d; j += blockDim.x) xm[j] = xm[j] * sh.sg[j];
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) xm[j] = 0.0f;
  }
  __syncthreads();
  if (c.qjl) {
    for (int j = threadIdx.x; j < d; j += blockDim.x) y[j] = x[j] - xm[j];  // r
    __syncthreads();
    norm_of(y, d, &sh.gamma_h, &sh.gamma_s);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {  // sign(S·r)
      double s = 0;  // (unrolled: the loads of S go out together; the sum stays in index order)
#pragma unroll 16
      for (int j = 0; j < d; ++j) s = fma(static_cast<double>(sr[i * ri + j * rj]), static_cast<double>(y[j]), s);
      if (s >= 0) atomicOr(&words[code_words + (i >> 5)], 1u << (i & 31));
    }
    __syncthreads();
    const double cc = sqrt(M_PI / 2.0) * static_cast<double>(sh.gamma_s) / d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
      double acc = 0;
#pragma unroll 16
      for (int i = 0; i < d; ++i) {
        const double sij = sa[i * ai + j];
        acc += (words[code_words + (i >> 5)] >> (i & 31)) & 1u ? sij : -sij;
      }
      out[j] = __float2half_rn(static_cast<float>(fma(cc, acc, static_cast<double>(xm[j]))));
    }
  } else {
    for (int j = threadIdx.x; j < d; j += blockDim.x) out[j] = __float2half_rn(xm[j]);
  }
  const int code_bytes = (dp * mb + 7) / 8, sign_bytes = c.qjl ? (d + 7) / 8 : 0;
  for (int k = threadIdx.x; k < code_bytes; k += blockDim.x) codes[k] = byte_of(words, k);
  for (int k = threadIdx.x; k < sign_bytes; k += blockDim.x) codes[code_bytes + k] = byte_of(words + code_words, k);
  if (threadIdx.x == 0) {
    *norm_out = sh.norm_h;
    if (c.qjl) *gamma_out = sh.gamma_h;
  }
  __syncthreads();
}

// Block (side, KV head): side 0 the key row, 1 the value row, coded in place.
// staged_d > 0: the key codec's S (staged_d × staged_d) is staged in dynamic shared memory.
__global__ void codec_tail_kernel(CodecDev kc, CodecDev vc, __half* K, __half* V, int NKV, int D, int cap,
                                  const int32_t* counter, uint8_t* kcodes, uint8_t* vcodes, __half* scales,
                                  int staged_d) {
  __shared__ CodecShared sh;
  extern __shared__ float sS[];
  const int side = blockIdx.x / NKV, h = blockIdx.x % NKV;
  const CodecDev c = side ? vc : kc;
  const bool staged = staged_d > 0 && side == 0;
  // (before the wait: by the time this layer runs, the decode step's weights have streamed
  // through L2, and S read from memory a row at a time would cost a round trip each)
  load_codec(c, staged, sh, sS);
  pdl_wait();
  pdl_trigger();
  const int row = *counter - 1;
  if (row < 0 || row >= cap) return;
  const int64_t at = static_cast<int64_t>(h) * cap + row;
  __half* xr = (side ? V : K) + at * D;
  for (int j = threadIdx.x; j < c.dp; j += blockDim.x) sh.x[j] = j < c.d ? __half2float(xr[j]) : 0.0f;
  const int64_t plane = static_cast<int64_t>(NKV) * cap;
  code_row(c, staged, sS, sh, xr, (side ? vcodes : kcodes) + at * c.row_bytes, scales + (side ? 2 : 0) * plane + at,
           scales + plane + at);
}

// Blocks [0, B) code key rows, [B, 2B) value rows (B = gridDim.x / 2): row i of side s, at
// x + (s·N + i)·D, is read into shared memory and replaced by its dequantization.
__global__ void codec_rows_kernel(CodecDev kc, CodecDev vc, int N, int D, __half* x, uint8_t* kcodes, uint8_t* vcodes,
                                  __half* scales, int staged_d) {
  __shared__ CodecShared sh;
  extern __shared__ float sS[];
  const int B = gridDim.x / 2, side = blockIdx.x / B;
  const CodecDev c = side ? vc : kc;
  const bool staged = staged_d > 0 && side == 0;
  load_codec(c, staged, sh, sS);
  for (int i = blockIdx.x % B; i < N; i += B) {
    const int64_t r = static_cast<int64_t>(side) * N + i;
    __half* row = x + r * D;
    for (int j = threadIdx.x; j < c.dp; j += blockDim.x) sh.x[j] = j < c.d ? __half2float(row[j]) : 0.0f;
    code_row(c, staged, sS, sh, row, (side ? vcodes : kcodes) + static_cast<int64_t>(i) * c.row_bytes,
             scales + (side ? 2LL : 0LL) * N + i, scales + static_cast<int64_t>(N) + i);
  }
}

// The key codec's S staged in shared memory where it fits (d ≤ kCodecStagedD): its size d (0:
// read from memory), and `kernel` allowed the dynamic shared memory that takes (once a device).
template <class K>
int staging_for(const CodecDev& kc, K kernel, const char* name, size_t& smem) {
  const int d = kc.qjl && kc.d <= kCodecStagedD && kc.d % 4 == 0 ? kc.d : 0;
  smem = d ? static_cast<size_t>(d) * (d + 1) * 4 : 0;
  if (!d) return 0;
  static std::mutex mu;
  static std::set<int> ready;
  int dev = 0;
  KV_CUDA(cudaGetDevice(&dev), std::string(name) + ": the current device");
  const std::lock_guard<std::mutex> lock(mu);
  if (!ready.count(dev)) {
    KV_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kCodecStagedBytes),
            std::string(name) + ": shared memory for S");
    ready.insert(dev);
  }
  return d;
}

void check_codecs(const CodecDev& kc, const CodecDev& vc, int D, const char* what) {
  for (const CodecDev* c : {&kc, &vc})
    if (c->d != D || c->dp < D || c->dp > kMaxCodecDp || (c->dp & (c->dp - 1)) || c->mse_bits < 0 || c->mse_bits > 8 ||
        (c->mse_bits == 0 && !c->qjl) || (c == &vc && c->qjl))
      throw InternalError(std::string(what) + ": a codec of " + std::to_string(c->d) + " values padded to " +
                          std::to_string(c->dp) + ", " + std::to_string(c->mse_bits) + " code bits" +
                          (c->qjl ? " and a sign sketch" : "") + " for head size " + std::to_string(D) +
                          " (the head size, a power of two up to " + std::to_string(kMaxCodecDp) +
                          ", 0 to 8 bits; a sketch on the keys alone)");
}

}  // namespace

void codec_tail_rows(const CodecDev& kc, const CodecDev& vc, __half* k, __half* v, int NKV, int D, int cap,
                     const int32_t* counter, uint8_t* kcodes, uint8_t* vcodes, __half* scales, cudaStream_t s) {
  check_codecs(kc, vc, D, "codec_tail_rows");
  if (NKV == 0) return;
  size_t smem = 0;
  const int staged_d = staging_for(kc, codec_tail_kernel, "codec_tail_kernel", smem);
  KV_CUDA(launch_dependent(codec_tail_kernel, 2 * NKV, kCodecThreads, smem, s, true, kc, vc, k, v, NKV, D, cap, counter,
                           kcodes, vcodes, scales, staged_d),
          "codec_tail_kernel for " + std::to_string(NKV) + " KV heads");
}

// The blocks of codec_rows_kernel the current device holds at once with `smem` bytes of dynamic
// shared memory (found once a device and size).
int codec_rows_resident(size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<int, size_t>, int> known;
  int dev = 0;
  KV_CUDA(cudaGetDevice(&dev), "codec_rows: the current device");
  const std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find({dev, smem});
  if (it != known.end()) return it->second;
  int sms = 0, per_sm = 0;
  KV_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "codec_rows: the device's SMs");
  KV_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, codec_rows_kernel, kCodecThreads, smem),
          "codec_rows: blocks an SM holds");
  return known[{dev, smem}] = std::max(1, per_sm * sms);
}

void codec_rows(const CodecDev& kc, const CodecDev& vc, int N, int D, __half* x, uint8_t* kcodes, uint8_t* vcodes,
                __half* scales, cudaStream_t s) {
  check_codecs(kc, vc, D, "codec_rows");
  if (N == 0) return;
  size_t smem = 0;
  const int staged_d = staging_for(kc, codec_rows_kernel, "codec_rows_kernel", smem);
  // A row's coding is a chain of short dependent steps (a serial norm, the butterflies' barriers):
  // as many blocks a side as the device holds at once, so that rows overlap.
  const int B = std::max(1, std::min(N, codec_rows_resident(smem) / 2));
  codec_rows_kernel<<<2 * B, kCodecThreads, smem, s>>>(kc, vc, N, D, x, kcodes, vcodes, scales, staged_d);
  KV_LAUNCH("codec_rows_kernel", std::to_string(N) + " rows a side");
}

}  // namespace kvlens::cuda
