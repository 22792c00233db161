// Prefill / vision attention: tiled, one online softmax per query row, never materializing the
// T×T scores. CPU twin: cpu::attention_head.
//
// Tensor-core kernel (head_dim 32, 64, 128): K and V are first staged once as fp16, head-major;
// then a block of 4 warps takes 64 query rows of one head and walks the key tiles (64 keys)
// twice: the first pass finds each row's maximum score, the second forms P = exp(S − max) (so
// no running rescale of the output is needed) and accumulates P·V in tensor-core fragments
// (fp16 operands, fp32 accumulation) and the row sums. Scores are WMMA products (fp16 in, fp32
// out). Other head sizes, and fp32 models, use the simple kernel: one warp per query row, fp32
// throughout.
#include <mma.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

using namespace nvcuda;

struct Args {
  const float* qkv;
  int64_t stride, q_col, k_col, v_col;
  int T, NH, G, D;
  int causal;
  float scale;
};

template <int D>
struct Tile {
  static constexpr int BQ = 64, BK = 64;
  static constexpr int LDH = D + 8;   // halves
  static constexpr int LDS = BK + 4;  // floats
  static constexpr int LDP = BK + 8;  // halves
  static constexpr int LDO = D + 4;   // floats (the output tile, over the K and V tiles at the end)
  static constexpr size_t q_off = 0;
  static constexpr size_t k_off = q_off + sizeof(__half) * BQ * LDH;
  static constexpr size_t v_off = k_off + sizeof(__half) * BK * LDH;
  static constexpr size_t s_off = v_off + sizeof(__half) * BK * LDH;
  static constexpr size_t p_off = s_off + sizeof(float) * BQ * LDS;
  static constexpr size_t bytes = p_off + sizeof(__half) * BQ * LDP;
  static_assert(sizeof(float) * BQ * LDO <= 2 * sizeof(__half) * BK * LDH, "output tile fits over K and V");
};

// kv16: K and V of every KV head as fp16, [2][n_kv_heads][T][D] (made once per call).
template <int D, class OT>
__global__ void __launch_bounds__(128) attn_wmma_kernel(Args a, const __half* __restrict__ kv16, OT* __restrict__ out) {
  using TL = Tile<D>;
  constexpr int BQ = TL::BQ, BK = TL::BK, LDH = TL::LDH, LDS = TL::LDS, LDP = TL::LDP, LDO = TL::LDO;
  constexpr int NF = D / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* Qs = reinterpret_cast<__half*>(smem + TL::q_off);
  __half* Ks = reinterpret_cast<__half*>(smem + TL::k_off);
  __half* Vs = reinterpret_cast<__half*>(smem + TL::v_off);
  float* Ss = reinterpret_cast<float*>(smem + TL::s_off);
  __half* Ps = reinterpret_cast<__half*>(smem + TL::p_off);
  float* Os = reinterpret_cast<float*>(smem + TL::k_off);

  const int q0 = blockIdx.x * BQ, h = blockIdx.y, kvh = h / a.G;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
  const float* qbase = a.qkv + a.q_col + static_cast<int64_t>(h) * D;
  const int NKV = a.NH / a.G;
  const __half* kg = kv16 + static_cast<int64_t>(kvh) * a.T * D;
  const __half* vg = kv16 + (static_cast<int64_t>(NKV) + kvh) * a.T * D;

  // Q tile: float4 reads (rows are 16-byte aligned), fp16 pairs in shared memory.
  {
    constexpr int QP = BQ * D / 4 / 128;
    float4 qv[QP];
#pragma unroll
    for (int u = 0; u < QP; ++u) {
      const int i = tid + u * 128, r = i / (D / 4), c = (i % (D / 4)) * 4, t = q0 + r;
      qv[u] = t < a.T ? __ldg(reinterpret_cast<const float4*>(qbase + t * a.stride + c)) : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < QP; ++u) {
      const int i = tid + u * 128, r = i / (D / 4), c = (i % (D / 4)) * 4;
      *reinterpret_cast<__half2*>(Qs + r * LDH + c) = __floats2half2_rn(qv[u].x, qv[u].y);
      *reinterpret_cast<__half2*>(Qs + r * LDH + c + 2) = __floats2half2_rn(qv[u].z, qv[u].w);
    }
  }
  // A K or V tile: every thread's loads are issued before any store, so one round trip to
  // L2 / memory per tile instead of one per load.
  constexpr int PER = BK * D / 8 / 128;
  auto load_tiles = [&](__half* dk, const __half* sk, __half* dv, const __half* sv, int k0) {
    uint4 tk[PER], tv[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * 128, r = i / (D / 8), c = (i % (D / 8)) * 8, t = k0 + r;
      const bool ok = t < a.T;
      tk[u] = ok ? __ldg(reinterpret_cast<const uint4*>(sk + static_cast<int64_t>(t) * D + c)) : make_uint4(0, 0, 0, 0);
      if (dv) tv[u] = ok ? __ldg(reinterpret_cast<const uint4*>(sv + static_cast<int64_t>(t) * D + c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = tid + u * 128, r = i / (D / 8), c = (i % (D / 8)) * 8;
      *reinterpret_cast<uint4*>(dk + r * LDH + c) = tk[u];
      if (dv) *reinterpret_cast<uint4*>(dv + r * LDH + c) = tv[u];
    }
  };
  // This warp's 16×64 scores of the tile at k0 into Ss.
  auto scores = [&]() {
#pragma unroll
    for (int n = 0; n < BK / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kd = 0; kd < NF; ++kd) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + (16 * w) * LDH + 16 * kd, LDH);
        wmma::load_matrix_sync(fb, Ks + (16 * n) * LDH + 16 * kd, LDH);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ss + (16 * w) * LDS + 16 * n, acc, LDS, wmma::mem_row_major);
    }
  };
  // Two lanes per row, 32 columns each.
  const int r = 16 * w + (lane >> 1), half_ = lane & 1, qi = q0 + r;
  const int kend = a.causal ? min(a.T, q0 + BQ) : a.T;
  auto valid = [&](int kj) { return qi < a.T && kj < a.T && (!a.causal || kj <= qi); };

  // Pass 1: the row maxima.
  float m = -INFINITY;
  for (int k0 = 0; k0 < kend; k0 += BK) {
    __syncthreads();
    load_tiles(Ks, kg, nullptr, nullptr, k0);
    __syncthreads();
    scores();
    __syncwarp();
    const float* srow = Ss + r * LDS + 32 * half_;
#pragma unroll 8
    for (int c = 0; c < 32; ++c)
      if (valid(k0 + 32 * half_ + c)) m = fmaxf(m, srow[c] * a.scale);
  }
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));

  // Pass 2: P = exp(S − m) (no rescaling needed), O += P·V in fragments, l += Σ P.
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> o[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) wmma::fill_fragment(o[f], 0.0f);
  float l = 0.0f;
  for (int k0 = 0; k0 < kend; k0 += BK) {
    __syncthreads();
    load_tiles(Ks, kg, Vs, vg, k0);
    __syncthreads();
    scores();
    __syncwarp();
    const float* srow = Ss + r * LDS + 32 * half_;
    __half* prow = Ps + r * LDP + 32 * half_;
#pragma unroll 8
    for (int c = 0; c < 32; ++c) {
      const float p = valid(k0 + 32 * half_ + c) ? __expf(srow[c] * a.scale - m) : 0.0f;
      l += p;
      prow[c] = __float2half_rn(p);
    }
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
      wmma::load_matrix_sync(fa, Ps + (16 * w) * LDP + 16 * kk, LDP);
#pragma unroll
      for (int f = 0; f < NF; ++f) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
        wmma::load_matrix_sync(fb, Vs + (16 * kk) * LDH + 16 * f, LDH);
        wmma::mma_sync(o[f], fa, fb, o[f]);
      }
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  __syncthreads();  // the K and V tiles become the output tile
#pragma unroll
  for (int f = 0; f < NF; ++f) wmma::store_matrix_sync(Os + (16 * w) * LDO + 16 * f, o[f], LDO, wmma::mem_row_major);
  __syncwarp();
  if (qi < a.T) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    OT* orow = out + static_cast<int64_t>(qi) * a.NH * D + static_cast<int64_t>(h) * D;
    for (int c = half_; c < D; c += 2) orow[c] = from_f<OT>(Os[r * LDO + c] * inv);
  }
}

// K and V of qkv (fp32) as fp16, head-major: kv16[s][h][t][d].
__global__ void stage_kv_kernel(Args a, __half* kv16) {
  const int NKV = a.NH / a.G;
  const int64_t n = static_cast<int64_t>(2) * NKV * a.T * a.D;
  for (int64_t i = threadIdx.x + static_cast<int64_t>(blockIdx.x) * blockDim.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int d = static_cast<int>(i % a.D);
    const int t = static_cast<int>((i / a.D) % a.T);
    const int hh = static_cast<int>((i / (static_cast<int64_t>(a.D) * a.T)) % NKV);
    const int sd = static_cast<int>(i / (static_cast<int64_t>(a.D) * a.T * NKV));
    kv16[i] = __float2half_rn(a.qkv[t * a.stride + (sd ? a.v_col : a.k_col) + static_cast<int64_t>(hh) * a.D + d]);
  }
}

// One warp per (query row, head); lane holds dims lane, lane + 32, ... (D ≤ 256).
template <class OT>
__global__ void attn_simple_kernel(Args a, OT* __restrict__ out) {
  const int warps = blockDim.x >> 5;
  const int i = blockIdx.x * warps + (threadIdx.x >> 5);
  const int h = blockIdx.y, kvh = h / a.G, lane = threadIdx.x & 31;
  if (i >= a.T) return;
  constexpr int MAXC = 8;
  float q[MAXC], o[MAXC];
  const float* qr = a.qkv + i * a.stride + a.q_col + static_cast<int64_t>(h) * a.D;
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    const int d = lane + 32 * c;
    q[c] = d < a.D ? qr[d] : 0.0f;
    o[c] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
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
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new), p = expf(s - m_new);
    l = l * alpha + p;
#pragma unroll
    for (int c = 0; c < MAXC; ++c) {
      const int d = lane + 32 * c;
      if (d < a.D) o[c] = o[c] * alpha + p * vr[d];
    }
    m = m_new;
  }
  OT* orow = out + static_cast<int64_t>(i) * a.NH * a.D + static_cast<int64_t>(h) * a.D;
#pragma unroll
  for (int c = 0; c < MAXC; ++c) {
    const int d = lane + 32 * c;
    if (d < a.D) orow[d] = from_f<OT>(l > 0.0f ? o[c] / l : 0.0f);
  }
}

// One warp per (query row, head) writes the row's T scores (masked = -inf).
__global__ void attn_scores_kernel(Args a, float* __restrict__ scores) {
  const int warps = blockDim.x >> 5;
  const int i = blockIdx.x * warps + (threadIdx.x >> 5);
  const int h = blockIdx.y, kvh = h / a.G, lane = threadIdx.x & 31;
  if (i >= a.T) return;
  const float* qr = a.qkv + i * a.stride + a.q_col + static_cast<int64_t>(h) * a.D;
  float* srow = scores + (static_cast<int64_t>(h) * a.T + i) * a.T;
  for (int j = 0; j < a.T; ++j) {
    if (a.causal && j > i) {
      if (lane == 0) srow[j] = -INFINITY;
      continue;
    }
    const float* kr = a.qkv + j * a.stride + a.k_col + static_cast<int64_t>(kvh) * a.D;
    float dot = 0.0f;
    for (int d = lane; d < a.D; d += 32) dot = fmaf(qr[d], kr[d], dot);
    dot = warp_sum(dot);
    if (lane == 0) srow[j] = dot * a.scale;
  }
}

Args make_args(const float* qkv, const AttnLayout& l) {
  if (l.n_kv_heads <= 0 || l.n_heads % l.n_kv_heads != 0)
    throw InternalError("attention: n_heads must be a multiple of n_kv_heads");
  return {qkv, l.row_stride, l.q_col, l.k_col, l.v_col, l.T, l.n_heads, l.n_heads / l.n_kv_heads, l.head_dim,
          l.causal ? 1 : 0, l.scale};
}

template <int D, class OT>
void launch_wmma(const Args& a, const __half* kv16, OT* out, cudaStream_t s) {
  const size_t bytes = Tile<D>::bytes;
  static bool configured = false;  // the attribute is per kernel and process
  if (!configured) {
    KV_CUDA(cudaFuncSetAttribute(attn_wmma_kernel<D, OT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(bytes)),
            "attention tile of " + std::to_string(bytes) + " bytes");
    configured = true;
  }
  dim3 grid((a.T + Tile<D>::BQ - 1) / Tile<D>::BQ, a.NH);
  attn_wmma_kernel<D, OT><<<grid, 128, bytes, s>>>(a, kv16, out);
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

void attention_prefill(const float* qkv, const AttnLayout& l, void* out, Dt odt, cudaStream_t s) {
  if (l.T == 0) return;
  const int D = l.head_dim;
  // fp16 tiles for fp16 / bf16 models; an fp32 model keeps fp32 throughout.
  const bool aligned = (reinterpret_cast<uintptr_t>(qkv) & 15) == 0 && l.row_stride % 4 == 0 && l.q_col % 4 == 0 &&
                       l.k_col % 4 == 0 && l.v_col % 4 == 0;
  if ((D != 32 && D != 64 && D != 128) || odt == Dt::F32 || !aligned)
    return attention_prefill_simple(qkv, l, out, odt, s);
  const Args a = make_args(qkv, l);
  const int64_t n = static_cast<int64_t>(2) * l.n_kv_heads * l.T * D;
  void* kv16 = nullptr;
  KV_CUDA(cudaMallocAsync(&kv16, static_cast<size_t>(n) * 2, s), "attention K/V staging (" + mib(n * 2) + ")");
  stage_kv_kernel<<<static_cast<int>(std::min<int64_t>((n + 255) / 256, 8192)), 256, 0, s>>>(a, static_cast<__half*>(kv16));
  KV_LAUNCH("stage_kv_kernel", std::to_string(l.T) + " tokens");
  dispatch_float(odt, [&](auto t) {
    using OT = decltype(t);
    if (D == 32) launch_wmma<32>(a, static_cast<const __half*>(kv16), static_cast<OT*>(out), s);
    else if (D == 64) launch_wmma<64>(a, static_cast<const __half*>(kv16), static_cast<OT*>(out), s);
    else launch_wmma<128>(a, static_cast<const __half*>(kv16), static_cast<OT*>(out), s);
  });
  cudaFreeAsync(kv16, s);
  KV_LAUNCH("attn_wmma_kernel", std::to_string(l.T) + " tokens x " + std::to_string(l.n_heads) + " heads, D=" +
                                    std::to_string(D));
}

void attention_scores(const float* qkv, const AttnLayout& l, float* scores, cudaStream_t s) {
  if (l.T == 0) return;
  const Args a = make_args(qkv, l);
  dim3 grid((l.T + 3) / 4, l.n_heads);
  attn_scores_kernel<<<grid, 128, 0, s>>>(a, scores);
  KV_LAUNCH("attn_scores_kernel", std::to_string(l.T) + " tokens");
}

}  // namespace kvlens::cuda
