// Prefill / vision attention: tiled, one online softmax per query row, never materializing the
// T×T scores. CPU twin: cpu::attention_head.
//
// Tensor-core kernel (head_dim 32, 64, 128; fp16 / bf16 models), FlashAttention-2 style:
// - K and V are staged once per call as fp16, head-major [2][n_kv_heads][Tp][D] (Tp: T rounded
//   up to 128, the extra rows zero), one 16-byte store per thread from two float4 loads.
// - A block takes 64 query rows of one head; each warp holds its 16 rows of Q for the whole
//   call as mma.m16n8k16 A fragments (fp16) in registers.
// - K/V tiles of 64 keys go to shared memory with cp.async, double-buffered: the next tile is
//   in flight while the current one is computed. Rows are padded by 16 bytes, so the 8 row
//   addresses of each ldmatrix phase fall in 8 different bank groups.
// - S = Q·Kᵀ (16×64 a warp) stays in the mma's fp32 accumulators (K fragments by ldmatrix).
//   Only tiles that need it are masked (keys ≥ T, the causal diagonal); a causal block stops
//   at its diagonal, and blocks run heaviest first.
// - Online softmax on the fragments: row maxima and sums over the four lanes that share a row
//   (two shuffles), exp2 with scale·log2(e) folded in, running rescale of O.
// - P is rounded to fp16 in registers: the accumulators of two adjacent 16×8 score blocks are
//   exactly the A fragment of one 16×16 block, so P never goes through shared memory. O += P·V
//   takes V fragments from ldmatrix.trans. Finally O / l is written in the output dtype.
// - Where 64-row blocks would leave SMs with fewer than two blocks (the vision tower: 577
//   tokens × 16 heads is 160 blocks for 132 SMs), a block has 8 warps: two groups of 4 take the
//   two 64-key halves of each 128-key stage (the same bytes loaded per query row as with 4
//   warps, twice the warps per SM) and merge their (max, sum, O) states through shared memory
//   at the end.
// Other head sizes, and fp32 models, use the simple kernel: one warp per query row, fp32
// throughout.
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/softmax_state.cuh"

namespace kvlens::cuda {

namespace {

struct Args {
  const float* qkv;
  int64_t stride, q_col, k_col, v_col;
  int T, NH, G, D;
  int causal;
  float scale;
};

// ---- tensor-core pieces (ldsm_x4, mma16816, fast_exp2, half2_bits: kernels/cuda/mma.cuh) ----------
template <class OT>
__device__ __forceinline__ void store2(OT* p, float x, float y) {
  if constexpr (std::is_same_v<OT, __half>) *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
  else *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
}

constexpr int kStageRows = 128;  // staged K/V rows are padded to a multiple of the largest key stage

// The tensor-core kernel's shape: 64 query rows a block, 4·KS warps; KS groups of 4 warps take
// the KS 64-key halves of each key stage.
template <int D, int KS>
struct Flash {
  static constexpr int BQ = 64, BK = 64, SK = BK * KS;
  static constexpr int THREADS = 128 * KS;
  static constexpr int LD = D + 8;              // halves per shared row (16 bytes of padding)
  static constexpr int stage = SK * LD;         // halves of one K or V stage
  static constexpr size_t bytes = sizeof(__half) * 4 * stage;  // K and V, two stages each
  static constexpr int NV = D / 2 + 4;          // floats a lane hands over in the merge
  static_assert(KS == 1 || sizeof(float) * 4 * 32 * NV <= bytes, "merge area fits over the stages");
  static_assert(SK <= kStageRows && kStageRows % SK == 0, "stages end inside the padded rows");
};

// K and V of qkv (fp32) as fp16, head-major: kv16[side][kv head][t][d] for t < Tp (rows ≥ T
// zero). Thread = 8 consecutive values of one head row; blockIdx.y (strided) = token.
template <int D>
__global__ void stage_kv_kernel(Args a, int Tp, __half* __restrict__ kv16) {
  constexpr int C8 = D / 8;
  const int NKV = a.NH / a.G, per_side = NKV * C8;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= 2 * per_side) return;
  const int side = c >= per_side ? 1 : 0, cc = c - side * per_side, hh = cc / C8, d = (cc % C8) * 8;
  const float* src = a.qkv + (side ? a.v_col : a.k_col) + static_cast<int64_t>(hh) * D + d;
  __half* dst = kv16 + static_cast<int64_t>(side * NKV + hh) * Tp * D + d;
  for (int t = blockIdx.y; t < Tp; t += gridDim.y) {
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (t < a.T) {
      const float4* p = reinterpret_cast<const float4*>(src + t * a.stride);
      const float4 x = __ldg(p), y = __ldg(p + 1);
      u = make_uint4(half2_bits(x.x, x.y), half2_bits(x.z, x.w), half2_bits(y.x, y.y), half2_bits(y.z, y.w));
    }
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(t) * D) = u;
  }
}

// Block (head, query tile). kv16 from stage_kv_kernel, Tp rows a head. Blocks an SM must hold
// (the register cap follows): 4-warp blocks 2 at head size 128, else 3; 8-warp blocks 2 below
// head size 128 (so the vision tower's 160 blocks fit 132 SMs at once).
template <int D, int KS>
constexpr int flash_min_blocks() {
  return KS == 1 ? (D == 128 ? 2 : 3) : (D == 128 ? 1 : 2);
}
template <int D, int KS, class OT>
__global__ void __launch_bounds__(128 * KS, flash_min_blocks<D, KS>())
    attn_flash_kernel(Args a, const __half* __restrict__ kv16, int Tp, OT* __restrict__ out) {
  using F = Flash<D, KS>;
  constexpr int LD = F::LD, SK = F::SK, BK = F::BK, NT = F::THREADS;
  constexpr int KC = D / 16;  // 16-wide slices of the head dimension
  constexpr int NB = D / 8;   // 8-wide column blocks of O
  extern __shared__ __align__(128) unsigned char smem[];
  __half* ks_all = reinterpret_cast<__half*>(smem);  // [2][SK][LD]
  __half* vs_all = ks_all + 2 * F::stage;            // [2][SK][LD]

  const int h = blockIdx.x, kvh = h / a.G;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * F::BQ;  // the longest causal rows first
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rg = warp & 3, part = warp >> 2;  // 16-row group; which 64 keys of a stage
  const int g = lane >> 2, t4 = lane & 3;     // fragment row group and column pair
  const int qlo = q0 + 16 * rg;               // the warp's first row
  const int NKV = a.NH / a.G;
  const __half* kg = kv16 + static_cast<int64_t>(kvh) * Tp * D;
  const __half* vg = kv16 + (static_cast<int64_t>(NKV) + kvh) * Tp * D;
  const int kend = a.causal ? min(a.T, q0 + F::BQ) : a.T;
  const int n_stages = (kend + SK - 1) / SK;

  // Stage s (keys s·SK ..) of K and V into buffer s & 1: D/8 16-byte chunks a row, RP rows a
  // pass of the block.
  constexpr int C8 = D / 8, RP = NT / C8;
  static_assert(NT % C8 == 0 && SK % RP == 0, "whole rows a pass");
  const int ld_r = tid / C8, ld_c = (tid % C8) * 8;
  const __half* kg_t = kg + static_cast<int64_t>(ld_r) * D + ld_c;
  const __half* vg_t = vg + static_cast<int64_t>(ld_r) * D + ld_c;
  const uint32_t ks_t = smem_addr(ks_all + ld_r * LD + ld_c), vs_t = smem_addr(vs_all + ld_r * LD + ld_c);
  auto issue = [&](int s) {
    const int64_t src = static_cast<int64_t>(s) * SK * D;
    const uint32_t dst = static_cast<uint32_t>((s & 1) * F::stage) * 2u;
#pragma unroll
    for (int u = 0; u < SK / RP; ++u) {
      cp_async16(ks_t + dst + u * RP * LD * 2, kg_t + src + u * RP * D);
      cp_async16(vs_t + dst + u * RP * LD * 2, vg_t + src + u * RP * D);
    }
    cp_async_commit();
  };
  issue(0);

  // Q rows qlo + g and qlo + g + 8 as A fragments (zero past T).
  uint32_t qf[KC][4];
  {
    const int r0 = qlo + g;
    const float* q0p = a.qkv + a.q_col + static_cast<int64_t>(h) * D + static_cast<int64_t>(r0) * a.stride + 2 * t4;
    const float* q1p = q0p + 8 * a.stride;
    const bool ok0 = r0 < a.T, ok1 = r0 + 8 < a.T;
    const float2 z = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const float2 x0 = ok0 ? __ldg(reinterpret_cast<const float2*>(q0p + 16 * kc)) : z;
      const float2 x1 = ok1 ? __ldg(reinterpret_cast<const float2*>(q1p + 16 * kc)) : z;
      const float2 x2 = ok0 ? __ldg(reinterpret_cast<const float2*>(q0p + 16 * kc + 8)) : z;
      const float2 x3 = ok1 ? __ldg(reinterpret_cast<const float2*>(q1p + 16 * kc + 8)) : z;
      qf[kc][0] = half2_bits(x0.x, x0.y);
      qf[kc][1] = half2_bits(x1.x, x1.y);
      qf[kc][2] = half2_bits(x2.x, x2.y);
      qf[kc][3] = half2_bits(x3.x, x3.y);
    }
  }

  const float c2 = a.scale * 1.4426950408889634f;  // scores in log2 units
  float o[NB][4];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) o[nb][0] = o[nb][1] = o[nb][2] = o[nb][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g, g + 8 (l: this lane's part)
  // ldmatrix row addresses of this lane: K (non-transposed, B of S = Q·Kᵀ): keys (lane & 7) +
  // 8·(lane / 16), dims 8·((lane / 8) & 1); V (transposed, B of O = P·V): keys (lane & 7) +
  // 8·((lane / 8) & 1), dims 8·(lane / 16).
  const int k_lane = ((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8;
  const int v_lane = ((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + (lane >> 4) * 8;

  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait_all();
    __syncthreads();  // stage s visible to all; every warp is done with stage s − 1's buffer
    if (s + 1 < n_stages) issue(s + 1);
    const int kb = s * SK + part * BK;  // this warp's 64 keys
    if (kb >= kend || qlo >= a.T || (a.causal && kb > qlo + 15)) continue;  // nothing to add for these rows
    const uint32_t kaddr = smem_addr(ks_all + (s & 1) * F::stage + part * BK * LD + k_lane);
    const uint32_t vaddr = smem_addr(vs_all + (s & 1) * F::stage + part * BK * LD + v_lane);

    // S = Q·Kᵀ: sc[nb] is the 16×8 block of keys kb + 8·nb ...
    float sc[8][4];
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) sc[nb][0] = sc[nb][1] = sc[nb][2] = sc[nb][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < KC; ++kc)
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        uint32_t b[4];  // keys 16p.. (dims 16kc.., 16kc + 8..), keys 16p + 8.. (same dims)
        ldsm_x4(b, kaddr + static_cast<uint32_t>(p * 16 * LD + kc * 16) * 2u);
        mma16816(sc[2 * p], qf[kc], b[0], b[1]);
        mma16816(sc[2 * p + 1], qf[kc], b[2], b[3]);
      }

    // Scale into log2 units; mask keys ≥ T and, on the diagonal, keys after the row.
    const bool edge = kb + BK > a.T || (a.causal && kb + BK - 1 > qlo);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = sc[nb][e] * c2;
        if (edge) {
          const int key = kb + 8 * nb + 2 * t4 + (e & 1), row = qlo + g + 8 * (e >> 1);
          if (key >= a.T || (a.causal && key > row)) v = -INFINITY;
        }
        sc[nb][e] = v;
      }

    // Online softmax: new row maxima (the quad's four lanes hold a row), rescale, P = 2^(S − m).
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      mx[0] = fmaxf(mx[0], fmaxf(sc[nb][0], sc[nb][1]));
      mx[1] = fmaxf(mx[1], fmaxf(sc[nb][2], sc[nb][3]));
    }
    float base[2], alpha[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      base[r] = softmax_shift(mx[r]);  // a row with nothing seen yet stays at 0
      alpha[r] = fast_exp2(m[r] - base[r]);
      m[r] = mx[r];
    }
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      sc[nb][0] = fast_exp2(sc[nb][0] - base[0]);
      sc[nb][1] = fast_exp2(sc[nb][1] - base[0]);
      sc[nb][2] = fast_exp2(sc[nb][2] - base[1]);
      sc[nb][3] = fast_exp2(sc[nb][3] - base[1]);
      rs[0] += sc[nb][0] + sc[nb][1];
      rs[1] += sc[nb][2] + sc[nb][3];
    }
    l[0] = l[0] * alpha[0] + rs[0];
    l[1] = l[1] * alpha[1] + rs[1];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      o[nb][0] *= alpha[0];
      o[nb][1] *= alpha[0];
      o[nb][2] *= alpha[1];
      o[nb][3] *= alpha[1];
    }

    // O += P·V: the accumulators of score blocks 2kk, 2kk + 1 are the A fragment of keys 16kk...
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t pa[4] = {half2_bits(sc[2 * kk][0], sc[2 * kk][1]), half2_bits(sc[2 * kk][2], sc[2 * kk][3]),
                              half2_bits(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              half2_bits(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        uint32_t b[4];  // dims 16np.. (keys 16kk.., 16kk + 8..), dims 16np + 8.. (same keys)
        ldsm_x4_trans(b, vaddr + static_cast<uint32_t>(kk * 16 * LD + np * 16) * 2u);
        mma16816(o[2 * np], pa, b[0], b[1]);
        mma16816(o[2 * np + 1], pa, b[2], b[3]);
      }
    }
  }

  if constexpr (KS == 2) {
    // The second group hands its state to the first, lane by lane in fragment order.
    __syncthreads();  // no copy in flight and every warp done with the stages
    float* x = reinterpret_cast<float*>(smem) + rg * F::NV * 32 + lane;
    if (part == 1) {
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[(4 * nb + e) * 32] = o[nb][e];
      x[(4 * NB) * 32] = m[0];
      x[(4 * NB + 1) * 32] = m[1];
      x[(4 * NB + 2) * 32] = l[0];
      x[(4 * NB + 3) * 32] = l[1];
    }
    __syncthreads();
    if (part == 1) return;
    float wa[2], wb[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float mo = x[(4 * NB + r) * 32], lo = x[(4 * NB + 2 + r) * 32];
      const float mm = fmaxf(m[r], mo), b = softmax_shift(mm);
      wa[r] = fast_exp2(m[r] - b);
      wb[r] = fast_exp2(mo - b);
      l[r] = l[r] * wa[r] + lo * wb[r];
    }
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nb][e] = o[nb][e] * wa[e >> 1] + x[(4 * nb + e) * 32] * wb[e >> 1];
  }

  // Row sums over the quad, then O / l for rows qlo + g and qlo + g + 8.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  const float inv0 = l[0] > 0.0f ? 1.0f / l[0] : 0.0f, inv1 = l[1] > 0.0f ? 1.0f / l[1] : 0.0f;
  const int r0 = qlo + g;
  OT* o0 = out + static_cast<int64_t>(r0) * a.NH * D + static_cast<int64_t>(h) * D + 2 * t4;
  OT* o1 = o0 + static_cast<int64_t>(8) * a.NH * D;
  if (r0 < a.T)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) store2(o0 + 8 * nb, o[nb][0] * inv0, o[nb][1] * inv0);
  if (r0 + 8 < a.T)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) store2(o1 + 8 * nb, o[nb][2] * inv1, o[nb][3] * inv1);
}

// One warp per (query row, head); lane holds dims lane, lane + 32, ... (D ≤ 256).
template <class OT>
__global__ void attn_simple_kernel(Args a, OT* __restrict__ out) {
  const int warps = blockDim.x >> 5;
  const int i = blockIdx.x * warps + (threadIdx.x >> 5);
  const int h = blockIdx.y, kvh = h / a.G, lane = threadIdx.x & 31;
  if (i >= a.T) return;
  constexpr int MAXC = 8;
  float q[MAXC];
  const float* qr = a.qkv + i * a.stride + a.q_col + static_cast<int64_t>(h) * a.D;
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    const int d = lane + 32 * c;
    q[c] = d < a.D ? qr[d] : 0.0f;
  }
  SoftmaxState<MAXC> st;
  const int kend = a.causal ? i + 1 : a.T;
  for (int j = 0; j < kend; ++j) {
    const float* kr = a.qkv + j * a.stride + a.k_col + static_cast<int64_t>(kvh) * a.D;
    const float* vr = a.qkv + j * a.stride + a.v_col + static_cast<int64_t>(kvh) * a.D;
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
      const int d = lane + 32 * c;
      if (d < a.D) dot = fmaf(q[c], kr[d], dot);
    }
    const float s = warp_sum(dot) * a.scale;
    st.add(s, [&](int c) { return lane + 32 * c < a.D ? vr[lane + 32 * c] : 0.0f; },
           [](float x) { return expf(x); });
  }
  OT* orow = out + static_cast<int64_t>(i) * a.NH * a.D + static_cast<int64_t>(h) * a.D;
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    const int d = lane + 32 * c;
    if (d < a.D) orow[d] = from_f<OT>(st.d > 0.0f ? st.o[c] / st.d : 0.0f);
  }
}

// Scores of a tile of kScoreRows query rows × kScoreKeys keys of one head (blockIdx.z), the
// block's rows r0 .. r0 + kScoreRows − 1 of rows[0..n) (null: rows row0, row0 + 1, ...), written to
// scores [n_heads][n][T] (masked = -inf). q and k come through shared memory kScoreDepth channels
// at a time; each thread sums 2 rows × 4 keys, every dot product in ascending channel order
// (fmaf from 0). A tile past every row's last unmasked key writes -inf alone.
constexpr int kScoreRows = 32, kScoreKeys = 64, kScoreDepth = 32;
__global__ void __launch_bounds__(256) attn_scores_kernel(Args a, const int* __restrict__ rows, int row0, int n,
                                                          float* __restrict__ scores) {
  __shared__ float qs[kScoreRows][kScoreDepth + 1];
  __shared__ float ks[kScoreKeys][kScoreDepth + 1];
  __shared__ int rs[kScoreRows];
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int r0 = blockIdx.x * kScoreRows, k0 = blockIdx.y * kScoreKeys, h = blockIdx.z, kvh = h / a.G;
  if (tid < kScoreRows) rs[tid] = r0 + tid < n ? (rows ? rows[r0 + tid] : row0 + r0 + tid) : -1;
  __syncthreads();
  int last = -1;  // the tile's largest query row
  for (int r = 0; r < kScoreRows; ++r) last = max(last, rs[r]);
  const int i0 = rs[ty], i1 = rs[ty + 16];
  float acc[2][4] = {};
  if (!a.causal || k0 <= last) {
    for (int d0 = 0; d0 < a.D; d0 += kScoreDepth) {
      for (int x = tid; x < kScoreRows * kScoreDepth; x += 256) {
        const int r = x / kScoreDepth, d = d0 + x % kScoreDepth, i = rs[r];
        qs[r][x % kScoreDepth] =
            i >= 0 && d < a.D ? a.qkv[i * a.stride + a.q_col + static_cast<int64_t>(h) * a.D + d] : 0.0f;
      }
      for (int x = tid; x < kScoreKeys * kScoreDepth; x += 256) {
        const int c = x / kScoreDepth, d = d0 + x % kScoreDepth, j = k0 + c;
        ks[c][x % kScoreDepth] =
            j < a.T && d < a.D ? a.qkv[j * a.stride + a.k_col + static_cast<int64_t>(kvh) * a.D + d] : 0.0f;
      }
      __syncthreads();
#pragma unroll 8
      for (int d = 0; d < kScoreDepth; ++d) {
        const float q0 = qs[ty][d], q1 = qs[ty + 16][d];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float k = ks[tx + 16 * c][d];
          acc[0][c] = fmaf(q0, k, acc[0][c]);
          acc[1][c] = fmaf(q1, k, acc[1][c]);
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = r0 + ty + 16 * e, i = e ? i1 : i0;
    if (i < 0) continue;
    float* srow = scores + (static_cast<int64_t>(h) * n + r) * a.T;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = k0 + tx + 16 * c;
      if (j < a.T) srow[j] = a.causal && j > i ? -INFINITY : acc[e][c] * a.scale;
    }
  }
}

Args make_args(const float* qkv, const AttnLayout& l) {
  if (l.n_kv_heads <= 0 || l.n_heads % l.n_kv_heads != 0)
    throw InternalError("attention: n_heads must be a multiple of n_kv_heads");
  return {qkv, l.row_stride, l.q_col, l.k_col, l.v_col, l.T, l.n_heads, l.n_heads / l.n_kv_heads, l.head_dim,
          l.causal ? 1 : 0, l.scale};
}

// Blocks of attn_flash_kernel<D, KS, OT> that fit one SM, 0 where its shared memory exceeds
// what a block may have on this device (the attribute is set on the first call; it is per
// kernel and process).
template <int D, int KS, class OT>
int flash_resident() {
  using F = Flash<D, KS>;
  static const int n = [] {
    int r = 0;
    if (cudaFuncSetAttribute(attn_flash_kernel<D, KS, OT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(F::bytes)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r, attn_flash_kernel<D, KS, OT>, F::THREADS, F::bytes) !=
            cudaSuccess) {
      cudaGetLastError();  // not sticky: this shape is just not used
      return 0;
    }
    return r;
  }();
  return n;
}

template <int D, int KS, class OT>
void launch_flash(const Args& a, const __half* kv16, int Tp, OT* out, cudaStream_t s) {
  using F = Flash<D, KS>;
  if (flash_resident<D, KS, OT>() == 0)
    throw DeviceError("attention: blocks of " + std::to_string(F::THREADS) + " threads with " +
                      std::to_string(F::bytes) + " bytes of shared memory do not fit this device (key split " +
                      std::to_string(KS) + ", head_dim " + std::to_string(D) + ")");
  const dim3 grid(a.NH, (a.T + F::BQ - 1) / F::BQ);
  attn_flash_kernel<D, KS, OT><<<grid, F::THREADS, F::bytes, s>>>(a, kv16, Tp, out);
}

// Launches the tensor-core kernel; returns the key split it used. With key_split 0: two key
// halves a block when 64-row blocks would leave SMs with fewer than two blocks (8 warps) and
// the 8-warp blocks all fit at once (and there is a second half to take).
template <int D>
int flash(const Args& a, const __half* kv16, int Tp, void* out, Dt odt, int key_split, cudaStream_t s) {
  int ks = key_split;
  dispatch_float(odt, [&](auto t) {
    using OT = decltype(t);
    if constexpr (!std::is_same_v<OT, float>) {  // fp32 outputs take the simple kernel
      if (ks == 0) {
        int dev = 0, n_sm = 0;
        KV_CUDA(cudaGetDevice(&dev), "attention");
        KV_CUDA(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev), "attention");
        const int64_t blocks = static_cast<int64_t>(a.NH) * ((a.T + 63) / 64), sms = n_sm;
        ks = a.T > 64 && blocks < 2 * sms && blocks <= flash_resident<D, 2, OT>() * sms ? 2 : 1;
      }
      if (ks == 2) launch_flash<D, 2>(a, kv16, Tp, static_cast<OT*>(out), s);
      else launch_flash<D, 1>(a, kv16, Tp, static_cast<OT*>(out), s);
    }
  });
  return ks;
}

}  // namespace

void attention_prefill_simple(const float* qkv, const AttnLayout& l, void* out, Dt odt, cudaStream_t s) {
  if (l.T == 0) return;
  if (l.head_dim > 256) throw InternalError("attention: head_dim above 256");
  const Args a = make_args(qkv, l);
  dim3 grid((l.T + 3) / 4, l.n_heads);
  dispatch_float(odt, [&](auto t) {
    using OT = decltype(t);
    attn_simple_kernel<OT><<<grid, 128, 0, s>>>(a, static_cast<OT*>(out));
  });
  KV_LAUNCH("attn_simple_kernel", std::to_string(l.T) + " tokens x " + std::to_string(l.n_heads) + " heads");
}

namespace {

// Device memory from the stream-ordered pool, freed in stream order however the call ends.
struct StreamBuffer {
  void* p = nullptr;
  cudaStream_t s;
  StreamBuffer(int64_t bytes, cudaStream_t stream, const std::string& what) : s(stream) {
    KV_CUDA(cudaMallocAsync(&p, static_cast<size_t>(bytes), s), what);
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() { if (p) cudaFreeAsync(p, s); }
};

// q, k and v of every head of qkv, each widened from D to Dp channels with zeros: [T][heads][Dp].
__global__ void pad_heads_kernel(Args a, int nk, int Dp, float* dst) {
  const int H = a.NH + 2 * nk, D = a.D;
  const int64_t n = static_cast<int64_t>(a.T) * H * Dp;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c = static_cast<int>(i % Dp), h = static_cast<int>(i / Dp % H);
    const int64_t t = i / (static_cast<int64_t>(Dp) * H);
    const int64_t col = h < a.NH ? a.q_col + static_cast<int64_t>(h) * D
                        : h < a.NH + nk ? a.k_col + static_cast<int64_t>(h - a.NH) * D
                                        : a.v_col + static_cast<int64_t>(h - a.NH - nk) * D;
    dst[i] = c < D ? a.qkv[t * a.stride + col + c] : 0.0f;
  }
}

}  // namespace

int attention_prefill(const float* qkv, const AttnLayout& l, void* out, Dt odt, cudaStream_t s, int key_split) {
  if (l.T == 0) return 0;
  const int D = l.head_dim;
  if (D < 128 && D != 32 && D != 64 && odt != Dt::F32) {
    // A head size the tensor-core kernel lacks (Qwen2-VL's vision tower: 80) runs at the next
    // size it has, on copies of q, k and v whose added channels are zero: the same scores (the
    // layout's scale is kept), and the output's added channels, zero, are dropped.
    const int Dp = D < 32 ? 32 : D < 64 ? 64 : 128, H = l.n_heads + 2 * l.n_kv_heads;
    const int64_t n = static_cast<int64_t>(l.T) * H * Dp, no = static_cast<int64_t>(l.T) * l.n_heads * Dp;
    const StreamBuffer wide(n * 4, s, "attention q/k/v widened to head size " + std::to_string(Dp));
    const StreamBuffer wide_out(no * 2, s, "attention output at head size " + std::to_string(Dp));
    pad_heads_kernel<<<static_cast<int>(std::min<int64_t>((n + 255) / 256, 65535)), 256, 0, s>>>(make_args(qkv, l), l.n_kv_heads, Dp, static_cast<float*>(wide.p));
    KV_LAUNCH("pad_heads_kernel", std::to_string(l.T) + " tokens, head size " + std::to_string(D) + " → " + std::to_string(Dp));
    AttnLayout w = l;
    w.head_dim = Dp;
    w.row_stride = static_cast<int64_t>(H) * Dp;
    w.q_col = 0;
    w.k_col = static_cast<int64_t>(l.n_heads) * Dp;
    w.v_col = static_cast<int64_t>(l.n_heads + l.n_kv_heads) * Dp;
    const int ks = attention_prefill(static_cast<const float*>(wide.p), w, wide_out.p, odt, s, key_split);
    KV_CUDA(cudaMemcpy2DAsync(out, static_cast<size_t>(D) * 2, wide_out.p, static_cast<size_t>(Dp) * 2, static_cast<size_t>(D) * 2,
                              static_cast<size_t>(l.T) * l.n_heads, cudaMemcpyDeviceToDevice, s),
            "attention output back to head size " + std::to_string(D));
    return ks;
  }
  // fp16 tiles for fp16 / bf16 models; an fp32 model keeps fp32 throughout.
  const bool aligned = (reinterpret_cast<uintptr_t>(qkv) & 15) == 0 && l.row_stride % 4 == 0 && l.q_col % 4 == 0 &&
                       l.k_col % 4 == 0 && l.v_col % 4 == 0 && (reinterpret_cast<uintptr_t>(out) & 3) == 0;
  if ((D != 32 && D != 64 && D != 128) || odt == Dt::F32 || !aligned) {
    attention_prefill_simple(qkv, l, out, odt, s);
    return 0;
  }
  if (key_split != 0 && key_split != 1 && key_split != 2)
    throw InternalError("attention: key_split must be 0 (by the device), 1 or 2");
  const Args a = make_args(qkv, l);
  const int Tp = (l.T + kStageRows - 1) / kStageRows * kStageRows;
  const int64_t n = static_cast<int64_t>(2) * l.n_kv_heads * Tp * D;
  const StreamBuffer st(n * 2, s, "attention K/V staging (" + mib(n * 2) + ")");
  const int chunks = 2 * l.n_kv_heads * D / 8;
  const dim3 sgrid((chunks + 127) / 128, std::min(Tp, 65535));
  auto* kvh = static_cast<__half*>(st.p);
  if (D == 32) stage_kv_kernel<32><<<sgrid, 128, 0, s>>>(a, Tp, kvh);
  else if (D == 64) stage_kv_kernel<64><<<sgrid, 128, 0, s>>>(a, Tp, kvh);
  else stage_kv_kernel<128><<<sgrid, 128, 0, s>>>(a, Tp, kvh);
  KV_LAUNCH("stage_kv_kernel", std::to_string(l.T) + " tokens");
  const int ks = D == 32 ? flash<32>(a, kvh, Tp, out, odt, key_split, s)
                 : D == 64 ? flash<64>(a, kvh, Tp, out, odt, key_split, s)
                           : flash<128>(a, kvh, Tp, out, odt, key_split, s);
  KV_LAUNCH("attn_flash_kernel", std::to_string(l.T) + " tokens x " + std::to_string(l.n_heads) + " heads, D=" +
                                     std::to_string(D) + ", key split " + std::to_string(ks));
  return ks;
}

void attention_scores(const float* qkv, const AttnLayout& l, float* scores, cudaStream_t s) {
  attention_scores_rows(qkv, l, nullptr, 0, l.T, scores, s);
}

void attention_scores_rows(const float* qkv, const AttnLayout& l, const int* rows, int row0, int n, float* scores,
                           cudaStream_t s) {
  if (l.T == 0 || n == 0) return;
  const Args a = make_args(qkv, l);
  dim3 grid((n + kScoreRows - 1) / kScoreRows, (l.T + kScoreKeys - 1) / kScoreKeys, l.n_heads);
  attn_scores_kernel<<<grid, 256, 0, s>>>(a, rows, row0, n, scores);
  KV_LAUNCH("attn_scores_kernel", std::to_string(n) + " of " + std::to_string(l.T) + " tokens");
}

}  // namespace kvlens::cuda
