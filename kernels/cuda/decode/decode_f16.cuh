// Decode attention when every part of the cache holds fp16 rows (the full cache, and every
// evicting or merging method): included by decode_attention.cu, inside its anonymous namespace.
//
// A kernel of its own, with none of the packed paths compiled in, so it needs few registers
// (several blocks fit a multiprocessor) and a block's fixed work is short; at the contexts of a
// captioning run (hundreds of rows a head) that fixed work, not the bytes, sets the time. Each
// group of L = D/8 lanes walks the block's range (rows g, g + G, …) in two register stages of
// kF16Rows / 2 rows: while one stage's rows are used, the other's loads are in flight. With
// the step's token fused in (or DecodeParams::rows_ready), the part table, the row counts and
// the block's first rows are read before waiting for the previous kernel (none of them is
// written by it), so at those contexts the whole cache is in flight while the q/k/v product
// ends; a launch after a kernel that may append rows waits first.
// The group's scores, softmax and P·V stay in registers; the block ends as the general kernel's
// blocks do (finish_block: partial state, and the merge by the head's last block). Long contexts
// at head size 128 on sm_90 take decode_bulk.cuh instead (DecodeParams::f16_bulk), which shares
// the part table, the query and the fused token's step (read_f16_parts, load_query) with this one.
#pragma once

// Rows a group has in its two register stages. 12 or 16 (four blocks a multiprocessor, or three
// with 16) spill and were 10–20 % slower on an H100; at 8 the kernel takes its 128 registers.
constexpr int kF16Rows = 8;

// RoPE of this lane's 8 channels c0.. of a D-wide row held by a group of L lanes (channel c pairs
// with c ± D/2, held by lane li ^ L/2, or by the same lane when L = 1), as rope_append_kernel
// computes it: angle pos·inv_freq[c mod D/2], a' = a·cos − b·sin, b' = b·cos + a·sin (rope_first,
// rope_second: the same bits).
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
    x[c] = first ? rope_first(x[c], other[c], sn, cs) : rope_second(other[c], x[c], sn, cs);
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

// 16 bytes of a cached row, read once per step: not kept in L1, and L2 asked to fetch the row's
// whole 256-byte span at once (0.5–1.5 % faster than __ldg at batch 1 on an H100).
__device__ __forceinline__ uint4 ld_row16(const __half* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// A head's fp16 parts as the fp16 kernels keep them in shared memory: K and V rows, and each
// part's rows (then cumulative rows).
struct F16Parts {
  const __half* k[kSharedParts];
  const __half* v[kSharedParts];
  int end[kSharedParts];
};
// Thread i reads part i of KV head bk (its rows with those appended during decode, through the
// tail's counter); returns the part count. Every one of the head's max_parts descriptors is in
// the table, so thread i loads descriptor i alongside the count rather than after it: one trip
// to memory fewer before the first rows can be asked for (a held call starts cold).
__device__ __forceinline__ int read_f16_parts(const DecodeParams& p, int bk, int tid, F16Parts& t) {
  const PartDesc* gp = p.parts + static_cast<int64_t>(bk) * p.max_parts;
  const bool mine = tid < p.max_parts;
  const void* kd = nullptr;
  const void* vd = nullptr;
  const int* counter = nullptr;
  int n = 0;
  if (mine) {
    kd = gp[tid].k.data;
    vd = gp[tid].v.data;
    n = gp[tid].n;
    counter = gp[tid].counter;
  }
  const int np = p.n_parts[bk];
  if (mine && tid < np) {
    t.k[tid] = static_cast<const __half*>(kd);
    t.v[tid] = static_cast<const __half*>(vd);
    t.end[tid] = n + (counter ? *counter : 0);
  }
  return np;
}

// The step's token (DecodeParams::fresh_k) for this lane's 8 channels c0..: q and the token's
// key k rotated (RoPE at *fresh_pos), its value v as the step computed it.
template <int L>
__device__ __forceinline__ void rotated_token(const DecodeParams& p, float (&q)[8], int c0, int kvh, float (&k)[8],
                                              float (&v)[8]) {
  constexpr int D = 8 * L;
  const float pos = static_cast<float>(*p.fresh_pos);
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    k[c] = p.fresh_k[kvh * D + c0 + c];
    v[c] = p.fresh_v[kvh * D + c0 + c];
  }
  rope8<L>(q, c0, pos, p.inv_freq);
  rope8<L>(k, c0, pos, p.inv_freq);
}

// The tail's row count advanced past the step's token (tail_row, which every block read before
// any could advance it) by the last block to get here (thread tid of it); tail_done back to zero.
__device__ __forceinline__ void advance_tail(const DecodeParams& p, int tid, int tail_row) {
  if (tid == 0 && atomicAdd(p.tail_done, 1) == static_cast<int>(gridDim.x * gridDim.y * gridDim.z) - 1) {
    *p.tail_counter = tail_row + 1;
    *p.tail_done = 0;
  }
}

// The step's token (rotated_token) with its K and V rows as fp16 in fk / fv. One block a KV head
// writes the row to the tail at tail_row; the counter then advances (advance_tail).
template <int L>
__device__ void fresh_token(const DecodeParams& p, float (&q)[8], int c0, int kvh, int s, int h, int g, int tid,
                            int tail_row, uint4& fk, uint4& fv) {
  constexpr int D = 8 * L;
  float k[8], v[8];
  rotated_token<L>(p, q, c0, kvh, k, v);
  // A query the decode keeps (DecodeParams::keep, ZipCache's probes): the head's first block
  // writes it rotated, as rope_append_kernel does.
  if (p.keep.slot && s == 0 && g == 0 && tail_row < p.keep.rows) {
    const int slot = p.keep.slot[tail_row];
    if (slot >= 0) {
      float* o = p.keep.q + (static_cast<int64_t>(slot) * p.NH + h) * D + c0;
#pragma unroll
      for (int c = 0; c < 8; ++c) o[c] = q[c];
    }
  }
  fk = pack8_f16(k);
  fv = pack8_f16(v);
  if (s == 0 && h % (p.NH / p.NKV) == 0 && g == 0 && tail_row < p.tail_cap) {
    const int64_t at = (static_cast<int64_t>(kvh) * p.tail_cap + tail_row) * D + c0;
    *reinterpret_cast<uint4*>(p.tail_k + at) = fk;
    *reinterpret_cast<uint4*>(p.tail_v + at) = fv;
    if (c0 == 0) p.tail_pos[static_cast<int64_t>(kvh) * p.tail_cap + tail_row] = *p.fresh_pos;
  }
  advance_tail(p, tid, tail_row);
}

// This lane's 8 channels c0.. of head h's query, scaled; with the step's token fused in, rotated
// first, and the token's rows in fk / fv (fresh_token).
template <int L>
__device__ __forceinline__ void load_query(const DecodeParams& p, int b, int h, int c0, int kvh, int s, int g, int tid,
                                           int tail_row, float (&q)[8], uint4& fk, uint4& fv) {
  const float* qrow = p.q + b * p.q_stride + static_cast<int64_t>(h) * (8 * L) + c0;
#pragma unroll
  for (int c = 0; c < 8; ++c) q[c] = qrow[c];
  fk = fv = make_uint4(0, 0, 0, 0);
  if (p.fresh_k) fresh_token<L>(p, q, c0, kvh, s, h, g, tid, tail_row, fk, fv);
#pragma unroll
  for (int c = 0; c < 8; ++c) q[c] *= p.scale;
}

template <int L>
__global__ void __launch_bounds__(kThreads, 4) decode_f16_kernel(DecodeParams p) {
  constexpr int G = kThreads / L, U = kF16Rows / 2, D = 8 * L, step = U * G;
  __shared__ F16Parts parts;
  auto& sh_k = parts.k;
  auto& sh_v = parts.v;
  auto& sh_end = parts.end;  // rows, then cumulative rows
  const int s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, g = tid / L, c0 = (tid % L) * 8;
  const int bk = b * p.NKV + h / (p.NH / p.NKV);
  const int kvh = h / (p.NH / p.NKV);
  // With the token fused in (or rows_ready), everything about the cached rows was written by
  // earlier steps (the part table and the row counts between steps, the rows appended during
  // decode by this layer's kernel of an earlier step), never by the kernel this one follows, so
  // it is read — and the block's first rows loaded — before the wait: the rows' trip to memory
  // overlaps the previous kernel's tail. Otherwise that kernel may have appended rows (kv_append
  // on a cache without the fused token), so the block waits for it first.
  const bool fresh = p.fresh_k != nullptr;
  const bool early = fresh || p.rows_ready;
  if (!early) pdl_wait();
  const int np = read_f16_parts(p, bk, tid, parts);
  // The step's token, when fused in: its row's place in the tail. Every block reads the counter
  // before any block can advance it (the last block to finish its read does, below).
  const int tail_row = fresh ? *p.tail_counter : 0;
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < np; ++i) sh_end[i] += sh_end[i - 1];
  __syncthreads();
  const int n_cache = np > 0 ? sh_end[np - 1] : 0;  // the token's row, when fused, follows them
  const int N = n_cache + (fresh ? 1 : 0);
  const int chunk = (N + p.splits - 1) / p.splits;
  const int r0 = min(N, s * chunk), r1 = min(N, r0 + chunk);
  // rows_ready 2: each head's last row (the tail's newest, which the previous kernel rewrites)
  // is read after the wait.
  const int late = p.rows_ready == 2 ? n_cache - 1 : -1;
  // Loads rows j0 + u·G + g of the cache (the fused token's row is filled in after the wait;
  // before it, `pre`, the late row is left out).
  auto load = [&](int j0, uint4 (&kr)[U], uint4 (&vr)[U], bool pre) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * G + g;
      if (j < r1 && j < n_cache && !(pre && j == late)) {
        int pi = 0;
        while (j >= sh_end[pi]) ++pi;
        const int64_t at = static_cast<int64_t>(j - (pi ? sh_end[pi - 1] : 0)) * D + c0;
        kr[u] = ld_row16(sh_k[pi] + at);
        vr[u] = ld_row16(sh_v[pi] + at);
      } else {
        kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  // Two stages of U rows a group: one stage's loads are in flight while the other's rows are
  // used.
  uint4 ka[U], va[U], kb[U], vb[U];
  load(r0, ka, va, true);
  load(r0 + step, kb, vb, true);

  if (early) pdl_wait();
  if (late >= r0 && late < r1) {  // the late row, where it falls in the first two stages
    const int64_t at = static_cast<int64_t>(late - (np > 1 ? sh_end[np - 2] : 0)) * D + c0;
    auto refill = [&](int j0, uint4 (&kr)[U], uint4 (&vr)[U]) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (j0 + u * G + g == late) {
          kr[u] = ld_row16(sh_k[np - 1] + at);
          vr[u] = ld_row16(sh_v[np - 1] + at);
        }
    };
    refill(r0, ka, va);
    refill(r0 + step, kb, vb);
  }
  // The next kernel (the o product, which starts its weight reads early) is let in at once when
  // the block's rows are all in its two stages already (a captioning run's context), else once
  // the block is at its last two stages, so that a block with many rows does not share its
  // multiprocessor with waiting blocks for long.
  const bool all_loaded = r1 - r0 <= 2 * step;
  if (all_loaded) pdl_trigger();
  float q[8];
  uint4 fk, fv;  // the step's token's K and V rows, when fused in
  load_query<L>(p, b, h, c0, kvh, s, g, tid, tail_row, q, fk, fv);

  // The token's row, when it falls in a stage starting at row j0.
  auto fill = [&](int j0, uint4 (&kr)[U], uint4 (&vr)[U]) {
    if (!fresh) return;
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (j0 + u * G + g == n_cache) kr[u] = fk, vr[u] = fv;
  };
  State st;
  for (int j0 = r0; j0 < r1; j0 += 2 * step) {
    if (!all_loaded && j0 + 2 * step >= r1) pdl_trigger();
    fill(j0, ka, va);
    f16_update<L, U>(ka, va, q, j0 + g, G, r1, false, 1.0f, 0.0f, 0.0f, st);
    if (j0 + 2 * step < r1) load(j0 + 2 * step, ka, va, false);
    if (j0 + step >= r1) break;
    fill(j0 + step, kb, vb);
    f16_update<L, U>(kb, vb, q, j0 + step + g, G, r1, false, 1.0f, 0.0f, 0.0f, st);
    if (j0 + 3 * step < r1) load(j0 + 3 * step, kb, vb, false);
  }
  finish_block<L>(p, st, b, h, s, tail_row);
}
