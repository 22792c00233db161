// The end of a decode-attention block and the merge of split states (included by
// decode_attention.cu, inside its anonymous namespace): a block's groups' states become the
// split's partial state, or the output itself where a head has one split; the last block of
// each head to finish, or merge_kernel, combines the splits' (m, d, o) into the head's output.
#pragma once

// Merges the splits' states (m, d, o) of head h of sequence b into its output (L2 reads: the
// other blocks' states may have been written moments ago). Every split's weight exp(m_i − M) is
// computed once, in parallel, into shared memory; the channels then sum with many loads in flight.
constexpr int kMaxSplits = kDecodeMaxSplits;

__device__ float block_reduce(float v, bool is_max, float* red) {
  v = is_max ? warp_max(v) : warp_sum(v);
  __syncthreads();  // red may still be read by a previous reduction
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) v = is_max ? fmaxf(v, red[w]) : v + red[w];
  return v;
}

// Channel c of head h of sequence b's output, in the output's type.
__device__ __forceinline__ void store_out(const DecodeParams& p, int b, int h, int c, float o) {
  const int64_t at = b * p.out_stride + static_cast<int64_t>(h) * p.D + c;
  switch (p.odt) {
    case Dt::F16: static_cast<__half*>(p.out)[at] = __float2half_rn(o); break;
    case Dt::BF16: static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(o); break;
    default: static_cast<float*>(p.out)[at] = o; break;
  }
}

// A head's softmax maximum and sum, for the callers that ask for them (decode_probs).
__device__ __forceinline__ void store_md(const DecodeParams& p, int64_t bh, float M, float dsum) {
  if (p.md_out && threadIdx.x == 0) {
    p.md_out[bh * 2] = M;
    p.md_out[bh * 2 + 1] = dsum;
  }
}

__device__ void merge_head(const DecodeParams& p, int b, int h) {
  __shared__ float wsh[kMaxSplits];
  __shared__ float red[32];
  const int64_t bh = static_cast<int64_t>(b) * p.NH + h;
  const float2* md = reinterpret_cast<const float2*>(p.part_md) + bh * p.splits;
  const float* po = p.part_o + bh * p.splits * p.D;
  const int tid = threadIdx.x, nt = blockDim.x;
  // The merge is the last thing the kernel does, so its trips to L2 are the kernel's tail: they
  // are made at once — each thread's splits' (m, d), and for its first channel the outputs of
  // the first kPre splits — rather than one after another.
  constexpr int kPre = 16;
  float pre[kPre];
#pragma unroll
  for (int i = 0; i < kPre; ++i) pre[i] = tid < p.D && i < p.splits ? __ldcg(po + i * p.D + tid) : 0.0f;
  float M = -INFINITY;
  float2 own = make_float2(-INFINITY, 0.0f);  // split tid's (m, d)
  for (int i = tid; i < p.splits; i += nt) {
    const float2 v = __ldcg(md + i);
    if (i == tid) own = v;
    wsh[i] = v.x;
    M = fmaxf(M, v.x);
  }
  M = block_reduce(M, true, red);
  float dsum = 0.0f;
  for (int i = tid; i < p.splits; i += nt) {
    const float2 v = i == tid ? own : __ldcg(md + i);
    const float w = v.x == -INFINITY ? 0.0f : __expf(v.x - M);
    dsum += v.y * w;
    wsh[i] = w;
  }
  dsum = block_reduce(dsum, false, red);  // (its barriers also publish wsh)
  for (int c = tid; c < p.D; c += nt) {
    float v = 0.0f;
    int i0 = 0;
    if (c == tid) {
#pragma unroll
      for (int i = 0; i < kPre; ++i)
        if (i < p.splits) v += pre[i] * wsh[i];
      i0 = kPre;
    }
#pragma unroll 8
    for (int i = i0; i < p.splits; ++i) v += __ldcg(po + static_cast<int64_t>(i) * p.D + c) * wsh[i];
    store_out(p, b, h, c, dsum > 0.0f ? v / dsum : 0.0f);
  }
  store_md(p, bh, M, dsum);
}

// The end of a block of either kernel: its groups' states combined into the split's partial
// state (m, d, o); the last block of the head to finish merges every split's state.
template <int L>
__device__ void finish_block(const DecodeParams& p, const State& st, int b, int h, int s) {
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
  // The groups' states combined: maximum M; c = −1: their sum, else channel c's unnormalized output.
  float M = -INFINITY;
  for (int i = 0; i < G; ++i) M = fmaxf(M, sh_m[i]);
  auto combine = [&](int c) {
    float v = 0.0f;
    for (int i = 0; i < G; ++i)
      if (sh_m[i] != -INFINITY) v += (c < 0 ? sh_d[i] : sh_o[i][c]) * __expf(sh_m[i] - M);
    return v;
  };
  if (p.sem && p.splits == 1) {
    // The block holds the head's whole state: its output is written here, without the partial
    // state's trip through L2, the fence and the counter that a merge needs.
    const float dsum = combine(-1);
    for (int c = tid; c < p.D; c += kThreads) store_out(p, b, h, c, dsum > 0.0f ? combine(c) / dsum : 0.0f);
    store_md(p, bh, M, dsum);
    return;
  }
  float* po = p.part_o + (bh * p.splits + s) * p.D;
  for (int c = tid; c < p.D; c += kThreads) po[c] = combine(c);
  if (tid == 0) reinterpret_cast<float2*>(p.part_md)[bh * p.splits + s] = make_float2(M, combine(-1));
  if (!p.sem) return;
  // The block's writes, ordered before thread 0's count by the barrier, are released by it at
  // device scope; the last block's count acquires every other block's (PTX fences and barriers
  // are cumulative), so no thread needs a sequentially consistent fence of its own.
  __shared__ int last;
  __syncthreads();
  if (tid == 0) last = atomic_add_acq_rel(p.sem + bh, 1) == p.splits - 1;
  __syncthreads();
  if (!last) return;
  merge_head(p, b, h);
  if (tid == 0) {
    p.sem[bh] = 0;
    if (p.claim) p.claim[bh] = 0;  // every block's last claim is ordered before its count
  }
}
