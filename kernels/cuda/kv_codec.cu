// Rows coded by a row codebook on the device: a decode row where it is appended
// (codec_tail_rows, kernels.h) and a prompt's rows in place (codec_rows): TurboQuant's rotation,
// Lloyd-Max codes and QJL residual sketch, with the host coder's operations in its order so that
// the codes, scales and dequantized rows are the host's.
#include <cuda_fp16.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "core/errors.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/quant_math.cuh"

namespace kvlens::cuda {

namespace {

constexpr int kCodecThreads = 128;
constexpr int kCodecWords = kMaxCodecDp * 8 / 32 + kMaxCodecDp / 32;  // codes of up to 8 bits, then sign bits
constexpr int kCodecStagedD = 128;  // the largest d whose S is staged in shared memory
constexpr int kCodecStagedBytes = kCodecStagedD * (kCodecStagedD + 1) * 4;
// The prompt's rows a codec_rows_kernel block codes together: S is read (and widened to double)
// once a group, and the serial steps of a row (its two norms, the butterflies' barriers) are
// taken by the group's rows side by side.
constexpr int kGroupRows = 8;
// A group's rows in dynamic shared memory after S: a value each of v (double), x, y and xm (float).
constexpr int kGroupValueBytes = 8 + 3 * 4;
constexpr int kCodecRowsMaxBytes = kCodecStagedBytes + kGroupRows * kMaxCodecDp * kGroupValueBytes;
static_assert(kGroupRows % 2 == 0 && kGroupRows <= kCodecThreads, "rows of a group: an even count, a thread each");

// hadamard_blocks' butterflies (quant_math.cuh) for the kGroupRows rows of x (n values each,
// back to back): every row's pairs of a span in one barrier-separated step. Without the scale:
// the caller multiplies each value by 1/√n in its next elementwise step.
__device__ void hadamard_group(float* x, int n) {
  const int half = n >> 1, lh = 30 - __clz(n);  // log2(n / 2)
  for (int len = 1, l = 0; len < n; len <<= 1, ++l) {
    for (int p = threadIdx.x; p < kGroupRows * half; p += blockDim.x) {
      const int q = p & (half - 1);
      float* xr = x + (p >> lh) * n + ((q >> l) << (l + 1)) + (q & (len - 1));
      const float a = xr[0], b = xr[len];
      xr[0] = a + b;
      xr[len] = a - b;
    }
    __syncthreads();
  }
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

// ‖x[0, d)‖ as the host's coder takes it (fused double sums in index order), rounded to fp16.
__device__ __half half_norm(const float* x, int d) {
  double s = 0;
#pragma unroll 16
  for (int j = 0; j < d; ++j) s = fma(static_cast<double>(x[j]), static_cast<double>(x[j]), s);
  return __float2half_rn(static_cast<float>(sqrt(s)));
}

// Thread 0: half_norm of x into *h and as a float into *f (read after the block's next barrier).
__device__ void norm_of(const float* x, int d, __half* h, float* f) {
  if (threadIdx.x != 0) return;
  *h = half_norm(x, d);
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

// A codec's signs and levels into sg and lv (shared memory).
__device__ void load_tables(const CodecDev& c, float* sg, float* lv) {
  for (int j = threadIdx.x; j < c.dp; j += blockDim.x) sg[j] = c.signs[j];
  for (int j = threadIdx.x; c.mse_bits > 0 && j < (1 << c.mse_bits); j += blockDim.x) lv[j] = c.levels[j];
}

// The codec's S into sS (shared memory), rows d + 1 apart: S·r down a row and Sᵀ·sign down a
// column both read distinct banks. d a multiple of 4.
__device__ void stage_S(const CodecDev& c, float* sS) {
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

// The codec's tables into shared memory: its signs and levels, and with `staged` its S. No
// kernel writes them, so a dependent kernel loads them before its wait.
__device__ void load_codec(const CodecDev& c, bool staged, CodecShared& sh, float* sS) {
  load_tables(c, sh.sg, sh.lv);
  if (staged) stage_S(c, sS);
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
    hadamard_blocks(y, dp, dp);  // (a single block of dp; its first barrier follows these writes)
    __syncthreads();
    const float sq = sqrtf(static_cast<float>(dp));
    const float to_unit = norm > 0 ? sq / norm : 0.0f, from_unit = norm / sq;
    for (int j = threadIdx.x; j < dp; j += blockDim.x) {
      const uint32_t code = nearest_level(sh.lv, 1 << mb, y[j] * to_unit);
      xm[j] = sh.lv[code] * from_unit;
      put_code(words, j, mb, code);
    }
    hadamard_blocks(xm, dp, dp);
    __syncthreads();
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

// ---- the prompt: kGroupRows rows a block at once ------------------------------------------------

// A codec_rows_kernel block's static shared memory: both codecs' signs and levels ([0] keys,
// [1] values), and per row of the group its code words, ‖x‖ (fp16, and as to_unit / from_unit),
// ‖r‖ (fp16) and the factor √(π/2)·‖r‖/d.
struct GroupShared {
  float sg[2][kMaxCodecDp], lv[2][256];
  uint32_t words[kGroupRows][kCodecWords];
  double cc[kGroupRows];
  float to_unit[kGroupRows], from_unit[kGroupRows];
  __half norm_h[kGroupRows], gamma_h[kGroupRows];
};

// m[0] widened to double: read from global memory with kGlobal, else from shared memory.
template <bool kGlobal>
__device__ __forceinline__ double widen(const float* m) {
  if constexpr (kGlobal) return static_cast<double>(__ldg(m));
  else return static_cast<double>(*m);
}

// acc[r] = the fused double sum over k < d of m[k·ms]·w[r·wr + k], from 0.0 in ascending k, for
// each row r of the group: each m read and widened once for all the rows; a row's w for k and
// k + 1 in one 16-byte load, at the same address for every thread (a broadcast). w 16-byte
// aligned, wr even.
template <bool kGlobal>
__device__ __forceinline__ void dot_rows(const float* m, int ms, const double* w, int wr, int d,
                                         double (&acc)[kGroupRows]) {
#pragma unroll
  for (int r = 0; r < kGroupRows; ++r) acc[r] = 0.0;
  int k = 0;
#pragma unroll 2
  for (; k + 1 < d; k += 2) {
    const double m0 = widen<kGlobal>(m + k * ms), m1 = widen<kGlobal>(m + (k + 1) * ms);
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) {
      const double2 p = *reinterpret_cast<const double2*>(w + r * wr + k);
      acc[r] = fma(m0, p.x, acc[r]);
      acc[r] = fma(m1, p.y, acc[r]);
    }
  }
  if (k < d) {
    const double m0 = widen<kGlobal>(m + k * ms);
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) acc[r] = fma(m0, w[r * wr + k], acc[r]);
  }
}

// The sketch of the group's residuals (v: r[row][k] as doubles, rows dp apart) and the rows'
// dequantizations: sign(S·r) into the sign bits of the words (after code_words), then v replaced
// by the signs as ±1.0, and row r < n of out (D apart) = xm + cc·Sᵀ·sign rounded to fp16. S[i][j]
// is read at s_r + i·ri + j·rj (S·r) and at s_a + i·ai + j (Sᵀ·sign); in global memory with
// kGlobal, else in shared memory.
template <bool kGlobal>
__device__ void sketch_group(const float* s_r, int ri, int rj, const float* s_a, int ai, int d, int dp, int code_words,
                             GroupShared& sh, double* v, const float* xm, __half* out, int n, int D) {
  double acc[kGroupRows];
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    dot_rows<kGlobal>(s_r + i * ri, rj, v, dp, d, acc);
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r)
      if (acc[r] >= 0) atomicOr(&sh.words[r][code_words + (i >> 5)], 1u << (i & 31));
  }
  __syncthreads();
  const int lg = 31 - __clz(dp);
  for (int e = threadIdx.x; e < kGroupRows * dp; e += blockDim.x) {
    const int r = e >> lg, i = e & (dp - 1);
    // (acc + (bit ? s : −s) and fma(±1.0, s, acc) round the same exact sum)
    if (i < d) v[e] = (sh.words[r][code_words + (i >> 5)] >> (i & 31)) & 1u ? 1.0 : -1.0;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    dot_rows<kGlobal>(s_a + j, ai, v, dp, d, acc);
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r)
      if (r < n)
        out[static_cast<int64_t>(r) * D + j] =
            __float2half_rn(static_cast<float>(fma(sh.cc[r], acc[r], static_cast<double>(xm[r * dp + j]))));
  }
}

// Codes the n ≤ kGroupRows rows at rows[r·D] (fp16, in place) as code_row codes each of them
// (the same operations on each value and each double sum): their codes to codes[r·row_bytes],
// their ‖x‖ to norm_out[r] and with QJL ‖r‖ to gamma_out[r]. v, x, y, xm: kGroupRows·dp values
// each in shared memory (v 16-byte aligned); side picks the tables in sh. Every thread of the
// block calls it; shared memory may be written again when it returns.
__device__ void code_group(const CodecDev& c, int side, bool staged, const float* sS, GroupShared& sh, double* v,
                           float* x, float* y, float* xm, __half* rows, int n, int D, uint8_t* codes, __half* norm_out,
                           __half* gamma_out) {
  const int d = c.d, dp = c.dp, mb = c.mse_bits, t = threadIdx.x, nt = blockDim.x, lg = 31 - __clz(dp);
  const float* sg = sh.sg[side];
  const float* lv = sh.lv[side];
  const int code_words = (dp * mb + 31) / 32, sign_words = c.qjl ? (d + 31) / 32 : 0, nw = code_words + sign_words;
  // The rows (zeros past d, and for rows past n), their signed copies y, their words cleared.
  for (int e = t; e < kGroupRows * dp; e += nt) {
    const int r = e >> lg, j = e & (dp - 1);
    const float xv = r < n && j < d ? __half2float(rows[static_cast<int64_t>(r) * D + j]) : 0.0f;
    x[e] = xv;
    y[e] = j < d ? __fmul_rn(xv, sg[j]) : 0.0f;
  }
  for (int e = t; e < kGroupRows * nw; e += nt) sh.words[e / nw][e % nw] = 0;
  __syncthreads();
  // Row nr's norms by thread t (lanes 0, 1, … of the warps in turn: few rows a warp).
  const int nr = (t & 31) * (kCodecThreads / 32) + (t >> 5);
  if (nr < kGroupRows) {
    const __half h = half_norm(x + nr * dp, d);
    const float norm = __half2float(h), sq = sqrtf(static_cast<float>(dp));
    sh.norm_h[nr] = h;
    sh.to_unit[nr] = norm > 0 ? sq / norm : 0.0f;
    sh.from_unit[nr] = norm / sq;
  }
  __syncthreads();
  // (the scale 1/√dp of both transforms; the products below are kept apart from any sum)
  const float s = 1.0f / sqrtf(static_cast<float>(dp));
  if (mb > 0) {
    hadamard_group(y, dp);
    for (int e = t; e < kGroupRows * dp; e += nt) {
      const int r = e >> lg, j = e & (dp - 1);
      const uint32_t code = nearest_level(lv, 1 << mb, __fmul_rn(__fmul_rn(y[e], s), sh.to_unit[r]));
      xm[e] = __fmul_rn(lv[code], sh.from_unit[r]);
      put_code(sh.words[r], j, mb, code);
    }
    __syncthreads();
    hadamard_group(xm, dp);
  }
  // x_mse; then with QJL the residual r (in y, and as doubles in v), else the row out.
  for (int e = t; e < kGroupRows * dp; e += nt) {
    const int r = e >> lg, j = e & (dp - 1);
    if (j >= d) continue;
    const float m = mb > 0 ? __fmul_rn(__fmul_rn(xm[e], s), sg[j]) : 0.0f;
    xm[e] = m;
    if (c.qjl) {
      const float q = __fsub_rn(x[e], m);
      y[e] = q;
      v[e] = static_cast<double>(q);
    } else if (r < n) {
      rows[static_cast<int64_t>(r) * D + j] = __float2half_rn(m);
    }
  }
  if (c.qjl) {
    __syncthreads();
    if (nr < kGroupRows) {
      const __half h = half_norm(y + nr * dp, d);
      sh.gamma_h[nr] = h;
      sh.cc[nr] = sqrt(M_PI / 2.0) * static_cast<double>(__half2float(h)) / d;
    }
    if (staged) sketch_group<false>(sS, d + 1, 1, sS, d + 1, d, dp, code_words, sh, v, xm, rows, n, D);
    else sketch_group<true>(c.St, 1, d, c.S, d, d, dp, code_words, sh, v, xm, rows, n, D);
  }
  __syncthreads();
  const int code_bytes = (dp * mb + 7) / 8, sign_bytes = c.qjl ? (d + 7) / 8 : 0, nb = code_bytes + sign_bytes;
  for (int k = t; k < n * nb; k += nt) {
    const int r = k / nb, b = k - r * nb;
    codes[static_cast<int64_t>(r) * c.row_bytes + b] =
        b < code_bytes ? byte_of(sh.words[r], b) : byte_of(sh.words[r] + code_words, b - code_bytes);
  }
  if (t < n) {
    norm_out[t] = sh.norm_h[t];
    if (c.qjl) gamma_out[t] = sh.gamma_h[t];
  }
  __syncthreads();
}

// The dynamic shared memory of codec_rows_kernel: S (staged_d × staged_d, rows staged_d + 1
// apart; none for 0), then a group's rows of up to dp values.
size_t rows_shared_bytes(int staged_d, int dp) {
  return static_cast<size_t>(staged_d) * (staged_d + 1) * 4 + static_cast<size_t>(kGroupRows) * dp * kGroupValueBytes;
}

// Groups of kGroupRows rows: groups [0, G) keys, [G, 2G) values (G = ⌈N / kGroupRows⌉), block b
// taking groups b, b + gridDim.x, … (so each block takes a share of the costly key groups). Row i
// of side s, at x + (s·N + i)·D, is replaced by its dequantization. staged_d > 0: the key
// codec's S is staged in dynamic shared memory.
__global__ void __launch_bounds__(kCodecThreads)
    codec_rows_kernel(CodecDev kc, CodecDev vc, int N, int D, __half* x, uint8_t* kcodes, uint8_t* vcodes,
                      __half* scales, int staged_d) {
  __shared__ GroupShared sh;
  extern __shared__ __align__(16) unsigned char group_smem[];
  float* sS = reinterpret_cast<float*>(group_smem);
  const int dp = kc.dp > vc.dp ? kc.dp : vc.dp;
  auto* v = reinterpret_cast<double*>(group_smem + static_cast<size_t>(staged_d) * (staged_d + 1) * 4);
  float* xs = reinterpret_cast<float*>(v + kGroupRows * dp);
  float* ys = xs + kGroupRows * dp;
  float* xms = ys + kGroupRows * dp;
  load_tables(kc, sh.sg[0], sh.lv[0]);
  load_tables(vc, sh.sg[1], sh.lv[1]);
  if (staged_d > 0) stage_S(kc, sS);
  __syncthreads();
  const int G = (N + kGroupRows - 1) / kGroupRows;
  for (int g = blockIdx.x; g < 2 * G; g += gridDim.x) {
    const int side = g >= G, first = (g - side * G) * kGroupRows;
    const CodecDev c = side ? vc : kc;
    code_group(c, side, side == 0 && staged_d > 0, sS, sh, v, xs, ys, xms,
               x + (static_cast<int64_t>(side) * N + first) * D, min(kGroupRows, N - first), D,
               (side ? vcodes : kcodes) + static_cast<int64_t>(first) * c.row_bytes,
               scales + (side ? 2LL * N : 0LL) + first, scales + static_cast<int64_t>(N) + first);
  }
}

// The key codec's S staged in shared memory where it fits (d ≤ kCodecStagedD, a multiple of 4):
// its size d, else 0 (read from memory).
int staged_size(const CodecDev& kc) { return kc.qjl && kc.d <= kCodecStagedD && kc.d % 4 == 0 ? kc.d : 0; }

// `kernel` allowed `bytes` of dynamic shared memory (once a device and kernel).
void allow_shared(const void* kernel, int bytes, const char* name) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> ready;
  int dev = 0;
  KV_CUDA(cudaGetDevice(&dev), std::string(name) + ": the current device");
  const std::lock_guard<std::mutex> lock(mu);
  if (ready.count({dev, kernel})) return;
  KV_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
          std::string(name) + ": its dynamic shared memory");
  ready.insert({dev, kernel});
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
  const int staged_d = staged_size(kc);
  const size_t smem = static_cast<size_t>(staged_d) * (staged_d + 1) * 4;
  if (staged_d) allow_shared(reinterpret_cast<const void*>(codec_tail_kernel), kCodecStagedBytes, "codec_tail_kernel");
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
  const int staged_d = staged_size(kc);
  const size_t smem = rows_shared_bytes(staged_d, std::max(kc.dp, vc.dp));
  allow_shared(reinterpret_cast<const void*>(codec_rows_kernel), kCodecRowsMaxBytes, "codec_rows_kernel");
  // A group's coding is still a chain of short dependent steps (the serial norms, the
  // butterflies' barriers): as many blocks as the device holds at once, so that groups overlap,
  // each taking key and value groups alike.
  const int64_t groups = 2 * ((static_cast<int64_t>(N) + kGroupRows - 1) / kGroupRows);
  const int B = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(groups, codec_rows_resident(smem))));
  codec_rows_kernel<<<B, kCodecThreads, smem, s>>>(kc, vc, N, D, x, kcodes, vcodes, scales, staged_d);
  KV_LAUNCH("codec_rows_kernel", std::to_string(N) + " rows a side");
}

}  // namespace kvlens::cuda
