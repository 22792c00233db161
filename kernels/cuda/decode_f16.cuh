// Decode attention when every part of the cache holds fp16 rows (the full cache, and every
// evicting or merging method): included by decode_attention.cu, inside its anonymous namespace.
//
// A kernel of its own, with none of the packed paths compiled in, so it needs few registers
// (several blocks fit a multiprocessor) and a block's fixed work is short; at the contexts of a
// captioning run (hundreds of rows a head) that fixed work, not the bytes, sets the time. The
// head's part pointers are read before waiting for the previous kernel (they change only between
// steps); each group of L = D/8 lanes then takes kF16Rows rows of the block's range at a time
// (rows g, g + G, …), with every K and V load of those rows issued before the first is used.
// The group's scores, softmax and P·V stay in registers; the block ends as the general kernel's
// blocks do (finish_block: partial state, and the merge by the head's last block).
#pragma once

constexpr int kF16Rows = 8;

// RoPE of this lane's 8 channels c0.. of a D-wide row held by a group of L lanes (channel c pairs
// with c ± D/2, held by lane li ^ L/2, or by the same lane when L = 1), as rope_append_kernel
// computes it: angle pos·inv_freq[c mod D/2], a' = a·cos − b·sin, b' = b·cos + a·sin.
template <int L>
__device__ __forceinline__ void rope8(float* x, int c0, float pos, const float* inv_freq) {
  constexpr int half = 4 * L;
  float other[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    if constexpr (L == 1) other[c] = x[c ^ 4];
    else other[c] = __shfl_xor_sync(0xffffffffu, x[c], L / 2);
  }
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int ch = c0 + c;
    const bool first = ch < half;
    float sn, cs;
    sincosf(pos * inv_freq[first ? ch : ch - half], &sn, &cs);
    x[c] = first ? x[c] * cs - other[c] * sn : x[c] * cs + other[c] * sn;
  }
}

__device__ __forceinline__ uint4 pack8_f16(const float* f) {
  uint4 u;
  uint32_t* w = reinterpret_cast<uint32_t*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return u;
}

template <int L>
__global__ void __launch_bounds__(kThreads, 4) decode_f16_kernel(DecodeParams p) {
  constexpr int G = kThreads / L, U = kF16Rows, D = 8 * L;
  __shared__ const __half* sh_k[kSharedParts];
  __shared__ const __half* sh_v[kSharedParts];
  __shared__ const int32_t* sh_c[kSharedParts];
  __shared__ int sh_end[kSharedParts];  // rows, then cumulative rows
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, g = tid / L, c0 = (tid % L) * 8;
  const int bk = b * p.NKV + h / (p.NH / p.NKV);
  const PartDesc* gp = p.parts + static_cast<int64_t>(bk) * p.max_parts;
  if (tid < p.max_parts) {
    sh_k[tid] = static_cast<const __half*>(gp[tid].k.data);
    sh_v[tid] = static_cast<const __half*>(gp[tid].v.data);
    sh_c[tid] = gp[tid].counter;
    sh_end[tid] = gp[tid].n;
  }
  pdl_wait();
  pdl_trigger();  // the next product may start its weight reads
  const int np = p.n_parts[bk];
  const int kvh = h / (p.NH / p.NKV);
  float q[8];
  const float* qrow = p.q + b * p.q_stride + static_cast<int64_t>(h) * D + c0;
#pragma unroll
  for (int c = 0; c < 8; ++c) q[c] = qrow[c];
  // The step's token, when fused in: q and its k rotated, its K and V rows as fp16.
  const bool fresh = p.fresh_k != nullptr;
  uint4 fk = make_uint4(0, 0, 0, 0), fv = fk;
  int tail_row = 0;
  if (fresh) {
    const float pos = static_cast<float>(*p.fresh_pos);
    float k[8], v[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      k[c] = p.fresh_k[kvh * D + c0 + c];
      v[c] = p.fresh_v[kvh * D + c0 + c];
    }
    rope8<L>(q, c0, pos, p.inv_freq);
    rope8<L>(k, c0, pos, p.inv_freq);
    fk = pack8_f16(k);
    fv = pack8_f16(v);
    tail_row = *p.tail_counter;
  }
#pragma unroll
  for (int c = 0; c < 8; ++c) q[c] *= p.scale;
  __syncthreads();
  if (tid < np && sh_c[tid]) sh_end[tid] += *sh_c[tid];  // rows appended during decode
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < np; ++i) sh_end[i] += sh_end[i - 1];
  __syncthreads();
  const int n_cache = np > 0 ? sh_end[np - 1] : 0;  // the token's row, when fused, follows them
  const int N = n_cache + (fresh ? 1 : 0);
  if (fresh) {
    // One block a KV head writes the token's row; the last block to have read the counter
    // advances it (every block read it above, before its barrier).
    if (s == 0 && h % (p.NH / p.NKV) == 0 && g == 0 && tail_row < p.tail_cap) {
      const int64_t at = (static_cast<int64_t>(kvh) * p.tail_cap + tail_row) * D + c0;
      *reinterpret_cast<uint4*>(p.tail_k + at) = fk;
      *reinterpret_cast<uint4*>(p.tail_v + at) = fv;
      if (c0 == 0) p.tail_pos[static_cast<int64_t>(kvh) * p.tail_cap + tail_row] = *p.fresh_pos;
    }
    if (tid == 0 && atomicAdd(p.tail_done, 1) == static_cast<int>(gridDim.x * gridDim.y * gridDim.z) - 1) {
      *p.tail_counter = tail_row + 1;
      *p.tail_done = 0;
    }
  }
  const int chunk = (N + p.splits - 1) / p.splits;
  const int r0 = min(N, s * chunk), r1 = min(N, r0 + chunk);

  State st;
  for (int j0 = r0; j0 < r1; j0 += G * U) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * G + g;
      if (j == n_cache) {  // the fused token's row (only when fresh: n_cache < N)
        kr[u] = fk;
        vr[u] = fv;
      } else if (j < r1) {
        int pi = 0;
        while (j >= sh_end[pi]) ++pi;
        const int64_t at = static_cast<int64_t>(j - (pi ? sh_end[pi - 1] : 0)) * D + c0;
        kr[u] = __ldg(reinterpret_cast<const uint4*>(sh_k[pi] + at));
        vr[u] = __ldg(reinterpret_cast<const uint4*>(sh_v[pi] + at));
      } else {
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
    f16_update<L, U>(kr, vr, q, j0 + g, G, r1, false, 1.0f, 0.0f, 0.0f, st);
  }
  finish_block<L>(p, st, b, h, s);
}
