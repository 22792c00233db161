// Decode attention over a segmented KV cache: fp16 parts and packed parts (1–8-bit codes with
// channel-wise or token-wise ranges) read in one pass with one online softmax. CPU twins: the
// CPU backend's decode attention (kernels/cpu/backend_cpu.cpp) on the dequantized rows, and
// calibquant::post_scaled_scores / post_scaled_values / calibrate_visual.
//
// Grid: (split, query head, sequence); decode_splits gives one wave, or waves whose last is 90 % full.
// Each block takes a contiguous range of the head's rows (all parts concatenated in order).
// Threads work in groups of L lanes, one row per group and 8 channels per lane (L = the next
// power of two ≥ D/8): a lane reads its 8 channels of K (16 bytes of fp16, or `bits` bytes of
// codes), the group reduces the dot product with shuffles, and each lane updates its 8 output
// channels. Rows are taken 4 at a time per group so that several loads are in flight. The block
// then combines its groups and writes the partial state (max m, sum d, unnormalized output o);
// the last block of a head to finish merges the splits (their weights exp(m_i − M) computed in
// parallel into shared memory).
//
// Head size 128, packed channel-wise parts (1/2/4/8-bit, one range per channel or one for all,
// over the whole part): tensor cores instead, a warp per tile of rows — 1 and 2 bits with
// integer operands (decode_i8.cuh), 4 and 8 bits with fp16 ones (decode_mma.cuh). Their state
// joins the groups' online softmax at the end of the part, so fp16 and packed parts still share
// one softmax. Codes are read as core/compress/quantize.h packs them (row j at byte
// j·D·b/8, code c at bits [c·b, (c+1)·b) least significant first), except 1-bit values stored
// channel-major by groups of 32 rows (kChannelT), whose whole groups take the binary tensor-core
// path — see decode_b1.cuh.
//
// Packed parts never produce dequantized rows in memory. Channel-wise parts with one range per
// channel over the part use CalibQuant's post-scaling: q⊙scale is folded into q once per part and
// q·zero is added to each score; for values Σ_j p_j·code_j is accumulated and scale_c·Σ + zero_c·Σp
// is added once per part. Token-wise parts scale each row's dot product by its own scale and add
// zero·Σq; values accumulate (p·scale_j)·code + p·zero_j and are multiplied by the CST factor
// once per part. Channel-wise parts with several range groups (KIVI keys) dequantize in registers.
//
// Calibration (CalibQuant g(x) on visual scores): γ and δ are the min and max of a head's visual
// scores over all its rows, which a split alone cannot know. A first pass (calibrate = 1) runs
// the same kernel computing only the visual scores' min and max per split; the attention pass
// reduces those over the splits in its prologue and applies g to every visual score before the
// softmax. The visual keys are thus read twice (their K codes, not V) — except on the binary and
// integer paths (1- and 2-bit codes) with DecodeParams::vis_scores, where the first pass writes
// each visual row's score (4 bytes against the key's 16 or 32) and the second reads it instead
// of the keys.
// Where a head has one split, its block's own range is the head's: both passes run in one
// kernel (kRangeAttend), the block ranging its rows and then attending them.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <type_traits>

#include "kernels/cuda/softmax_state.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/quant_math.cuh"

namespace kvlens::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kMinBlocks = kDecodeMinBlocks;  // blocks resident per multiprocessor (the register budget follows)
constexpr int kMmaMinBlocks = kDecodeMmaMinBlocks;  // the tensor-core-only kernel without the binary path
constexpr int kB1MinBlocks = kDecodeB1PairMinBlocks;  // and with it in pairs (two 128-row sub-tiles a warp)
constexpr int kUnroll = 4;
constexpr int kSharedParts = 16;  // a head's part descriptors staged in shared memory (more: read from L2)
// decode_b1.cuh: 4 KiB stages a warp (tiles in flight + 1). Three and four stages (48 and 64 KiB a
// block) were measured slower on an H100 at every shape but batch 16 / 16k: the loop is bound by
// its own latency at 12 warps a multiprocessor, not by the copies in flight.
constexpr int kB1Stages = 2;
constexpr int kB1StageBytes = (kThreads / 32) * kB1Stages * 4096;
// decode_i8.cuh: 2 KiB stages a warp (32 rows of 2-bit keys and values; tiles in flight + 1).
// Three were 0.3–7 % faster than four at every shape on an H100. A block's bytes, in kernels of
// head size 128 without the binary path; with it, the integer path takes the same per-warp
// regions as the binary path (run_mma).
constexpr int kI8Stages = 3;
constexpr int kI8StageBytes = (kThreads / 32) * kI8Stages * 2048;
static_assert(sizeof(PartDesc) % 8 == 0, "descriptors are staged in 8-byte words");

// kRangeAttend: a head of one split (DecodeParams::splits = 1) takes both calibrated passes in
// one kernel, its visual range its own.
enum Mode { kAttend = 0, kRange = 1, kScores = 2, kRangeAttend = 3 };

__device__ __forceinline__ int part_rows(const PartDesc& p) { return p.n + (p.counter ? *p.counter : 0); }

__device__ __forceinline__ float code_f(uint32_t c) {
  // c < 2^23: exact, without the slower integer-to-float conversion.
  return __int_as_float(0x4b000000u | c) - 8388608.0f;
}

template <int L>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Lane {
  int D, c0;
  bool active;
};

// Online-softmax state of one group (per lane: its 8 channels).
using State = SoftmaxState<8>;

__device__ __forceinline__ float exp_fast(float x) { return __expf(x); }

// Moves st to a new running maximum mx, given alpha = exp(st.m − mx): its sum and output, and a
// part's own accumulators (acc[8] and psum) when given, are scaled by alpha.
__device__ __forceinline__ void rescale(State& st, float mx, float alpha, float* acc = nullptr,
                                        float* psum = nullptr) {
  st.rescale(mx, alpha, acc, psum);
}

// Joins a part's softmax state — its maximum mw, sum psum and this lane's 8 unnormalized outputs
// o — into st_io (the tensor-core paths' lanes 0..15; mw = −inf: nothing to join).
__device__ __forceinline__ void join_part(State& st_io, float mw, float psum, const float (&o)[8]) {
  State st = st_io;
  st.merge(mw, psum, o, exp_fast);
  st_io = st;
}

#include "kernels/cuda/decode/decode_general.cuh"

// ---- fast paths: one storage per side known at compile time, every row's loads issued before
// any of them is used, exp through the special-function unit. --------------------------------

template <int BITS>
__device__ __forceinline__ uint64_t load_bits(const uint8_t* p) {
  if constexpr (BITS == 1) return __ldg(p);
  else if constexpr (BITS == 2) return __ldg(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (BITS == 4) return __ldg(reinterpret_cast<const uint32_t*>(p));
  else return __ldg(reinterpret_cast<const unsigned long long*>(p));
}

__device__ __forceinline__ float calibrated(float s, bool cal, float t, float gam, float tau1) {
  return cal && isfinite(s) ? (t == 0.0f ? gam - tau1 : t * (s - gam) + gam - tau1) : s;
}

// The tensor-core paths' per-tile score steps over a lane's N scores (a register array, passed
// flattened): the range pass widens [lo, hi) by the valid ones; the attention pass calibrates
// them in place and returns their maximum with mw (before the warp's reduction).
template <int N>
__device__ __forceinline__ void widen_range(const float* s, float& lo, float& hi) {
#pragma unroll
  for (int x = 0; x < N; ++x)
    if (s[x] != -INFINITY) {
      lo = fminf(lo, s[x]);
      hi = fmaxf(hi, s[x]);
    }
}
template <int N>
__device__ __forceinline__ float calibrated_max(float* s, float mw, bool cal, float t, float gam, float tau1) {
#pragma unroll
  for (int x = 0; x < N; ++x) {
    s[x] = calibrated(s[x], cal, t, gam, tau1);
    mw = fmaxf(mw, s[x]);
  }
  return mw;
}

}  // namespace
}  // namespace kvlens::cuda
#include "kernels/cuda/decode/decode_mma.cuh"
#include "kernels/cuda/decode/decode_i8.cuh"
#include "kernels/cuda/decode/decode_b1.cuh"
namespace kvlens::cuda {
namespace {

// The online-softmax step of U scores (a row past the end: −inf): the running maximum moved (st
// rescaled), then each row's weight p added to the sum and handed to add(u, p) for its values.
template <int U, class Add>
__device__ __forceinline__ void softmax_step(const float (&sc)[U], State& st, Add add) {
  float mx = st.m;
#pragma unroll
  for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u]);
  if (mx > st.m) rescale(st, mx, __expf(st.m - mx));
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float p = sc[u] == -INFINITY ? 0.0f : __expf(sc[u] - st.m);
    st.d += p;
    add(u, p);
  }
}

// The scores, online-softmax update and P·V of U fp16 rows already loaded (this lane's 8
// channels of K in kr, of V in vr): rows j, j + G, … of which those below `end` count; g(x)
// applied to the scores when cal. Shared by the general kernel and the fp16 kernel.
template <int L, int U>
__device__ __forceinline__ void f16_update(const uint4 (&kr)[U], const uint4 (&vr)[U], const float* q, int j, int G,
                                           int end, bool cal, float cal_t, float cal_g, float tau1, State& st) {
  float sc[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float f[8];
    unpack8<__half>(kr[u], f);
    float d = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) d = fmaf(q[c], f[c], d);
    d = group_sum<L>(d);
    sc[u] = j + u * G < end ? calibrated(d, cal, cal_t, cal_g, tau1) : -INFINITY;
  }
  softmax_step<U>(sc, st, [&](int u, float p) {
    float f[8];
    unpack8<__half>(vr[u], f);
#pragma unroll
    for (int c = 0; c < 8; ++c) st.o[c] = fmaf(p, f[c], st.o[c]);
  });
}

// fp16 keys and values.
template <int L, int U>
__device__ void fp16_rows(const PartDesc& P, int a, int e, const float* q, const Lane& ln, int g, bool cal, float cal_t,
                          float cal_g, float tau1, State& st) {
  constexpr int G = kThreads / L;
  const __half* K = static_cast<const __half*>(P.k.data);
  const __half* V = static_cast<const __half*>(P.v.data);
  for (int j0 = a; j0 < e; j0 += G * U) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * G + g;
      if (j < e && ln.active) {
        kr[u] = __ldg(reinterpret_cast<const uint4*>(K + static_cast<int64_t>(j) * ln.D + ln.c0));
        vr[u] = __ldg(reinterpret_cast<const uint4*>(V + static_cast<int64_t>(j) * ln.D + ln.c0));
      } else {
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
    f16_update<L, U>(kr, vr, q, j0 + g, G, e, cal, cal_t, cal_g, tau1, st);
  }
}

#include "kernels/cuda/decode/decode_token.cuh"
#include "kernels/cuda/decode/decode_lut.cuh"

// Which fast path a part can take (0: the general one): 16 fp16 rows; 1, 2, 4, 8 channel-wise
// codes of that width; kTokenKind + 2, 4, 8 token-wise codes of that width; kChannelTokenKind +
// 2, 4, 8 channel-wise keys (any groups) beside token-wise values of that width, + kWithFactor
// with the values' CST factors.
constexpr int kTokenKind = 100, kChannelTokenKind = 200, kWithFactor = 10;
__device__ __forceinline__ int fast_kind(const PartDesc& P, int n, int mode, bool materialized, int lut_bits) {
  if (materialized || mode == kScores) return 0;
  if (P.k.fmt == kF16 && P.v.fmt == kF16) return mode == kAttend ? 16 : 0;
  if (P.k.fmt == kChannel && P.v.fmt == kToken && P.k.chan_stride == 1) {
    const int b = P.k.bits;
    if (mode != kAttend || P.v.bits != b || (b != 2 && b != 4 && b != 8)) return 0;
    if ((reinterpret_cast<uintptr_t>(P.k.data) | reinterpret_cast<uintptr_t>(P.v.data)) & (b - 1)) return 0;
    if ((reinterpret_cast<uintptr_t>(P.k.scale) | reinterpret_cast<uintptr_t>(P.k.zero) |
         reinterpret_cast<uintptr_t>(P.v.factor)) & 15)
      return 0;
    if (P.v.factor && P.v.group > 0 && P.v.group < n) return 0;  // (factors a group of rows: the general path)
    return kChannelTokenKind + b + (P.v.factor ? kWithFactor : 0);
  }
  if (P.k.fmt == kToken && P.v.fmt == kToken) {
    const int b = P.k.bits;
    if (mode != kAttend || P.v.bits != b || P.k.factor || P.v.factor || (b != 2 && b != 4 && b != 8)) return 0;
    if ((reinterpret_cast<uintptr_t>(P.k.data) | reinterpret_cast<uintptr_t>(P.v.data)) & (b - 1)) return 0;
    return kTokenKind + b;
  }
  const bool whole = (P.k.group <= 0 || P.k.group >= n) && (P.v.group <= 0 || P.v.group >= n);
  if (P.k.fmt != kChannel || P.v.fmt != kChannel || !whole || P.k.bits != P.v.bits) return 0;
  const int b = P.k.bits;
  if (b != 1 && b != 2 && b != 4 && b != 8) return 0;
  if ((reinterpret_cast<uintptr_t>(P.k.data) | reinterpret_cast<uintptr_t>(P.v.data)) & (b - 1)) return 0;
  if (b <= 4 && b > lut_bits) return 0;  // no room for its table
  return b;
}

// Head size 128: the tensor-core paths (mma_bits, kernels.h), except for materialized scores.
__device__ __forceinline__ int mma_kind(const PartDesc& P, int n, int mode, bool materialized, bool staged) {
  return materialized || mode == kScores ? 0 : mma_bits(P, n, staged);
}

// A part of row-major codes: 1 and 2 bits on the integer tensor-core path (decode_i8.cuh), 4 and
// 8 bits on the fp16-operand one (decode_mma.cuh; 16 rows a tile).
// vsc: the part's kept scores (run_mma), on the integer path.
template <int BITS>
__device__ __forceinline__ void row_major_part(const PartDesc& P, int a, int e, const float* qs, int w, int nw, bool r,
                                               bool cal, float cal_t, float cal_g, float tau1, State& st, float& lo,
                                               float& hi, uint4* wbuf, float* vsc) {
  using namespace mma_path;
  if constexpr (BITS <= 2) {
    if (r) i8_path::packed_i8<BITS, true>(P, a, e, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi, wbuf, vsc);
    else if (vsc && cal)
      i8_path::packed_i8<BITS, false, true>(P, a, e, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi, wbuf, vsc);
    else i8_path::packed_i8<BITS, false>(P, a, e, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi, wbuf, nullptr);
  } else {
    if (r) packed_mma<BITS, 1, true>(P, a, e, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi);
    else packed_mma<BITS, 1, false>(P, a, e, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi);
  }
}

// PAIR: 128-row sub-tiles an iteration of the binary path (2 in the kernel of two blocks a
// multiprocessor).
// stage: the block's stages (kB1StageBytes, twice that in pairs, when b1; else kI8StageBytes).
// vsc: the part's visual scores (DecodeParams::vis_scores at its first row) for the binary and
// integer paths, written by the range pass and read by the attention pass; null: neither. HAS_B1:
// the kernel may take the binary path (DecodeParams::b1; without it no part is kChannelT here).
template <int PAIR, bool HAS_B1>
__device__ void run_mma(int bits, const PartDesc& P, int a, int e, const float* qs, int mode, bool cal, float cal_t,
                        float cal_g, float tau1, State& st, float& lo, float& hi, uint4* stage, bool b1, float* vsc) {
  const int w = threadIdx.x / 32, nw = kThreads / 32;
  const bool r = mode == kRange;
  // The integer path's stages for this warp: in a kernel with the binary path, that path's region
  // of the warp (kB1Stages, keys only in the range pass), so that no warp's copies land in
  // another's; else the integer path's own.
  static_assert(i8_path::kI8WarpChunks <= kB1Stages * 256, "the integer path's stages fit a warp's region");
  uint4* const wbuf = stage + w * (b1 ? kB1Stages * (r ? 128 : 256) * PAIR : i8_path::kI8WarpChunks);
  // The paired kernel's integer path keeps no scores: its instantiations made the binary path
  // 1–3 % slower (H100), for rows past a part's last group of 32 or 2-bit parts beside 1-bit ones.
  float* const vsc_i8 = PAIR == 2 ? nullptr : vsc;
  switch (bits) {
    case 1: {
      int e1 = a;  // rows [a, e1) in whole channel-major groups: the binary path
      if (HAS_B1 && P.v.fmt == kChannelT) {
        e1 = min(e, P.n & ~31);
        if (a < e1) {
          if (r) b1_path::packed_b1<true, PAIR>(P, a, e1, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi, stage, vsc);
          else if (vsc && cal)
            b1_path::packed_b1<false, PAIR, true>(P, a, e1, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi, stage, vsc);
          else
            b1_path::packed_b1<false, PAIR>(P, a, e1, qs, w, nw, cal, cal_t, cal_g, tau1, st, lo, hi, stage, nullptr);
        }
      }
      const int a1 = max(a, e1);  // the rest row-major
      if (a1 < e) row_major_part<1>(P, a1, e, qs, w, nw, r, cal, cal_t, cal_g, tau1, st, lo, hi, wbuf, vsc_i8);
      break;
    }
    case 2: row_major_part<2>(P, a, e, qs, w, nw, r, cal, cal_t, cal_g, tau1, st, lo, hi, wbuf, vsc_i8); break;
    case 4: row_major_part<4>(P, a, e, qs, w, nw, r, cal, cal_t, cal_g, tau1, st, lo, hi, wbuf, nullptr); break;
    default: row_major_part<8>(P, a, e, qs, w, nw, r, cal, cal_t, cal_g, tau1, st, lo, hi, wbuf, nullptr); break;
  }
}

template <int L>
__device__ void run_fast(int kind, const PartDesc& P, int a, int e, const float* q, const Lane& ln, int g, int mode,
                         bool cal, float cal_t, float cal_g, float tau1, State& st, float& lo, float& hi, float* lut) {
  const bool range = mode == kRange;
  switch (kind) {
    case 16: fp16_rows<L, 4>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st); break;
    case kTokenKind + 2: token_rows<L, 2, 4>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st); break;
    case kTokenKind + 4: token_rows<L, 4, 4>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st); break;
    case kTokenKind + 8: token_rows<L, 8, 4>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st); break;
    case kChannelTokenKind + 2: channel_token_rows<L, 2, 4, false>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st); break;
    case kChannelTokenKind + 4: channel_token_rows<L, 4, 4, false>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st); break;
    case kChannelTokenKind + 8: channel_token_rows<L, 8, 4, false>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st); break;
    case kChannelTokenKind + kWithFactor + 2:
      channel_token_rows<L, 2, 4, true>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st);
      break;
    case kChannelTokenKind + kWithFactor + 4:
      channel_token_rows<L, 4, 4, true>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st);
      break;
    case kChannelTokenKind + kWithFactor + 8:
      channel_token_rows<L, 8, 4, true>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st);
      break;
    case 1:
      if (range) packed_rows<L, 1, 16, true>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      else packed_rows<L, 1, 16, false>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      break;
    case 2:
      if (range) packed_rows<L, 2, 16, true>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      else packed_rows<L, 2, 16, false>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      break;
    case 4:
      if (range) packed_rows<L, 4, 8, true>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      else packed_rows<L, 4, 8, false>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      break;
    default:
      if (range) packed_rows<L, 8, 4, true>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      else packed_rows<L, 8, 4, false>(P, a, e, q, ln, g, cal, cal_t, cal_g, tau1, st, lo, hi, lut);
      break;
  }
}

#include "kernels/cuda/decode/decode_merge.cuh"

#include "kernels/cuda/decode/decode_f16.cuh"
#include "kernels/cuda/decode/decode_qtok.cuh"
#include "kernels/cuda/decode/decode_bulk.cuh"
#include "kernels/cuda/decode/decode_gqa.cuh"

// The range pass's end: the block's visual min and max (lo negated) into its split's
// DecodeParams::vis_range entry.
__device__ __forceinline__ void block_range(const DecodeParams& p, float lo, float hi, int64_t bh, int s, int tid) {
  lo = -lo;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = fmaxf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  __shared__ float rlo[kThreads / 32], rhi[kThreads / 32];
  if ((tid & 31) == 0) {
    rlo[tid >> 5] = lo;
    rhi[tid >> 5] = hi;
  }
  __syncthreads();
  if (tid == 0) {
    float a = -INFINITY, c = -INFINITY;
    for (int w = 0; w < kThreads / 32; ++w) {
      a = fmaxf(a, rlo[w]);
      c = fmaxf(c, rhi[w]);
    }
    p.vis_range[(bh * p.splits + s) * 2] = -a;
    p.vis_range[(bh * p.splits + s) * 2 + 1] = c;
  }
}

// MMA_ONLY: a cache of head size 128 whose parts are all fp16 or tensor-core packed parts
// (DecodeParams::all_mma); only those two paths are compiled in, under a budget of 128 registers
// (4 blocks a multiprocessor instead of 3).
// MMA = 2: the same for caches with channel-major 1-bit values (DecodeParams::b1), whose binary
// path needs more registers: 168, 3 blocks a multiprocessor. MMA = 3: the same with two 128-row
// sub-tiles an iteration of the binary path (DecodeParams::b1_pair): 238 registers, 2 blocks a
// multiprocessor, twice the stages.
// BOTH: mode kRangeAttend (its own instances, so that the others keep their registers).
template <int L, int MMA, bool BOTH = false>
__global__ void __launch_bounds__(kThreads, MMA == 1 ? kMmaMinBlocks : MMA == 3 ? kB1MinBlocks : kMinBlocks)
    decode_kernel(DecodeParams p, int mode) {
  constexpr bool MMA_ONLY = MMA != 0;
  // Packed keys' tables (lut_bytes(D, lut_bits)), or at head size 128 the binary and integer
  // paths' stages (kB1StageBytes when p.b1, twice that in pairs; else kI8StageBytes).
  extern __shared__ __align__(16) float lut[];
  uint4* const stage = reinterpret_cast<uint4*>(lut);
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int kvh = h / (p.NH / p.NKV);
  const int tid = threadIdx.x, g = tid / L, li = tid % L;
  Lane ln{p.D, li * 8, li * 8 < p.D};
  // The head's part descriptors do not change within a step (kv_sync writes them between
  // steps), so they are read before waiting for the previous kernel and kept in shared memory:
  // every later read of a descriptor field is a shared-memory read, not a dependent trip to L2.
  __shared__ __align__(16) PartDesc sh_parts[kSharedParts];
  __shared__ int sh_rows[kSharedParts];
  const PartDesc* gparts = p.parts + (static_cast<int64_t>(b) * p.NKV + kvh) * p.max_parts;
  const bool staged = p.max_parts <= kSharedParts;
  // The descriptors are loaded into registers and stored after the query's loads are issued, so
  // that the two trips to memory overlap.
  constexpr int W = sizeof(PartDesc) / 8, kWords = (kSharedParts * W + kThreads - 1) / kThreads;
  uint2 words[kWords];
  if (staged) {
    const uint2* src = reinterpret_cast<const uint2*>(gparts);
#pragma unroll
    for (int k = 0; k < kWords; ++k)
      if (tid + k * kThreads < p.max_parts * W) words[k] = src[tid + k * kThreads];
  }
  const int np = p.n_parts[b * p.NKV + kvh];  // written with the descriptors, between steps
  pdl_wait();
  // Every block has started: the next product may start its weight reads (it waits for this
  // kernel to finish before it reads the attention output).
  pdl_trigger();
  // The query (the previous kernel's output) is loaded now, its trip to memory overlapping the
  // descriptors' and the row counts' below.
  float q[8];
  const float* qrow = p.q + b * p.q_stride + static_cast<int64_t>(h) * p.D;
#pragma unroll
  for (int c = 0; c < 8; ++c) q[c] = ln.active ? qrow[ln.c0 + c] * p.scale : 0.0f;
  const PartDesc* parts = staged ? sh_parts : gparts;
  if (staged) {
    uint2* dst = reinterpret_cast<uint2*>(sh_parts);
#pragma unroll
    for (int k = 0; k < kWords; ++k)
      if (tid + k * kThreads < p.max_parts * W) dst[tid + k * kThreads] = words[k];
    __syncthreads();
    // Rows appended during decode (the tail's counter) are read after the wait, once.
    if (tid < np) sh_rows[tid] = part_rows(sh_parts[tid]);
    __syncthreads();
  }
  int N = 0;
  for (int i = 0; i < np; ++i) N += staged ? sh_rows[i] : part_rows(parts[i]);
  const int chunk = (N + p.splits - 1) / p.splits;
  const int r0 = min(N, s * chunk), r1 = min(N, r0 + chunk);
  const int64_t bh = static_cast<int64_t>(b) * p.NH + h;

  __shared__ float sh_q[8 * L];  // the scaled query, for the tensor-core path's operands
  if (ln.active) {
#pragma unroll
    for (int c = 0; c < 8; ++c) sh_q[ln.c0 + c] = q[c];
  }
  __syncthreads();

  // Calibration coefficients from the per-split visual ranges of the first pass (the block's
  // own in kRangeAttend: a head of one split ranges and attends in one kernel).
  bool cal = false;
  float cal_t = 1.0f, cal_g = 0.0f;
  auto coefficients = [&] {
    float gamma = INFINITY, delta = -INFINITY;
    for (int i = 0; i < p.splits; ++i) {
      gamma = fminf(gamma, p.vis_range[(bh * p.splits + i) * 2]);
      delta = fmaxf(delta, p.vis_range[(bh * p.splits + i) * 2 + 1]);
    }
    if (gamma <= delta) {
      cal = true;
      cal_g = gamma;
      cal_t = delta > gamma ? (delta - gamma + p.tau1 - p.tau2) / (delta - gamma) : 0.0f;
    }
  };
  constexpr bool both = BOTH;
  if (mode == kAttend && p.calibrate) coefficients();
  const float* sin = p.scores_in ? p.scores_in + bh * p.scores_stride : nullptr;
  float* sout = p.scores_out ? p.scores_out + bh * p.scores_stride : nullptr;

  State st;
  float lo = INFINITY, hi = -INFINITY;
  int base = 0;
  // A visual part's scores between the passes (DecodeParams::vis_scores), where they fit.
  auto scores_of = [&](const PartDesc& P, int n) -> float* {
    const bool on = p.vis_scores && p.calibrate && P.visual && base + n + kDecodeScorePad <= p.vis_stride;
    return on ? p.vis_scores + bh * p.vis_stride + base : nullptr;
  };
  // (both: the range pass, then the attention pass)
  for (int i = 0, pass = both ? kRange : mode; i < np || (both && pass == kRange); ++i) {
    if (both && i == np) {  // the block's visual range is the head's: its coefficients, then attention
      // (The packed paths leave no copy in flight when they return, only empty commit groups,
      // so the attention pass may reuse their stages after the barrier; block_range's barrier
      // also orders the range pass's stores to vis_scores before the attention pass's copies.)
      block_range(p, lo, hi, bh, s, tid);
      __syncthreads();
      coefficients();
      pass = kAttend;
      i = -1;
      base = 0;
      continue;
    }
    const int mode = pass;  // (this pass's)
    const PartDesc& P = parts[i];
    const int n = staged ? sh_rows[i] : part_rows(P);
    const int a = max(r0 - base, 0), e = min(r1 - base, n);
    const bool take = a < e && (mode != kRange || P.visual);
    if (take) {
      // Head sizes 64 and 128 (8 and 16 lanes a row) have fast paths for fp16, channel-wise and
      // token-wise codes; everything else takes the general path.
      int kind = 0, mk = 0;
      if constexpr (MMA_ONLY) {
        mk = mma_kind(P, n, mode, false, p.b1);
        constexpr int kPair = MMA == 3 ? 2 : 1;
        if (mk)
          run_mma<kPair, MMA != 1>(mk, P, a, e, sh_q, mode, cal && P.visual, cal_t, cal_g, p.tau1, st, lo, hi, stage,
                                   p.b1, scores_of(P, n));
        else if (mode == kAttend) fp16_rows<L, 4>(P, a, e, q, ln, g, false, cal_t, cal_g, p.tau1, st);
        base += n;
        continue;
      }
      if constexpr (L == 16)
        if (p.D == 128) mk = mma_kind(P, n, mode, sin != nullptr, p.b1);
      if constexpr (L == 8 || L == 16)
        if (p.D == 8 * L && !mk) kind = fast_kind(P, n, mode, sin != nullptr, p.lut_bits);  // every lane busy
      if (mk)
        run_mma<1, true>(mk, P, a, e, sh_q, mode, cal && P.visual, cal_t, cal_g, p.tau1, st, lo, hi, stage, p.b1,
                         scores_of(P, n));
      else if (kind) run_fast<L>(kind, P, a, e, q, ln, g, mode, cal && P.visual, cal_t, cal_g, p.tau1, st, lo, hi, lut);
      else run_part<L>(P, n, a, e, base, q, ln, g, mode, cal && P.visual, cal_t, cal_g, p.tau1, sin, sout, st, lo, hi);
    }
    base += n;
  }
  if (!both && mode == kScores) return;
  if (!both && mode == kRange) {
    block_range(p, lo, hi, bh, s, tid);
    return;
  }
  finish_block<L>(p, st, b, h, s, 0);  // (no fused token)
}

template <class OT>
__global__ void merge_kernel(DecodeParams p) {
  // (after the decode kernel: a fused token's row is the one before the advanced counter)
  merge_head(p, blockIdx.y, blockIdx.x, threadIdx.x, blockDim.x, p.fresh_k ? *p.tail_counter - 1 : 0);
}

__global__ void probs_kernel(DecodeParams p, float* probs) {
  const int h = blockIdx.x, b = blockIdx.y;
  const int64_t bh = static_cast<int64_t>(b) * p.NH + h;
  const float M = p.md_out[bh * 2], dsum = p.md_out[bh * 2 + 1];
  const float* s = p.scores_in + bh * p.scores_stride;
  float* o = probs + bh * p.scores_stride;
  for (int j = threadIdx.x; j < p.scores_stride; j += blockDim.x)
    o[j] = (s[j] == -INFINITY || !(dsum > 0.0f)) ? 0.0f : expf(s[j] - M) / dsum;
}

// Opts Kernel in to `bytes` of dynamic shared memory (its tables or stages) the first time a launch
// needs more than before: with its static arrays a block may pass the 48 KiB it gets without.
template <auto Kernel>
void allow_dynamic_smem(int bytes) {
  static int allowed = 0;
  if (bytes <= allowed) return;
  KV_CUDA(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
          "decode attention shared memory of " + std::to_string(bytes) + " bytes");
  allowed = bytes;
}

template <auto Kernel>
void launch_decode_kernel(const DecodeParams& p, dim3 grid, int bytes, int mode, cudaStream_t s) {
  allow_dynamic_smem<Kernel>(bytes);
  KV_CUDA(launch_dependent(Kernel, grid, kThreads, bytes, s, true, p, mode),
          "decode_kernel for " + std::to_string(p.B) + "x" + std::to_string(p.NH) + " heads");
}
// decode_kernel<L, MMA> with `bytes` of dynamic shared memory (its kRangeAttend instance for that
// mode).
template <int L, int MMA>
void launch_decode(const DecodeParams& p, dim3 grid, int bytes, int mode, cudaStream_t s) {
  if (mode == kRangeAttend) launch_decode_kernel<decode_kernel<L, MMA, true>>(p, grid, bytes, mode, s);
  else launch_decode_kernel<decode_kernel<L, MMA>>(p, grid, bytes, mode, s);
}

template <auto Kernel>
void launch_bulk(const DecodeParams& p, dim3 grid, cudaStream_t s) {
  allow_dynamic_smem<Kernel>(kBulkBytes);
  KV_CUDA(launch_dependent(Kernel, grid, kThreads, kBulkBytes, s, true, p),
          "decode_f16_bulk_kernel for " + std::to_string(p.B) + "x" + std::to_string(p.NH) + " heads");
}

// The GQA kernel (decode_gqa.cuh): its stages, opted in once.
template <int D>
constexpr int gqa_smem_bytes() {
  return kDecodeGqaStages * 2 * kDecodeGqaStageRows * (D + 8) * 2;
}
template <int D>
void prepare_gqa() {
  static const bool done = [] {
    KV_CUDA(cudaFuncSetAttribute(decode_f16_gqa_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 gqa_smem_bytes<D>()),
            "decode_f16_gqa_kernel shared memory");
    return true;
  }();
  (void)done;
}

// Grid (split, KV head, sequence).
template <int D>
void launch_gqa(const DecodeParams& p, cudaStream_t s) {
  const int R = p.NH / p.NKV;
  if (R < 2 || R > kDecodeGqaMaxRatio)
    throw InternalError("decode attention: the GQA kernel takes 2 to " + std::to_string(kDecodeGqaMaxRatio) +
                        " query heads a KV head, not " + std::to_string(R));
  prepare_gqa<D>();
  KV_CUDA(launch_dependent(decode_f16_gqa_kernel<D>, dim3(p.splits, p.NKV, p.B), dim3(kDecodeGqaThreads),
                           gqa_smem_bytes<D>(), s, true, p),
          "decode_f16_gqa_kernel for " + std::to_string(p.B) + "x" + std::to_string(p.NKV) + " KV heads");
}

template <int L>
void launch_l(const DecodeParams& p, int mode, cudaStream_t s) {
  dim3 grid(p.splits, p.NH, p.B);
  // An attention pass the narrower kernels take: no calibration, no materialized scores, every
  // lane of a row busy.
  const bool plain = mode == kAttend && !p.calibrate && !p.scores_in && !p.scores_out && p.D == 8 * L;
  const PlainKernels k = decode_plain_kernels(p.D, p.max_parts, p.all_f16, p.tok_bits, p.mix_bits);
  const bool f16 = plain && k.f16, tok = plain && k.tok, mix = plain && k.mix;
  if (p.fresh_k && (!(p.qtail.k ? tok : (f16 || mix)) || p.B != 1))
    throw InternalError(p.qtail.k ? "decode attention: a fused quantized token needs the token-wise kernel"
                                  : "decode attention: a fused token needs the fp16 or the mixed kernel");
  if constexpr (L == 8 || L == 16) {
    auto go = [&](auto kernel, const char* name) {
      KV_CUDA(launch_dependent(kernel, grid, kThreads, 0, s, true, p),
              std::string(name) + " for " + std::to_string(p.B) + "x" + std::to_string(p.NH) + " heads");
    };
    if (tok) {
      if (p.tok_bits == 2) go(decode_qtok_kernel<L, 2>, "decode_qtok_kernel");
      else if (p.tok_bits == 4) go(decode_qtok_kernel<L, 4>, "decode_qtok_kernel");
      else go(decode_qtok_kernel<L, 8>, "decode_qtok_kernel");
      return;
    }
    if (mix) {
      if (p.mix_bits == 2) go(decode_mix_kernel<L, 2, kTokRows / 2>, "decode_mix_kernel");
      else if (p.mix_bits == 4) go(decode_mix_kernel<L, 4, kTokRows / 2>, "decode_mix_kernel");
      else go(decode_mix_kernel<L, 0, kTokRows / 4>, "decode_mix_kernel");
      return;
    }
  }
  if constexpr (L == 4 || L == 8 || L == 16) {
    if (f16 && p.f16_gqa) {
      launch_gqa<8 * L>(p, s);
      return;
    }
  }
  if constexpr (L == 16) {
    if (f16 && p.f16_bulk) {
      // Rows claimed from the head's counter where a head has several blocks (decode_bulk.cuh),
      // in stages of half the rows where the blocks are long (DecodeParams::bulk_fine).
      const bool claim = p.claim && p.sem && p.splits > 1;
      if (!claim) launch_bulk<decode_f16_bulk_kernel<false, kDecodeBulkChunkRows>>(p, grid, s);
      else if (p.bulk_fine) launch_bulk<decode_f16_bulk_kernel<true, kDecodeBulkFineChunkRows>>(p, grid, s);
      else launch_bulk<decode_f16_bulk_kernel<true, kDecodeBulkChunkRows>>(p, grid, s);
      return;
    }
  }
  if (f16) {
    KV_CUDA(launch_dependent(decode_f16_kernel<L>, grid, kThreads, 0, s, true, p),
            "decode_f16_kernel for " + std::to_string(p.B) + "x" + std::to_string(p.NH) + " heads");
    return;
  }
  DecodeParams q = p;
  if (q.D == 128) q.lut_bits = 0;  // packed parts of head size 128 take the tensor-core path
  const int bytes = decode_lut_bytes(q.D, q.lut_bits) + (q.D == 128 ? (q.b1 ? kB1StageBytes : kI8StageBytes) : 0);
  if constexpr (L == 16) {
    if (p.all_mma && p.D == 128 && mode != kScores && !p.scores_in && !p.scores_out) {
      if (p.b1 && p.b1_pair) launch_decode<16, 3>(q, grid, 2 * bytes, mode, s);  // the paired sub-tiles' stages
      else if (p.b1) launch_decode<16, 2>(q, grid, bytes, mode, s);  // stages and static arrays: past 48 KiB
      else launch_decode<16, 1>(q, grid, bytes, mode, s);
      return;
    }
  }
  launch_decode<L, 0>(q, grid, bytes, mode, s);
}

void launch(const DecodeParams& p, int mode, cudaStream_t s) {
  const int chunks = (p.D + 7) / 8;
  if (p.D % 8 != 0 || p.D > 256) throw InternalError("decode attention: head_dim must be a multiple of 8, at most 256");
  if (p.NKV <= 0 || p.NH % p.NKV != 0) throw InternalError("decode attention: n_heads must be a multiple of n_kv_heads");
  if (p.splits < 1 || p.splits > kDecodeMaxSplits)
    throw InternalError("decode attention: splits must be in [1, " + std::to_string(kDecodeMaxSplits) + "]");
  if (chunks <= 1) launch_l<1>(p, mode, s);
  else if (chunks <= 2) launch_l<2>(p, mode, s);
  else if (chunks <= 4) launch_l<4>(p, mode, s);
  else if (chunks <= 8) launch_l<8>(p, mode, s);
  else if (chunks <= 16) launch_l<16>(p, mode, s);
  else launch_l<32>(p, mode, s);
  KV_LAUNCH("decode_kernel", std::to_string(p.B) + "x" + std::to_string(p.NH) + " heads, " +
                                 std::to_string(p.splits) + " splits");
}

}  // namespace

int decode_lut_bytes(int D, int lut_bits) {
  if (lut_bits <= 0 || D == 128) return 0;
  const int b = std::min(lut_bits, 4);
  return (D * b / 8 * 256 + D) * 4;  // the table and q⊙scale
}

bool decode_tok_supported(int D, int max_parts, int bits) {
  return (D == 64 || D == 128) && max_parts <= kSharedParts && (bits == 2 || bits == 4 || bits == 8);
}

bool decode_mix_supported(int D, int max_parts, int bits) {
  return (D == 64 || D == 128) && max_parts <= kSharedParts && (bits == 2 || bits == 4 || bits == kDecodeMixWidths);
}

PlainKernels decode_plain_kernels(int D, int max_parts, int all_f16, int tok_bits, int mix_bits) {
  PlainKernels k;
  k.f16 = all_f16 && decode_f16_supported(D, max_parts);
  k.tok = tok_bits && decode_tok_supported(D, max_parts, tok_bits);
  k.mix = mix_bits && !all_f16 && decode_mix_supported(D, max_parts, mix_bits);
  return k;
}

bool decode_f16_supported(int D, int max_parts) {
  return (D == 8 || D == 16 || D == 32 || D == 64 || D == 128 || D == 256) && max_parts <= kSharedParts;
}

void decode_attention(const DecodeParams& p, cudaStream_t s) {
  // A head of one split knows its visual range at the end of its own range pass.
  const bool one_kernel = p.calibrate && p.splits == 1 && !p.scores_in && !p.scores_out;
  if (p.calibrate && !one_kernel) launch(p, kRange, s);
  launch(p, one_kernel ? kRangeAttend : kAttend, s);
  if (p.sem) return;  // merged by each head's last block
  dim3 grid(p.NH, p.B);
  dispatch_float(p.odt, [&](auto t) {
    using OT = decltype(t);
    merge_kernel<OT><<<grid, 128, 0, s>>>(p);
  });
  KV_LAUNCH("merge_kernel", std::to_string(p.B) + "x" + std::to_string(p.NH) + " heads");
}

void decode_scores(const DecodeParams& p, cudaStream_t s) { launch(p, kScores, s); }

int decode_gqa_occupancy(int D) {
  int n = 0;
  auto ask = [&](auto d) {
    constexpr int HD = decltype(d)::value;
    prepare_gqa<HD>();
    KV_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_f16_gqa_kernel<HD>, kDecodeGqaThreads,
                                                          gqa_smem_bytes<HD>()),
            "decode_f16_gqa_kernel occupancy");
  };
  if (D == 32) ask(std::integral_constant<int, 32>{});
  else if (D == 64) ask(std::integral_constant<int, 64>{});
  else if (D == 128) ask(std::integral_constant<int, 128>{});
  else throw InternalError("decode_gqa_occupancy: head size " + std::to_string(D) + " has no GQA kernel");
  return n;
}

void decode_probs(const DecodeParams& p, float* probs, cudaStream_t s) {
  dim3 grid(p.NH, p.B);
  probs_kernel<<<grid, 256, 0, s>>>(p, probs);
  KV_LAUNCH("probs_kernel", std::to_string(p.B) + "x" + std::to_string(p.NH) + " heads");
}

}  // namespace kvlens::cuda
