// Decode attention over an all-fp16 cache under grouped-query attention, on tensor cores
// (DecodeParams::f16_gqa, decode_launch says when): included by decode_attention.cu after
// decode_f16.cuh and decode_merge.cuh, inside its anonymous namespace.
//
// The other fp16 kernels give every query head its own blocks and lanes, so under GQA R:1 each
// cached row is read R times and every score and output channel is an fp32 multiply-add of its
// own: at a few thousand rows a head that is instruction-bound, not memory-bound. Here a block
// takes a KV head's range of rows for all R ≤ 8 query heads of its group, FlashAttention-2
// style with the heads as the rows of the tile:
// - grid (split, KV head, sequence), 4 warps; the block's rows go to a ring of kDecodeGqaStages
//   shared-memory stages of kDecodeGqaStageRows K and V rows (`cp.async`, rows past the range
//   zero-filled; rows padded by 16 bytes so that ldmatrix's 8 row addresses fall in 8 bank
//   groups), so each row leaves memory once;
// - the queries (rotated first when the step's token is fused in) are scaled by scale·log2(e)
//   and held as fp16 A fragments of mma.m16n8k16, head i in row i (rows R..15 zero);
// - each warp takes 16 rows of a stage: S = Q·Kᵀ (16×16, K fragments by ldmatrix) in fp32
//   accumulators, the online softmax per head over the quad that holds its row (exp2), P rounded
//   to fp16 straight from the accumulators into the A fragment of O += P·V (V by ldmatrix.trans);
// - at the end the warps' states (m, l, O) are joined through shared memory with the fused
//   token's row (scored in fp32), and written as the head's output (one split) or partial state;
//   the last block of a KV head to finish merges the splits of all R heads (merge_group). The
//   merge counter is that of the group's first query head.
// Against the fp32 kernels the scores carry q rounded to fp16 and P·V takes p rounded to fp16
// (relative 2^-11 each): tests/decode_kernel_case.h bounds both.
#pragma once

// c (16×8, fp32) += a (16×16, fp16: rows 0–7 in a0 / a2, rows 8–15 zero) · b (16×8, fp16).
__device__ __forceinline__ void mma_top(float (&c)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  const uint32_t a[4] = {a0, 0u, a2, 0u};
  mma16816(c, a, b0, b1);
}
// 16 bytes from global to shared memory, or zeros where !valid (src is then not read).
__device__ __forceinline__ void cp_async16_or_zero(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// The last block of a KV head to finish merges the splits' states of its R query heads into their
// outputs, the whole block at once. (A warp a head, each lane summing its channels split by split,
// waited on L2 every few splits: at 3,032 rows on an H200 that merge took 7 µs of the call's 16 at
// 16 splits and 30 of 43 at 30, while the other blocks were done in 8.)
// - The splits' outputs of the R heads go to shared memory (`buf`, the stages' buffer) by
//   cp.async, in chunks of as many splits as it holds (all of them up to 25 splits at head size
//   128 and R = 8, 50 at R = 4);
// - meanwhile a warp a head combines its splits' (m, d) online, lanes over splits, then across
//   the warp: the head's maximum M and sum Σ d_i·exp(m_i − M); the first chunk's m_i are kept;
// - each chunk's weights exp(m_i − M) are made once in shared memory, and each thread adds its
//   output channels' R·D / kDecodeGqaThreads sums over the chunk.
// One trip to L2 for the first chunk (with the (m, d) reads beside it) and one for each further
// chunk. Natural-log units, as merge_head; `tail_row` as store_md takes it.
template <int D>
__device__ void merge_group(const DecodeParams& p, int b, int h0, int R, float* buf, int buf_bytes, int tail_row) {
  constexpr int T = kDecodeGqaThreads, NW = T / 32, MAXR = kDecodeGqaMaxRatio;
  constexpr int OUT = (MAXR * D + T - 1) / T;  // output channels a thread, at most
  __shared__ float sh_mf[MAXR], sh_ds[MAXR], sh_m[MAXR];
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, n = p.splits;
  const int64_t bh0 = static_cast<int64_t>(b) * p.NH + h0;
  // The R heads' states are consecutive: (m, d) of head hi's split i at [hi·n + i], its output's
  // channel c at [(hi·n + i)·D + c].
  const float2* md = reinterpret_cast<const float2*>(p.part_md) + bh0 * n;
  const float* po = p.part_o + bh0 * n * D;
  const int C = min(n, buf_bytes / (R * (D + 1) * 4));  // splits a chunk
  float* so = buf;               // [R][C][D] outputs
  float* sw = buf + R * C * D;   // [R][C] m_i, then weights
  auto issue = [&](int i0) {
    const int c = min(C, n - i0), per = c * (D / 4);
    for (int x = tid; x < R * per; x += T) {
      const int hi = x / per, i = (x % per) / (D / 4), q = x % (D / 4);
      cp_async16(smem_addr(so + (hi * C + i) * D + q * 4), po + (static_cast<int64_t>(hi) * n + i0 + i) * D + q * 4);
    }
    cp_async_commit();
  };
  issue(0);
  for (int hi = w; hi < R; hi += NW) {
    float m = -INFINITY, d = 0.0f;
    auto join = [](float& m, float& d, float m2, float d2) {
      const float nm = fmaxf(m, m2), sh = softmax_shift(nm);
      d = d * __expf(m - sh) + d2 * __expf(m2 - sh);
      m = nm;
    };
    for (int i0 = 0; i0 < n; i0 += 4 * 32) {
      float2 v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = i0 + k * 32 + lane;
        v[k] = i < n ? __ldcg(md + hi * n + i) : make_float2(-INFINITY, 0.0f);
        if (i < C) sw[hi * C + i] = v[k].x;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) join(m, d, v[k].x, v[k].y);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) join(m, d, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, d, off));
    if (lane == 0) {
      sh_m[hi] = m;
      sh_mf[hi] = softmax_shift(m);
      sh_ds[hi] = d;
    }
  }
  float acc[OUT];
#pragma unroll
  for (int j = 0; j < OUT; ++j) acc[j] = 0.0f;
  for (int i0 = 0; i0 < n; i0 += C) {
    const int c = min(C, n - i0);
    if (i0 > 0)
      for (int x = tid; x < R * c; x += T) sw[(x / c) * C + x % c] = __ldcg(md + (x / c) * n + i0 + x % c).x;
    cp_async_wait_all();
    __syncthreads();  // the chunk's outputs and m_i, and every head's M and sum, are in
    for (int x = tid; x < R * c; x += T) {
      float& v = sw[(x / c) * C + x % c];
      v = __expf(v - sh_mf[x / c]);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < OUT; ++j) {
      const int o = tid + j * T, hi = o / D, ch = o % D;
      if (o < R * D)
        for (int i = 0; i < c; ++i) acc[j] += so[(hi * C + i) * D + ch] * sw[hi * C + i];
    }
    __syncthreads();  // every thread is done with the chunk before the next one lands
    if (i0 + C < n) issue(i0 + C);
  }
#pragma unroll
  for (int j = 0; j < OUT; ++j) {
    const int o = tid + j * T, hi = o / D, ch = o % D;
    if (o < R * D) {
      const float ds = sh_ds[hi];
      store_out(p, b, h0 + hi, ch, ds > 0.0f ? acc[j] / ds : 0.0f);
      store_md(p, bh0 + hi, sh_m[hi], ds, ch == 0, tail_row);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kDecodeGqaThreads, kDecodeGqaBlocks) decode_f16_gqa_kernel(DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int L = D / 8;                 // 16-byte chunks a row
  constexpr int SR = kDecodeGqaStageRows;  // rows a stage: 16 a warp
  constexpr int NS = kDecodeGqaStages, NW = kDecodeGqaThreads / 32;
  constexpr int PITCH = D + 8;  // halves a staged row
  constexpr int KS = D / 16, NT = D / 8;  // k-steps of Q·Kᵀ; 8-channel tiles of O
  constexpr int MAXR = kDecodeGqaMaxRatio;
  static_assert(SR == 16 * NW, "a warp takes 16 rows of a stage");
  extern __shared__ __align__(16) __half gqa_stg[];  // NS stages: SR K rows, then SR V rows
  __shared__ F16Parts parts;
  __shared__ float sh_q[MAXR][D];  // the queries, rotated, scaled by scale·log2(e)
  __shared__ float sh_tk[D], sh_tv[D];  // the fused token's K (rotated) and V, as stored (fp16)
  __shared__ float sh_ts[MAXR];         // its score for each head (log2 units)
  auto& sh_k = parts.k;
  auto& sh_v = parts.v;
  auto& sh_end = parts.end;  // rows, then cumulative rows
  const int R = p.NH / p.NKV;
  const int s = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, w = tid / 32, lane = tid % 32, gq = lane / 4, tq = lane % 4;
  const int bk = b * p.NKV + kvh, h0 = kvh * R;
  // As in decode_f16_kernel: with the token fused in (or rows_ready) nothing about the cached rows
  // is written by the kernel this one follows, so the table is read and the first stages are
  // issued before the wait.
  const bool fresh = p.fresh_k != nullptr;
  const bool early = fresh || p.rows_ready;
  if (!early) pdl_wait();
  const int np = read_f16_parts(p, bk, tid, parts);
  const int tail_row = fresh ? *p.tail_counter : 0;
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < np; ++i) sh_end[i] += sh_end[i - 1];
  __syncthreads();
  const int n_cache = np > 0 ? sh_end[np - 1] : 0;
  const int N = n_cache + (fresh ? 1 : 0);
  const int chunk = (N + p.splits - 1) / p.splits;
  const int r0 = min(N, s * chunk), r1 = min(N, r0 + chunk);
  const int cached_end = min(r1, n_cache);
  const int nst = (max(cached_end - r0, 0) + SR - 1) / SR;  // the block's stages
  const uint32_t stg = smem_addr(gqa_stg);
  constexpr uint32_t kStageBytes = 2 * SR * PITCH * 2, kSideBytes = SR * PITCH * 2;
  // Stage k's rows into buffer k mod NS (rows past the block's range as zeros); one commit group
  // a stage (empty past the block's stages), so that waiting for all but the newest NS − 2
  // groups waits for stage k.
  auto issue = [&](int k) {
    if (k < nst) {
      const int j0 = r0 + k * SR;
      const uint32_t dst = stg + (k % NS) * kStageBytes;
      int pi = 0;
      for (int c = tid; c < SR * L; c += kDecodeGqaThreads) {
        const int row = c / L, ch = c % L, j = j0 + row;
        const bool valid = j < cached_end;
        const __half* kp = sh_k[0];
        const __half* vp = sh_v[0];
        if (valid) {
          while (j >= sh_end[pi]) ++pi;
          const int64_t at = static_cast<int64_t>(j - (pi ? sh_end[pi - 1] : 0)) * D + ch * 8;
          kp = sh_k[pi] + at;
          vp = sh_v[pi] + at;
        }
        const uint32_t off = (row * PITCH + ch * 8) * 2;
        cp_async16_or_zero(dst + off, kp, valid);
        cp_async16_or_zero(dst + kSideBytes + off, vp, valid);
      }
    }
    cp_async_commit();
  };
  if (early)
    for (int k = 0; k < NS - 1; ++k) issue(k);
  pdl_wait();
  if (!early)
    for (int k = 0; k < NS - 1; ++k) issue(k);
  // The next kernel (the o product, which starts its weight reads early) is let in once the
  // block's last stage is in flight.
  if (nst <= NS - 1) pdl_trigger();

  // The queries as fp32 in shared memory: rotated (RoPE at the token's position, channel c with
  // c + D/2, as rope8 computes it) when the token is fused in, then scaled; the token's K and V.
  const float qscale = p.scale * 1.4426950408889634f;
  const float pos = fresh ? static_cast<float>(*p.fresh_pos) : 0.0f;
  for (int i = tid; i < R * (D / 2); i += kDecodeGqaThreads) {
    const int hi = i / (D / 2), c = i % (D / 2);
    const float* qrow = p.q + b * p.q_stride + static_cast<int64_t>(h0 + hi) * D;
    float x = qrow[c], y = qrow[c + D / 2];
    if (fresh) {
      float sn, cs;
      sincosf(pos * p.inv_freq[c], &sn, &cs);
      const float x2 = rope_first(x, y, sn, cs), y2 = rope_second(x, y, sn, cs);
      x = x2;
      y = y2;
    }
    sh_q[hi][c] = x * qscale;
    sh_q[hi][c + D / 2] = y * qscale;
  }
  if (fresh) {
    for (int c = tid; c < D / 2; c += kDecodeGqaThreads) {
      const float x = p.fresh_k[kvh * D + c], y = p.fresh_k[kvh * D + c + D / 2];
      float sn, cs;
      sincosf(pos * p.inv_freq[c], &sn, &cs);
      sh_tk[c] = __half2float(__float2half_rn(rope_first(x, y, sn, cs)));
      sh_tk[c + D / 2] = __half2float(__float2half_rn(rope_second(x, y, sn, cs)));
    }
    for (int c = tid; c < D; c += kDecodeGqaThreads) sh_tv[c] = __half2float(__float2half_rn(p.fresh_v[kvh * D + c]));
  }
  __syncthreads();
  if (fresh) {
    // Split 0 writes the row to the tail at the row every block read; the counter then advances.
    if (s == 0 && tail_row < p.tail_cap)
      for (int c = tid; c < D; c += kDecodeGqaThreads) {
        const int64_t at = (static_cast<int64_t>(kvh) * p.tail_cap + tail_row) * D + c;
        p.tail_k[at] = __float2half_rn(sh_tk[c]);
        p.tail_v[at] = __float2half_rn(sh_tv[c]);
        if (c == 0) p.tail_pos[static_cast<int64_t>(kvh) * p.tail_cap + tail_row] = *p.fresh_pos;
      }
    advance_tail(p, tid, tail_row);
  }
  // Q's A fragments: row gq (head gq, zero past R), channels kk·16 + 2·tq (+1) and + 8 (+9).
  uint32_t qa[KS][2];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const bool on = gq < R;
    const float* qr = sh_q[on ? gq : 0] + kk * 16 + 2 * tq;
    qa[kk][0] = on ? half2_bits(qr[0], qr[1]) : 0u;
    qa[kk][1] = on ? half2_bits(qr[8], qr[9]) : 0u;
  }

  float o[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  float m_run = -INFINITY, l_run = 0.0f;  // head gq's (log2 units; l: this lane's share)
  // ldmatrix row addresses: matrix i = lane / 8, row lane % 8 of it.
  const int mi = lane / 8, mr = lane % 8;
  for (int k = 0; k < nst; ++k) {
    cp_async_wait<NS - 2>();
    __syncthreads();  // stage k landed for every thread; every warp is past stage k − 1's buffer
    issue(k + NS - 1);
    if (k + NS - 1 == nst - 1) pdl_trigger();
    const int j0 = r0 + k * SR + w * 16;  // the warp's first row
    if (j0 >= cached_end) continue;
    const uint32_t kb = stg + (k % NS) * kStageBytes, vb = kb + kSideBytes;
    // S = Q·Kᵀ for the warp's 16 rows: two 8-row tiles. K's matrices: rows (i / 2)·8 + r,
    // channels kk·16 + (i % 2)·8 → b0, b1 of tile 0, then of tile 1.
    float sc[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      uint32_t r[4];
      ldsm_x4(r, kb + (((w * 16 + (mi / 2) * 8 + mr) * PITCH) + kk * 16 + (mi % 2) * 8) * 2);
      mma_top(sc[0], qa[kk][0], qa[kk][1], r[0], r[1]);
      mma_top(sc[1], qa[kk][0], qa[kk][1], r[2], r[3]);
    }
    // Head gq's scores of rows j0 + n·8 + 2·tq (+1); the quad holds the head's 16.
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (j0 + n * 8 + 2 * tq + e >= cached_end) sc[n][e] = -INFINITY;
        mx = fmaxf(mx, sc[n][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx), shift = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = fast_exp2(m_run - shift);
    m_run = m_new;
    float pr[2][2];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) pr[n][e] = fast_exp2(sc[n][e] - shift);
    l_run = l_run * alpha + (pr[0][0] + pr[0][1] + pr[1][0] + pr[1][1]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      o[t][0] *= alpha;
      o[t][1] *= alpha;
    }
    // O += P·V: P's A fragment is the two score tiles' accumulators (rows 8–15 zero); V's
    // matrices by ldmatrix.trans: rows (i % 2)·8 + r, channels x·16 + (i / 2)·8 → b0, b1 of
    // channel tile 2x, then of 2x + 1.
    const uint32_t pa0 = half2_bits(pr[0][0], pr[0][1]), pa2 = half2_bits(pr[1][0], pr[1][1]);
#pragma unroll
    for (int x = 0; x < NT / 2; ++x) {
      uint32_t r[4];
      ldsm_x4_trans(r, vb + (((w * 16 + (mi % 2) * 8 + mr) * PITCH) + x * 16 + (mi / 2) * 8) * 2);
      mma_top(o[2 * x], pa0, pa2, r[0], r[1]);
      mma_top(o[2 * x + 1], pa0, pa2, r[2], r[3]);
    }
  }
  cp_async_wait_all();  // (the empty groups past the last stage)
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  // The warps' states through shared memory (the stages' buffer, free once every warp is past
  // them): [warp][head][m, l, O].
  float* cmb = reinterpret_cast<float*>(gqa_stg);
  constexpr int CS = D + 2;
  __syncthreads();
  if (gq < R) {
    float* c = cmb + (w * MAXR + gq) * CS;
    if (tq == 0) {
      c[0] = m_run;
      c[1] = l_run;
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      c[2 + t * 8 + 2 * tq] = o[t][0];
      c[2 + t * 8 + 2 * tq + 1] = o[t][1];
    }
  }
  // The fused token's score for each head, where this block holds its row: a warp a head.
  const bool token_here = fresh && r0 <= n_cache && n_cache < r1;
  if (token_here)
    for (int hi = w; hi < R; hi += NW) {
      float d = 0.0f;
      for (int c = lane; c < D; c += 32) d = fmaf(sh_q[hi][c], sh_tk[c], d);
      d = warp_sum(d);
      if (lane == 0) sh_ts[hi] = d;
    }
  __syncthreads();
  // Each (head, channel): the warps' states and the token joined; natural-log units from here.
  constexpr float kLn2 = 0.6931471805599453f;
  for (int i = tid; i < R * D; i += kDecodeGqaThreads) {
    const int hi = i / D, c = i % D;
    float M = token_here ? sh_ts[hi] : -INFINITY;
#pragma unroll
    for (int x = 0; x < NW; ++x) M = fmaxf(M, cmb[(x * MAXR + hi) * CS]);
    const float shift = M == -INFINITY ? 0.0f : M;
    float Lsum = 0.0f, O = 0.0f;
#pragma unroll
    for (int x = 0; x < NW; ++x) {
      const float* st = cmb + (x * MAXR + hi) * CS;
      const float wgt = fast_exp2(st[0] - shift);
      Lsum += st[1] * wgt;
      O += st[2 + c] * wgt;
    }
    if (token_here) {
      const float wgt = fast_exp2(sh_ts[hi] - shift);
      Lsum += wgt;
      O += sh_tv[c] * wgt;
    }
    const int h = h0 + hi;
    const int64_t bh = static_cast<int64_t>(b) * p.NH + h;
    const float m_nat = M * kLn2;
    if (p.sem && p.splits == 1) {
      store_out(p, b, h, c, Lsum > 0.0f ? O / Lsum : 0.0f);
      store_md(p, bh, m_nat, Lsum, c == 0, tail_row);
    } else {
      p.part_o[(bh * p.splits + s) * D + c] = O;
      if (c == 0) reinterpret_cast<float2*>(p.part_md)[bh * p.splits + s] = make_float2(m_nat, Lsum);
    }
  }
  if (!p.sem || p.splits == 1) return;
  // As in finish_block: the barrier orders every thread's writes before thread 0's count, which
  // releases them; the last block's count acquires every other block's.
  __shared__ int last;
  const int64_t bh0 = static_cast<int64_t>(b) * p.NH + h0;
  __syncthreads();
  if (tid == 0) last = atomic_add_acq_rel(p.sem + bh0, 1) == p.splits - 1;
  __syncthreads();
  if (!last) return;
  merge_group<D>(p, b, h0, R, reinterpret_cast<float*>(gqa_stg), NS * kStageBytes, tail_row);
  if (tid == 0) p.sem[bh0] = 0;
#else
  __trap();  // decode_launch gives f16_gqa only on sm_90 devices (its stages pass sm_8x's 99 KiB a block)
#endif
}
