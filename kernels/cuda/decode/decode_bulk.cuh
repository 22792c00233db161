// Decode attention over an all-fp16 cache of head size 128 on sm_90 with long contexts
// (DecodeParams::f16_bulk, decode_launch says when): included by decode_attention.cu after
// decode_f16.cuh, inside its anonymous namespace.
//
// The register-staged fp16 kernel keeps two stages of four rows a group in flight, ~1,060
// streams of 8 KiB stages at batch 16 / 4k; its reads reached 101 % of the copy bandwidth on an
// H200 where PyTorch's SDPA (cuDNN: one block a head, shared-memory stages) reached 110 %. Here
// the rows go to shared memory by bulk copies (`cp.async.bulk`, the copy engine), without
// registers or per-thread addresses: thread 0 issues each stage's K and V rows (one copy a side
// and part), kDecodeBulkStages stages of kDecodeBulkChunkRows rows ahead (twice as many of half
// as many rows with DecodeParams::bulk_fine), and an mbarrier a stage counts their
// bytes. A group of 16 lanes takes rows g, g + 8, … of a stage from shared memory into the same
// f16_update as the fp16 kernel; once every group is past a stage (one barrier) thread 0 refills
// it. Two blocks a multiprocessor (96 KiB of stages each), split by the wave rule at two blocks
// with at most kDecodeBulkSplitBytes of rows a block (decode_splits, DecodePath::kF16Bulk).
// Where a head has several blocks and DecodeParams::claim is given, a block's stages after its
// first stages are the head's next unread chunk of rows, claimed from a counter: blocks on
// multiprocessors that stream faster read more of the head, and its blocks end together (at
// batch 1 / 64k on an H100 the last block ended 12 µs after the median one with fixed ranges).
// The step's token, when fused in, is not in memory: the stages stop before it, and group 0 of
// the block whose range holds it (with claims, block 0) takes it as one more row (fresh_token, as
// the fp16 kernel).
#pragma once

constexpr int kBulkBytes = kDecodeBulkStages * kDecodeBulkChunkRows * 512;  // a block's stages
static_assert(kDecodeBulkFineStages * kDecodeBulkFineChunkRows == kDecodeBulkStages * kDecodeBulkChunkRows,
              "both stage sizes fill the same shared memory");

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
// Arrives on the barrier, expecting `bytes` more of copies to complete before its phase does.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// `bytes` (a multiple of 16, both ends 16-byte aligned) from global to shared memory by the copy
// engine; their completion counts on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// CLAIM: rows claimed from the head's counter (the launch asks for it where DecodeParams::claim
// and sem are given and a head has several splits); else each block reads a fixed range, in
// exactly nst stages. R: rows a stage (kDecodeBulkChunkRows, or kDecodeBulkFineChunkRows for
// DecodeParams::bulk_fine), in kBulkBytes of stages.
template <bool CLAIM, int R>
__global__ void __launch_bounds__(kThreads, kDecodeBulkMinBlocks) decode_f16_bulk_kernel(DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int L = 16, G = kThreads / L, U = R / G, D = 128, S = kBulkBytes / (R * 512);
  extern __shared__ __align__(128) uint4 stg[];  // S stages: R K rows, then R V rows (16 uint4 a row)
  __shared__ __align__(8) uint64_t full[S];
  __shared__ F16Parts parts;
  auto& sh_k = parts.k;
  auto& sh_v = parts.v;
  auto& sh_end = parts.end;  // rows, then cumulative rows
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, g = tid / L, li = tid % L, c0 = li * 8;
  const int bk = b * p.NKV + h / (p.NH / p.NKV), kvh = h / (p.NH / p.NKV);
  // As in decode_f16_kernel: with the token fused in (or rows_ready) nothing about the cached
  // rows is written by the kernel this one follows, so the table is read and the first stages
  // are issued before the wait.
  const bool fresh = p.fresh_k != nullptr;
  const bool early = fresh || p.rows_ready;
  if (!early) pdl_wait();
  const int np = read_f16_parts(p, bk, tid, parts);
  const int tail_row = fresh ? *p.tail_counter : 0;
  if (tid == 0) {
    for (int i = 0; i < S; ++i) mbar_init(&full[i], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < np; ++i) sh_end[i] += sh_end[i - 1];
  __syncthreads();
  const int n_cache = np > 0 ? sh_end[np - 1] : 0;
  const int N = n_cache + (fresh ? 1 : 0);
  // Which rows a block reads. Static: a contiguous range of the head's rows. With CLAIM: the
  // head's cached rows in chunks of one stage; block s takes chunks s, s + splits, … for its
  // first S stages and then, one claim ahead, the next unclaimed chunk past those from the head's
  // counter, so the head's blocks end within about a stage of each other (the file's head says
  // why). The first claim is made after the wait, when the previous call's last block has reset
  // the counter.
  const int64_t bh = static_cast<int64_t>(b) * p.NH + h;
  const int chunk = (N + p.splits - 1) / p.splits;
  const int r0 = CLAIM ? 0 : min(N, s * chunk), r1 = CLAIM ? N : min(N, r0 + chunk);
  const int cached_end = min(r1, n_cache);  // the stages' rows end here
  const int n_chunks = (n_cache + R - 1) / R;
  const int nst = (max(cached_end - r0, 0) + R - 1) / R;  // (static) the block's stages
  __shared__ int stage_row[S];  // (claims) first row of the stage in each buffer; −1: the rows end
  int claimed = 0;              // (thread 0) the head's next chunk past the first S·splits, claimed
  // Thread 0: stage k's first row (−1: none) — then its rows, a copy a side and part, into
  // buffer k mod S, counted on that buffer's barrier.
  auto first_row = [&](int k) {
    if constexpr (!CLAIM) return r0 + k * R;
    int c = s + k * p.splits;
    if (k >= S) {
      c = S * p.splits + claimed;
      if (c < n_chunks) claimed = atomicAdd(p.claim + bh, 1);  // the next stage's, one ahead
    }
    return c < n_chunks ? c * R : -1;
  };
  auto issue = [&](int k) {
    const int j = first_row(k), je = j < 0 ? j : min(j + R, cached_end);
    uint4* dst = stg + (k % S) * (2 * R * 16);
    if constexpr (CLAIM) stage_row[k % S] = j;  // published by the barrier's arrival (release) to its waiters
    mbar_expect(&full[k % S], 2u * 256u * static_cast<uint32_t>(je - j));
    int x = j, pi = 0;
    if (j >= 0)
      while (x >= sh_end[pi]) ++pi;
    for (; x < je; ++pi) {
      const int y = min(je, sh_end[pi]), base = pi ? sh_end[pi - 1] : 0;
      const uint32_t bytes = 256u * static_cast<uint32_t>(y - x);
      bulk_copy(dst + (x - j) * 16, sh_k[pi] + static_cast<int64_t>(x - base) * D, bytes, &full[k % S]);
      bulk_copy(dst + (R + x - j) * 16, sh_v[pi] + static_cast<int64_t>(x - base) * D, bytes, &full[k % S]);
      x = y;
    }
  };
  const int first = CLAIM ? S : min(S, nst);  // stages issued ahead (with claims: end markers too)
  if (early && tid == 0)
    for (int k = 0; k < first; ++k) issue(k);
  pdl_wait();
  pdl_trigger();
  if (tid == 0) {
    if (!early)
      for (int k = 0; k < first; ++k) issue(k);
    if (CLAIM && S * p.splits < n_chunks) claimed = atomicAdd(p.claim + bh, 1);
  }
  float q[8];
  uint4 fk, fv;
  load_query<L>(p, b, h, c0, kvh, s, g, tid, tail_row, q, fk, fv);

  State st;
  for (int k = 0; CLAIM || k < nst; ++k) {
    mbar_wait(&full[k % S], (k / S) & 1);
    const int j = CLAIM ? stage_row[k % S] : r0 + k * R;
    if (j < 0) break;
    const int je = min(j + R, cached_end);
    const uint4* src = stg + (k % S) * (2 * R * 16);
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int row = g + u * G;
      if (j + row < je) {
        kr[u] = src[row * 16 + li];
        vr[u] = src[(R + row) * 16 + li];
      } else {
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
    f16_update<L, U>(kr, vr, q, j + g, G, je, false, 1.0f, 0.0f, 0.0f, st);
    __syncthreads();  // every group is past the buffer
    if (tid == 0 && (CLAIM || k + S < nst)) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // its reads before the copy's writes
      issue(k + S);
    }
  }
  // The step's token (its row is not in memory): the block whose range holds it, or block 0.
  const bool token_here = fresh && (CLAIM ? s == 0 : r0 <= n_cache && n_cache < r1);
  if (token_here) {  // the token's row: group 0 (the others' masked)
    const uint4 kr[1] = {g == 0 ? fk : make_uint4(0, 0, 0, 0)}, vr[1] = {g == 0 ? fv : make_uint4(0, 0, 0, 0)};
    f16_update<L, 1>(kr, vr, q, g == 0 ? n_cache : N, G, N, false, 1.0f, 0.0f, 0.0f, st);
  }
  finish_block<L>(p, st, b, h, s, tail_row);
#else
  __trap();  // decode_launch gives f16_bulk only on sm_90 devices
#endif
}
