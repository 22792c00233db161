// Prefill / vision attention: tiled, one online softmax per query row, never materializing the
// T×T scores. CPU twin: cpu::attention_head.
//
// Tensor-core kernel (head_dim 32, 64, 128): a block of 4 warps takes 64 query rows of one head;
// for each tile of 64 keys it stages K and V as fp16 in shared memory, each warp computes its
// 16×64 scores with WMMA (fp16 in, fp32 out), applies the mask and the online softmax update
// row by row, and adds P·V (WMMA again) into an fp32 output tile kept in shared memory, which
// the running-max rescale multiplies first. Other head sizes, and fp32 models, use the simple
// kernel: one warp per query row, fp32 throughout.
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
  static constexpr int LDO = D + 4;   // floats
  static constexpr size_t q_off = 0;
  static constexpr size_t k_off = q_off + sizeof(__half) * BQ * LDH;
  static constexpr size_t v_off = k_off + sizeof(__half) * BK * LDH;
  static constexpr size_t s_off = v_off + sizeof(__half) * BK * LDH;
  static constexpr size_t p_off = s_off + sizeof(float) * BQ * LDS;
  static constexpr size_t o_off = p_off + sizeof(__half) * BQ * LDP;
  static constexpr size_t t_off = o_off + sizeof(float) * BQ * LDO;
  static constexpr size_t r_off = t_off + sizeof(float) * BQ * LDO;
  static constexpr size_t bytes = r_off + sizeof(float) * 3 * BQ;
};

template <int D, class OT>
__global__ void __launch_bounds__(128) attn_wmma_kernel(Args a, OT* __restrict__ out) {
  using TL = Tile<D>;
  constexpr int BQ = TL::BQ, BK = TL::BK, LDH = TL::LDH, LDS = TL::LDS, LDP = TL::LDP, LDO = TL::LDO;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* Qs = reinterpret_cast<__half*>(smem + TL::q_off);
  __half* Ks = reinterpret_cast<__half*>(smem + TL::k_off);
  __half* Vs = reinterpret_cast<__half*>(smem + TL::v_off);
  float* Ss = reinterpret_cast<float*>(smem + TL::s_off);
  __half* Ps = reinterpret_cast<__half*>(smem + TL::p_off);
  float* Os = reinterpret_cast<float*>(smem + TL::o_off);
  float* Ts = reinterpret_cast<float*>(smem + TL::t_off);
  float* mrow = reinterpret_cast<float*>(smem + TL::r_off);
  float* lrow = mrow + BQ;
  float* arow = lrow + BQ;

  const int q0 = blockIdx.x * BQ, h = blockIdx.y, kvh = h / a.G;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
  const float* qbase = a.qkv + a.q_col + static_cast<int64_t>(h) * D;
  const float* kbase = a.qkv + a.k_col + static_cast<int64_t>(kvh) * D;
  const float* vbase = a.qkv + a.v_col + static_cast<int64_t>(kvh) * D;

  // Tiles are read as float4 (rows of q/k/v are 16-byte aligned: D and the columns are
  // multiples of 4) and stored as fp16 pairs.
  for (int i = tid; i < BQ * D / 4; i += blockDim.x) {
    const int r = i / (D / 4), c = (i % (D / 4)) * 4;
    const int t = q0 + r;
    const float4 v = t < a.T ? *reinterpret_cast<const float4*>(qbase + t * a.stride + c) : make_float4(0, 0, 0, 0);
    *reinterpret_cast<__half2*>(Qs + r * LDH + c) = __floats2half2_rn(v.x, v.y);
    *reinterpret_cast<__half2*>(Qs + r * LDH + c + 2) = __floats2half2_rn(v.z, v.w);
    *reinterpret_cast<float4*>(Os + r * LDO + c) = make_float4(0, 0, 0, 0);
  }
  if (tid < BQ) {
    mrow[tid] = -INFINITY;
    lrow[tid] = 0.0f;
  }
  __syncthreads();

  const int kend = a.causal ? min(a.T, q0 + BQ) : a.T;
  for (int k0 = 0; k0 < kend; k0 += BK) {
    for (int i = tid; i < BK * D / 4; i += blockDim.x) {
      const int r = i / (D / 4), c = (i % (D / 4)) * 4;
      const int t = k0 + r;
      const bool ok = t < a.T;
      const float4 k = ok ? *reinterpret_cast<const float4*>(kbase + t * a.stride + c) : make_float4(0, 0, 0, 0);
      const float4 v = ok ? *reinterpret_cast<const float4*>(vbase + t * a.stride + c) : make_float4(0, 0, 0, 0);
      *reinterpret_cast<__half2*>(Ks + r * LDH + c) = __floats2half2_rn(k.x, k.y);
      *reinterpret_cast<__half2*>(Ks + r * LDH + c + 2) = __floats2half2_rn(k.z, k.w);
      *reinterpret_cast<__half2*>(Vs + r * LDH + c) = __floats2half2_rn(v.x, v.y);
      *reinterpret_cast<__half2*>(Vs + r * LDH + c + 2) = __floats2half2_rn(v.z, v.w);
    }
    __syncthreads();
    // S = Q·Kᵀ for this warp's 16 rows.
    for (int n = 0; n < BK / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kd = 0; kd < D / 16; ++kd) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + (16 * w) * LDH + 16 * kd, LDH);
        wmma::load_matrix_sync(fb, Ks + (16 * n) * LDH + 16 * kd, LDH);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ss + (16 * w) * LDS + 16 * n, acc, LDS, wmma::mem_row_major);
    }
    __syncwarp();
    // Online softmax: two lanes per row, 32 columns each.
    {
      const int r = 16 * w + (lane >> 1), half_ = lane & 1;
      const int qi = q0 + r;
      float* srow = Ss + r * LDS + 32 * half_;
      float mx = -INFINITY;
      float sv[32];
#pragma unroll
      for (int c = 0; c < 32; ++c) {
        const int kj = k0 + 32 * half_ + c;
        const bool valid = qi < a.T && kj < a.T && (!a.causal || kj <= qi);
        sv[c] = valid ? srow[c] * a.scale : -INFINITY;
        mx = fmaxf(mx, sv[c]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      const float m_old = mrow[r];
      const float m_new = fmaxf(m_old, mx);
      float alpha = 1.0f, sum = 0.0f;
      __half* prow = Ps + r * LDP + 32 * half_;
      if (m_new == -INFINITY) {
#pragma unroll
        for (int c = 0; c < 32; ++c) prow[c] = __float2half_rn(0.0f);
      } else {
        alpha = expf(m_old - m_new);
#pragma unroll
        for (int c = 0; c < 32; ++c) {
          const float p = expf(sv[c] - m_new);
          sum += p;
          prow[c] = __float2half_rn(p);
        }
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      __syncwarp();
      if (half_ == 0) {
        mrow[r] = m_new;
        lrow[r] = lrow[r] * alpha + sum;
        arow[r] = alpha;
      }
    }
    __syncwarp();
    // T = P·V for this warp's rows, then O = O·alpha + T.
    for (int dn = 0; dn < D / 16; ++dn) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, Ps + (16 * w) * LDP + 16 * kk, LDP);
        wmma::load_matrix_sync(fb, Vs + (16 * kk) * LDH + 16 * dn, LDH);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ts + (16 * w) * LDO + 16 * dn, acc, LDO, wmma::mem_row_major);
    }
    __syncwarp();
    for (int i = lane; i < 16 * D; i += 32) {
      const int r = 16 * w + i / D, c = i % D;
      Os[r * LDO + c] = Os[r * LDO + c] * arow[r] + Ts[r * LDO + c];
    }
    __syncthreads();  // Ks / Vs are overwritten next
  }
  for (int i = tid; i < BQ * D; i += blockDim.x) {
    const int r = i / D, c = i % D;
    const int t = q0 + r;
    if (t >= a.T) continue;
    const float l = lrow[r];
    out[static_cast<int64_t>(t) * a.NH * D + static_cast<int64_t>(h) * D + c] =
        from_f<OT>(l > 0.0f ? Os[r * LDO + c] / l : 0.0f);
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
void launch_wmma(const Args& a, OT* out, cudaStream_t s) {
  const size_t bytes = Tile<D>::bytes;
  static bool configured = false;  // the attribute is per kernel and process
  if (!configured) {
    KV_CUDA(cudaFuncSetAttribute(attn_wmma_kernel<D, OT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(bytes)),
            "attention tile of " + std::to_string(bytes) + " bytes");
    configured = true;
  }
  dim3 grid((a.T + Tile<D>::BQ - 1) / Tile<D>::BQ, a.NH);
  attn_wmma_kernel<D, OT><<<grid, 128, bytes, s>>>(a, out);
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
  dispatch_float(odt, [&](auto t) {
    using OT = decltype(t);
    if (D == 32) launch_wmma<32>(a, static_cast<OT*>(out), s);
    else if (D == 64) launch_wmma<64>(a, static_cast<OT*>(out), s);
    else launch_wmma<128>(a, static_cast<OT*>(out), s);
  });
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
