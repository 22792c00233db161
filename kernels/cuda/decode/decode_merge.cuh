// The end of a decode-attention block and the merge of split states (included by
// decode_attention.cu, inside its anonymous namespace): a block's groups' states become the
// split's partial state, or the output itself where a head has one split; the last block of
// each head to finish, or merge_kernel, combines the splits' (m, d, o) into the head's output.
#pragma once

// Channel c of head h of sequence b's output, in the output's type.
__device__ __forceinline__ void store_out(const DecodeParams& p, int b, int h, int c, float o) {
  const int64_t at = b * p.out_stride + static_cast<int64_t>(h) * p.D + c;
  switch (p.odt) {
    case Dt::F16: static_cast<__half*>(p.out)[at] = __float2half_rn(o); break;
    case Dt::BF16: static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(o); break;
    default: static_cast<float*>(p.out)[at] = o; break;
  }
}

// A head's softmax maximum and sum, for the callers that ask for them (decode_probs) and, where
// the step's row is a kept query's, for its slot (KeptQueries::md); `writer`: the one thread of
// the head's threads that writes them; `tail_row`: the fused token's row (read before any block
// could advance the tail).
__device__ __forceinline__ void store_md(const DecodeParams& p, int64_t bh, float M, float dsum, bool writer,
                                         int tail_row) {
  if (!writer) return;
  if (p.md_out) {
    p.md_out[bh * 2] = M;
    p.md_out[bh * 2 + 1] = dsum;
  }
  if (p.keep.md) {
    const int row = p.fresh_k ? tail_row : (p.keep.counter ? *p.keep.counter - 1 : -1);
    const int slot = row >= 0 && row < p.keep.rows ? p.keep.slot[row] : -1;
    if (slot >= 0) {
      float* o = p.keep.md + (static_cast<int64_t>(slot) * p.NH + bh % p.NH) * 2;
      o[0] = M;
      o[1] = dsum;
    }
  }
}

// Merges the splits' states (m, d, o) of head h of sequence b into its output (L2 reads: the
// other blocks' states may have been written moments ago), by threads tid of nt (the block's;
// the GQA kernel merges its heads with merge_group, decode_gqa.cuh); `tail_row` as store_md
// takes it.
__device__ void merge_head(const DecodeParams& p, int b, int h, int tid, int nt, int tail_row) {
  const int64_t bh = static_cast<int64_t>(b) * p.NH + h;
  const float2* md = reinterpret_cast<const float2*>(p.part_md) + bh * p.splits;
  const float* po = p.part_o + bh * p.splits * p.D;
  const int n = p.splits;
  // The merge is the last thing the kernel does, so its steps are the kernel's tail. Each thread
  // merges its channels on its own: it reads every split's (m, d) itself (the same words in every
  // lane: one request a warp) at once with its first channel's outputs of the first kPre splits,
  // so the merge is one trip to L2 and a short chain of arithmetic, with no barrier or shuffle
  // (block-wide reductions of the maximum and the sum took most of a head's tail on an H100).
  // Splits past the first kPre (fp16 at batch 16 and long contexts: 32 or 128) are read by loops
  // unrolled by 16, so that their loads too are in flight together; each thread recomputes their
  // weights rather than sharing them through shared memory (a second, block-wide path for them
  // made every batch-1 call 1–3 % slower on an H100).
  constexpr int kPre = 16;
  float2 mw[kPre];
  float pre[kPre];
#pragma unroll
  for (int i = 0; i < kPre; ++i) {
    mw[i] = i < n ? __ldcg(md + i) : make_float2(-INFINITY, 0.0f);
    pre[i] = tid < p.D && i < n ? __ldcg(po + i * p.D + tid) : 0.0f;
  }
  float M = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPre; ++i) M = fmaxf(M, mw[i].x);
#pragma unroll 16
  for (int i = kPre; i < n; ++i) M = fmaxf(M, __ldcg(md + i).x);
  // exp(m − M) without a branch: 0 for an empty split's m = −∞, and for every split when all are.
  const float Mf = softmax_shift(M);
  auto weight = [&](float m) { return __expf(m - Mf); };
  // Split i's weight exp(m_i − M) (mw[i].x from here on) and the weighted sum of the d_i.
  float dsum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPre; ++i) {
    mw[i].x = weight(mw[i].x);
    dsum += mw[i].y * mw[i].x;
  }
#pragma unroll 16
  for (int i = kPre; i < n; ++i) {
    const float2 v = __ldcg(md + i);
    dsum += v.y * weight(v.x);
  }
  for (int c = tid; c < p.D; c += nt) {
    float v = 0.0f;
    int i0 = 0;
    if (c == tid) {
#pragma unroll
      for (int i = 0; i < kPre; ++i) v += pre[i] * mw[i].x;
      i0 = kPre;
    }
#pragma unroll 16
    for (int i = i0; i < n; ++i) v += __ldcg(po + static_cast<int64_t>(i) * p.D + c) * weight(__ldcg(md + i).x);
    store_out(p, b, h, c, dsum > 0.0f ? v / dsum : 0.0f);
  }
  store_md(p, bh, M, dsum, tid == 0, tail_row);
}

// The end of a block of either kernel: its groups' states combined into the split's partial
// state (m, d, o); the last block of the head to finish merges every split's state. `tail_row`
// as store_md takes it (0 where no token is fused in).
template <int L>
__device__ void finish_block(const DecodeParams& p, const State& st, int b, int h, int s, int tail_row) {
  constexpr int G = kThreads / L;
  __shared__ float sh_m[G], sh_d[G];
  __shared__ float sh_o[G][8 * L + 1];
  const int tid = threadIdx.x, g = tid / L, li = tid % L;
  const int64_t bh = static_cast<int64_t>(b) * p.NH + h;
  if (li == 0) {
    sh_m[g] = st.m;
    sh_d[g] = st.d;
  }
#pragma unroll
  for (int c = 0; c < 8; ++c) sh_o[g][li * 8 + c] = st.o[c];
  __syncthreads();
  // The groups' states combined: maximum M; channel c's unnormalized output and, in dsum, their
  // sum (one exponential a group for both).
  float M = -INFINITY;
  for (int i = 0; i < G; ++i) M = fmaxf(M, sh_m[i]);
  // An empty group (m = −∞, d = 0, o = 0) gets weight exp(−∞) = 0 without a branch.
  const float Mf = softmax_shift(M);
  auto combine = [&](int c, float& dsum) {
    float v = 0.0f, d = 0.0f;
    for (int i = 0; i < G; ++i) {
      const float w = __expf(sh_m[i] - Mf);
      v += sh_o[i][c] * w;
      d += sh_d[i] * w;
    }
    dsum = d;
    return v;
  };
  float dsum = 0.0f;  // (thread 0's, from its channel 0)
  if (p.sem && p.splits == 1) {
    // The block holds the head's whole state: its output is written here, without the partial
    // state's trip through L2, the fence and the counter that a merge needs.
    for (int c = tid; c < p.D; c += kThreads) {
      float d;
      const float v = combine(c, d);
      if (c == tid) dsum = d;
      store_out(p, b, h, c, d > 0.0f ? v / d : 0.0f);
    }
    store_md(p, bh, M, dsum, tid == 0, tail_row);
    return;
  }
  float* po = p.part_o + (bh * p.splits + s) * p.D;
  for (int c = tid; c < p.D; c += kThreads) {
    float d;
    po[c] = combine(c, d);
    if (c == tid) dsum = d;
  }
  if (tid == 0) reinterpret_cast<float2*>(p.part_md)[bh * p.splits + s] = make_float2(M, dsum);
  if (!p.sem) return;
  // The block's writes, ordered before thread 0's count by the barrier, are released by it at
  // device scope; the last block's count acquires every other block's (PTX fences and barriers
  // are cumulative), so no thread needs a sequentially consistent fence of its own.
  __shared__ int last;
  __syncthreads();
  if (tid == 0) last = atomic_add_acq_rel(p.sem + bh, 1) == p.splits - 1;
  __syncthreads();
  if (!last) return;
  merge_head(p, b, h, tid, kThreads, tail_row);
  if (tid == 0) {
    p.sem[bh] = 0;
    if (p.claim) p.claim[bh] = 0;  // every block's last claim is ordered before its count
  }
}
