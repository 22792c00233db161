// Two decode-attention kernels for the methods that quantize while decoding, included by
// decode_attention.cu after decode_f16.cuh, inside its anonymous namespace: the token-wise one,
// for caches whose every part holds token-wise codes of one width on both sides, a range per row
// (DecodeParams::tok_bits: uniform's per-token parts and packed decode rows, Hadamard-INT4's
// rotated ones); and the mixed one (below), for fp16 rows beside KIVI's groups or ZipCache's
// subsets.
//
// The token-wise kernel is the fp16 kernel's shape with token-wise rows: a kernel of its own with
// none of the other paths compiled in (few registers, four blocks a multiprocessor), each group
// of L = D/8 lanes walking the block's rows in two register stages of kTokRows / 2 rows, the part
// table and the block's first rows read before waiting for the previous kernel when nothing it
// writes is among them.
// A row's score is scale_j·(q·code_j) + zero_j·Σq and its values add (p_j·scale_j)·code_j +
// p_j·zero_j, the arithmetic of the general kernel's token-wise fast path (token_rows).
//
// With the step's token fused in (DecodeParams::qtail), the kernel does what rope_quant_append
// and then attention would: q and the token's key rotated (RoPE), the key and value rounded to
// fp16, the key (and the query) through the Hadamard blocks when the cache's keys are rotated,
// each side quantized with its own range (quantize_row_warp's operations: the same codes and
// fp16 ranges), written by one block a KV head to the packed tail at the row every block read,
// and attended as the head's last row from registers.
#pragma once

constexpr int kTokRows = 8;

// A head's parts in shared memory, as the two kernels here read them: K and V data, the per-row
// (or per channel and group) scales and zeros, each part's key range group (0: the part's rows;
// −1: an fp16 part) and rows, then cumulative rows.
struct CodedParts {
  const void* k[kSharedParts];
  const void* v[kSharedParts];
  const __half* ks[kSharedParts];
  const __half* kz[kSharedParts];
  const __half* vs[kSharedParts];
  const __half* vz[kSharedParts];
  const __half* vf[kSharedParts];  // the values' CST factors (null: none)
  int group[kSharedParts];
  int bits[kSharedParts];
  int end[kSharedParts];
};

// Thread i reads part i of KV head bk (read_f16_parts' order of loads: every descriptor field
// with the count), then thread 0 makes the rows cumulative; returns the part count. The block's
// rows of the head's N (its cached rows, then the fused token's) are [r0, r1).
__device__ __forceinline__ int read_coded_parts(const DecodeParams& p, int bk, int tid, bool fresh, int s,
                                                CodedParts& t, int& n_cache, int& r0, int& r1) {
  const PartDesc* gp = p.parts + static_cast<int64_t>(bk) * p.max_parts;
  const bool mine = tid < p.max_parts;
  PartDesc d;
  if (mine) {
    d.k.fmt = gp[tid].k.fmt;
    d.k.group = gp[tid].k.group;
    d.k.bits = gp[tid].k.bits;
    d.v.factor = gp[tid].v.factor;
    d.k.data = gp[tid].k.data;
    d.v.data = gp[tid].v.data;
    d.k.scale = gp[tid].k.scale;
    d.k.zero = gp[tid].k.zero;
    d.v.scale = gp[tid].v.scale;
    d.v.zero = gp[tid].v.zero;
    d.n = gp[tid].n;
    d.counter = gp[tid].counter;
  }
  const int np = p.n_parts[bk];
  if (mine && tid < np) {
    t.k[tid] = d.k.data;
    t.v[tid] = d.v.data;
    t.ks[tid] = d.k.scale;
    t.kz[tid] = d.k.zero;
    t.vs[tid] = d.v.scale;
    t.vz[tid] = d.v.zero;
    t.vf[tid] = d.v.factor;
    t.bits[tid] = d.k.bits;
    const int n = d.n + (d.counter ? *d.counter : 0);
    t.group[tid] = d.k.fmt == kF16 ? -1 : (d.k.group > 0 && d.k.group < n ? d.k.group : 0);
    t.end[tid] = n;
  }
  __syncthreads();
  if (tid == 0)
    for (int i = 1; i < np; ++i) t.end[i] += t.end[i - 1];
  __syncthreads();
  n_cache = np > 0 ? t.end[np - 1] : 0;
  const int N = n_cache + (fresh ? 1 : 0);
  const int chunk = (N + p.splits - 1) / p.splits;
  r0 = min(N, s * chunk);
  r1 = min(N, r0 + chunk);
  return np;
}

// The block's rows [r0, r1) in two register stages a and b of `step` rows each (loaded with the
// first two stages before this is called): while one stage's rows are used, the other's loads
// are in flight. fill(j0, stage) puts the fused token's row in, update(j0, stage) uses the rows,
// load(j0, stage) loads the stage from row j0. The next kernel is let in at the block's last two
// stages unless `all_loaded` (then it was let in before).
template <class S, class Fill, class Update, class Load>
__device__ __forceinline__ void walk_stages(int r0, int r1, int step, bool all_loaded, S& a, S& b, Fill fill,
                                            Update update, Load load) {
  for (int j0 = r0; j0 < r1; j0 += 2 * step) {
    if (!all_loaded && j0 + 2 * step >= r1) pdl_trigger();
    fill(j0, a);
    update(j0, a);
    if (j0 + 2 * step < r1) load(j0 + 2 * step, a);
    if (j0 + step >= r1) break;
    fill(j0 + step, b);
    update(j0 + step, b);
    if (j0 + 3 * step < r1) load(j0 + 3 * step, b);
  }
}

// Where a block of either kernel here stands: its split s, query head h, sequence b, thread tid
// (group g, channels c0..), KV head kvh; whether the step's token is fused in (and the tail row
// it takes), whether the cache's rows are read before the wait; the head's cached rows and the
// block's [r0, r1).
struct CodedBlock {
  int s, h, b, tid, g, c0, kvh;
  bool fresh, early;
  int tail_row, n_cache, r0, r1;
};

// The block's start: as the fp16 kernel, with the token fused in (or rows_ready) nothing the
// previous kernel writes is among the cache's rows, so the part table is read (and the first
// stages loaded, first_stages) before the wait; otherwise after it.
template <int L>
__device__ __forceinline__ CodedBlock begin_coded_block(const DecodeParams& p, CodedParts& parts) {
  CodedBlock k;
  k.s = blockIdx.x;
  k.h = blockIdx.y;
  k.b = blockIdx.z;
  k.tid = threadIdx.x;
  k.g = k.tid / L;
  k.c0 = (k.tid % L) * 8;
  k.kvh = k.h / (p.NH / p.NKV);
  k.fresh = p.fresh_k != nullptr;
  k.early = k.fresh || p.rows_ready;
  if (!k.early) pdl_wait();
  k.tail_row = k.fresh ? *p.tail_counter : 0;
  read_coded_parts(p, k.b * p.NKV + k.kvh, k.tid, k.fresh, k.s, parts, k.n_cache, k.r0, k.r1);
  return k;
}

// The block's first two stages loaded (before the wait where the rows allow), then the wait;
// the next kernel let in at once when they hold all the block's rows (returned).
template <class S, class Load>
__device__ __forceinline__ bool first_stages(const CodedBlock& k, int step, S& a, S& b, Load load) {
  load(k.r0, a);
  load(k.r0 + step, b);
  if (k.early) pdl_wait();
  const bool all_loaded = k.r1 - k.r0 <= 2 * step;
  if (all_loaded) pdl_trigger();
  return all_loaded;
}

// One row as a group's lane holds it: its 8 codes of each side, and (scale, zero) of each side.
template <int BITS>
struct TokRow {
  using Word = typename std::conditional<(BITS <= 4), uint32_t, uint64_t>::type;
  Word k, v;
  __half2 kr, vr;
};

// quant::block_hadamard's blocks of R over a row held 8 channels a lane (c0 = li·8) by a group of
// L lanes: the butterflies of hadamard_blocks, span by span (a + c on the lower value, a − c on
// the upper), spans under 8 within the lane, wider ones with the lane li ^ span/8; then 1/√R.
template <int L>
__device__ __forceinline__ void hadamard8(float (&x)[8], int li, int R) {
#pragma unroll
  for (int len = 1; len < 8; len <<= 1) {
    if (len >= R) break;
#pragma unroll
    for (int c = 0; c < 8; ++c)
      if (!(c & len)) {
        const float a = x[c], b = x[c + len];
        x[c] = a + b;
        x[c + len] = a - b;
      }
  }
  for (int len = 8; len < R; len <<= 1) {
    const int o = len / 8;
    const bool upper = li & o;
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float other = __shfl_xor_sync(0xffffffffu, x[c], o);
      x[c] = upper ? other - x[c] : x[c] + other;
    }
  }
  const float s = 1.0f / sqrtf(static_cast<float>(R));
#pragma unroll
  for (int c = 0; c < 8; ++c) x[c] *= s;
}

// This lane's 8 values of a row quantized with the row's range (quantize_row_warp's operations;
// the range taken over the group's L lanes): the codes, and the fp16 scale and zero in r.
template <int L, int BITS>
__device__ __forceinline__ typename TokRow<BITS>::Word quantize8(const float (&x)[8], __half2& r) {
  float lo = x[0], hi = x[0];
#pragma unroll
  for (int c = 1; c < 8; ++c) {
    lo = fminf(lo, x[c]);
    hi = fmaxf(hi, x[c]);
  }
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  __half s, z;
  affine(lo, hi, BITS, 1.0f, true, &s, &z);
  r = __halves2half2(s, z);
  const float a = __half2float(z), sc = __half2float(s);
  typename TokRow<BITS>::Word w = 0;
#pragma unroll
  for (int c = 0; c < 8; ++c) w |= static_cast<typename TokRow<BITS>::Word>(encode(x[c], a, sc, BITS)) << (c * BITS);
  return w;
}

// The step's token (DecodeParams::qtail) for this lane's 8 channels c0..: q rotated (RoPE, then
// the Hadamard blocks), the token's K and V rows quantized into tok. One block a KV head writes
// the codes, ranges and position to the tail at tail_row; the counter then advances
// (advance_tail).
template <int L, int BITS>
__device__ void fresh_qtoken(const DecodeParams& p, float (&q)[8], int c0, int kvh, int s, int h, int g, int tid,
                             int tail_row, TokRow<BITS>& tok) {
  constexpr int D = 8 * L;
  const int li = c0 / 8;
  float k[8], v[8];
  rotated_token<L>(p, q, c0, kvh, k, v);
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    k[c] = __half2float(__float2half_rn(k[c]));
    v[c] = __half2float(__float2half_rn(v[c]));
  }
  const QuantTail& t = p.qtail;
  if (t.rotation) {
    hadamard8<L>(q, li, t.rotation);
    hadamard8<L>(k, li, t.rotation);
  }
  tok.k = quantize8<L, BITS>(k, tok.kr);
  tok.v = quantize8<L, BITS>(v, tok.vr);
  if (s == 0 && h % (p.NH / p.NKV) == 0 && g == 0 && tail_row < t.cap) {
    const int64_t at = static_cast<int64_t>(kvh) * t.cap + tail_row;
    const int64_t off = at * (D * BITS / 8) + li * BITS;
    using Word = typename TokRow<BITS>::Word;
    if constexpr (BITS == 2) {
      *reinterpret_cast<uint16_t*>(t.k + off) = static_cast<uint16_t>(tok.k);
      *reinterpret_cast<uint16_t*>(t.v + off) = static_cast<uint16_t>(tok.v);
    } else {
      *reinterpret_cast<Word*>(t.k + off) = tok.k;
      *reinterpret_cast<Word*>(t.v + off) = tok.v;
    }
    if (li == 0) {
      const int64_t side = static_cast<int64_t>(p.NKV) * t.cap;
      t.ranges[at] = __low2half(tok.kr);
      t.ranges[side + at] = __high2half(tok.kr);
      t.ranges[2 * side + at] = __low2half(tok.vr);
      t.ranges[3 * side + at] = __high2half(tok.vr);
      t.pos[at] = *p.fresh_pos;
    }
  }
  advance_tail(p, tid, tail_row);
}

// The scores, online-softmax update and P·V of U token-wise rows already loaded: rows j, j + G, …
// of which those below `end` count (token_rows' arithmetic).
template <int L, int BITS, int U>
__device__ __forceinline__ void tok_update(const TokRow<BITS> (&r)[U], const float* q, float qsum, int j, int G,
                                           int end, State& st) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
  float sc[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float d = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) d = fmaf(q[c], code_f(static_cast<uint32_t>(r[u].k >> (c * BITS)) & mask), d);
    d = group_sum<L>(d);
    const float2 kr = __half22float2(r[u].kr);
    sc[u] = j + u * G < end ? fmaf(d, kr.x, qsum * kr.y) : -INFINITY;
  }
  softmax_step<U>(sc, st, [&](int u, float p) {
    const float2 vr = __half22float2(r[u].vr);
    const float ps = p * vr.x, pz = p * vr.y;
#pragma unroll
    for (int c = 0; c < 8; ++c)
      st.o[c] = fmaf(ps, code_f(static_cast<uint32_t>(r[u].v >> (c * BITS)) & mask), st.o[c]) + pz;
  });
}

template <int L, int BITS>
__global__ void __launch_bounds__(kThreads, 4) decode_qtok_kernel(DecodeParams p) {
  constexpr int G = kThreads / L, U = kTokRows / 2, D = 8 * L, step = U * G, rowb = D * BITS / 8;
  using Row = TokRow<BITS>;
  struct Stage {
    Row r[U];
  };
  __shared__ CodedParts parts;
  const CodedBlock k = begin_coded_block<L>(p, parts);
  const int g = k.g, c0 = k.c0, r1 = k.r1, n_cache = k.n_cache;
  auto load = [&](int j0, Stage& st) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      Row& r = st.r[u];
      const int j = j0 + u * G + g;
      if (j < r1 && j < n_cache) {
        int pi = 0;
        while (j >= parts.end[pi]) ++pi;
        const int i = j - (pi ? parts.end[pi - 1] : 0);
        const int64_t at = static_cast<int64_t>(i) * rowb + (c0 / 8) * BITS;
        r.k = static_cast<typename Row::Word>(load_bits<BITS>(static_cast<const uint8_t*>(parts.k[pi]) + at));
        r.v = static_cast<typename Row::Word>(load_bits<BITS>(static_cast<const uint8_t*>(parts.v[pi]) + at));
        r.kr = __halves2half2(__ldg(parts.ks[pi] + i), __ldg(parts.kz[pi] + i));
        r.vr = __halves2half2(__ldg(parts.vs[pi] + i), __ldg(parts.vz[pi] + i));
      } else {
        r.k = r.v = 0;
        r.kr = r.vr = __float2half2_rn(0.0f);
      }
    }
  };
  Stage sa, sb;
  const bool all_loaded = first_stages(k, step, sa, sb, load);
  float q[8];
  const float* qrow = p.q + k.b * p.q_stride + static_cast<int64_t>(k.h) * D + c0;
#pragma unroll
  for (int c = 0; c < 8; ++c) q[c] = qrow[c];
  Row tok;
  if (k.fresh) fresh_qtoken<L, BITS>(p, q, c0, k.kvh, k.s, k.h, g, k.tid, k.tail_row, tok);
  float qsum = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    q[c] *= p.scale;
    qsum += q[c];
  }
  qsum = group_sum<L>(qsum);

  State st;
  walk_stages(
      k.r0, r1, step, all_loaded, sa, sb,
      [&](int j0, Stage& x) {  // the token's row, when it falls in the stage
        if (!k.fresh) return;
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (j0 + u * G + g == n_cache) x.r[u] = tok;
      },
      [&](int j0, Stage& x) { tok_update<L, BITS, U>(x.r, q, qsum, j0 + g, G, r1, st); }, load);
  finish_block<L>(p, st, k.b, k.h, k.s, k.tail_row);
}

// ---- fp16 rows beside channel-wise keys with token-wise values (DecodeParams::mix_bits: KIVI's
// groups, the dense rows it keeps and its fp16 decode rows) ------------------------------------
//
// The same shape again, for caches whose parts are fp16 rows or BITS-bit codes with keys a range
// per channel and group of rows (PartDesc::k.group) and values a range per row, with or without
// the values' CST factors (BITS = 0: each part's own width, 1, 2 or 4 — ZipCache's salient and
// regular subsets — and its factors, D a group of rows as the keys' ranges are: mix_width; a
// fixed BITS: no factors). A row of either kind takes the
// registers of an fp16 row (a quantized row's codes, its value range and where its key ranges
// lie), its key ranges (and factors) read as it is used; with the step's token fused in, the
// token is appended as fp16 (fresh_token). Arithmetic per row as the general kernel's fast paths
// (f16_update; channel_token_rows).

// A lane's codes of 8 channels (W·8 bits at p, W-byte aligned: mix_width), W = BITS where fixed,
// else the part's own width (1, 2 or 4 bits: CudaKV::build_tables, mix_width) read at run time.
// ZipCache's parts of two widths take the run-time width, one copy of the code for every width:
// a copy per width (constant shifts) made the kernel wait on instruction fetches.
template <int BITS>
__device__ __forceinline__ uint32_t load_codes(const uint8_t* p, int W) {
  if constexpr (BITS != 0) return static_cast<uint32_t>(load_bits<BITS>(p));
  else return W == 4 ? __ldg(reinterpret_cast<const uint32_t*>(p)) : W == 2 ? __ldg(reinterpret_cast<const uint16_t*>(p)) : __ldg(p);
}
// The 8 codes of x, channel c at bits c·W (W as load_codes takes it), as floats.
template <int BITS>
__device__ __forceinline__ void codes8(uint32_t x, int W, float (&c)[8]) {
  if constexpr (BITS != 0) {
    constexpr uint32_t mask = (1u << BITS) - 1u;
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = code_f((x >> (i * BITS)) & mask);
  } else {
    const uint32_t mask = (1u << W) - 1u;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      c[i] = code_f(x & mask);
      x >>= W;
    }
  }
}

// A line into L1 ahead of its use (no value: a hint).
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// A row in registers: fp16 K and V (k, v), or a quantized row's K codes (k.x), V codes (k.y),
// V scale and zero (k.z, a half2) and its key ranges' offset from its part's (k.w: group·D + c0)
// with its part's index (v.x) and code width (v.y).
struct MixRow {
  uint4 k, v;
};

// The scores, online-softmax update and P·V of U rows already loaded, rows j, j + G, … below
// `end` counting; `coded`: bit u set when row u is quantized.
template <int L, int BITS, int U>
__device__ __forceinline__ void mix_update(const MixRow (&r)[U], unsigned coded, const CodedParts& parts, const float* q,
                                           int c0, int j, int G, int end, State& st) {
  float sc[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float d = 0.0f;
    if (coded >> u & 1u) {
      const int pi = static_cast<int>(r[u].v.x);
      float sf[8], zf[8], cf[8];
      unpack8<__half>(__ldg(reinterpret_cast<const uint4*>(parts.ks[pi] + r[u].k.w)), sf);
      unpack8<__half>(__ldg(reinterpret_cast<const uint4*>(parts.kz[pi] + r[u].k.w)), zf);
      codes8<BITS>(r[u].k.x, static_cast<int>(r[u].v.y), cf);
#pragma unroll
      for (int c = 0; c < 8; ++c) d = fmaf(q[c], fmaf(cf[c], sf[c], zf[c]), d);
    } else {
      float f[8];
      unpack8<__half>(r[u].k, f);
#pragma unroll
      for (int c = 0; c < 8; ++c) d = fmaf(q[c], f[c], d);
    }
    d = group_sum<L>(d);
    sc[u] = j + u * G < end ? d : -INFINITY;
  }
  softmax_step<U>(sc, st, [&](int u, float p) {
    if (coded >> u & 1u) {
      const int pi = static_cast<int>(r[u].v.x);
      const float2 vr = __half22float2(*reinterpret_cast<const __half2*>(&r[u].k.z));
      const float ps = p * vr.x, pz = p * vr.y;
      const __half* vf = BITS ? nullptr : parts.vf[pi];  // (parts with factors take BITS = 0)
      float cf[8];
      codes8<BITS>(r[u].k.y, static_cast<int>(r[u].v.y), cf);
      if (vf) {  // v_c = f_c·(code·scale + zero)
        float f[8];
        unpack8<__half>(__ldg(reinterpret_cast<const uint4*>(vf + r[u].k.w)), f);  // (the key ranges' group)
#pragma unroll
        for (int c = 0; c < 8; ++c) st.o[c] = fmaf(f[c], fmaf(ps, cf[c], pz), st.o[c]);
      } else {
#pragma unroll
        for (int c = 0; c < 8; ++c) st.o[c] = fmaf(ps, cf[c], st.o[c]) + pz;
      }
    } else {
      float f[8];
      unpack8<__half>(r[u].v, f);
#pragma unroll
      for (int c = 0; c < 8; ++c) st.o[c] = fmaf(p, f[c], st.o[c]);
    }
  });
}

// U rows a group holds in each of the two stages: kTokRows / 2 where BITS fixes the width, half
// that for parts of their own widths and factors (BITS = 0, ZipCache). A block walks its rows about
// once at captioning lengths, so its time is mostly fetching the loop's instructions once; with
// the longest row code, a loop half as long run twice was 1.2 % faster on the 7B shape, while
// KIVI's (BITS = 2) was 1 % slower so.
template <int L, int BITS, int U>
__global__ void __launch_bounds__(kThreads, 4) decode_mix_kernel(DecodeParams p) {
  static_assert(BITS <= 4, "a quantized row's codes of a lane fit a word (BITS = 0: each part's width, at most 4)");
  constexpr int G = kThreads / L, D = 8 * L, step = U * G;
  struct Stage {
    MixRow r[U];
    unsigned coded;  // bit u: row u is quantized
  };
  __shared__ CodedParts parts;
  const CodedBlock k = begin_coded_block<L>(p, parts);
  const int g = k.g, c0 = k.c0, r1 = k.r1, n_cache = k.n_cache;
  auto load = [&](int j0, Stage& st) {
    st.coded = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      MixRow& r = st.r[u];
      const int j = j0 + u * G + g;
      r.k = r.v = make_uint4(0, 0, 0, 0);
      if (j < r1 && j < n_cache) {
        int pi = 0;
        while (j >= parts.end[pi]) ++pi;
        const int i = j - (pi ? parts.end[pi - 1] : 0);
        const int grp = parts.group[pi];
        if (grp < 0) {
          const int64_t at = static_cast<int64_t>(i) * D + c0;
          r.k = ld_row16(static_cast<const __half*>(parts.k[pi]) + at);
          r.v = ld_row16(static_cast<const __half*>(parts.v[pi]) + at);
        } else {
          const int W = BITS ? BITS : parts.bits[pi];
          const int64_t at = static_cast<int64_t>(i) * (D / 8) * W + (c0 / 8) * W;
          r.k.x = load_codes<BITS>(static_cast<const uint8_t*>(parts.k[pi]) + at, W);
          r.k.y = load_codes<BITS>(static_cast<const uint8_t*>(parts.v[pi]) + at, W);
          r.v.y = static_cast<uint32_t>(W);
          const __half2 vr = __halves2half2(__ldg(parts.vs[pi] + i), __ldg(parts.vz[pi] + i));
          r.k.z = *reinterpret_cast<const uint32_t*>(&vr);
          r.k.w = static_cast<uint32_t>((grp > 0 ? i / grp : 0) * D + c0);
          r.v.x = static_cast<uint32_t>(pi);
          st.coded |= 1u << u;
          // Ranges and factors a group of rows (KIVI's groups, ZipCache's gaps) change every few
          // rows: fetched into L1 here, a stage before mix_update reads them.
          if (grp > 0) {
            prefetch_l1(parts.ks[pi] + r.k.w);
            prefetch_l1(parts.kz[pi] + r.k.w);
            if (!BITS && parts.vf[pi]) prefetch_l1(parts.vf[pi] + r.k.w);
          }
        }
      }
    }
  };
  Stage sa, sb;
  const bool all_loaded = first_stages(k, step, sa, sb, load);
  float q[8];
  uint4 fk, fv;  // the step's token's K and V rows (fp16), when fused in
  load_query<L>(p, k.b, k.h, c0, k.kvh, k.s, g, k.tid, k.tail_row, q, fk, fv);

  State st;
  walk_stages(
      k.r0, r1, step, all_loaded, sa, sb,
      [&](int j0, Stage& x) {  // the token's row as an fp16 row, when it falls in the stage
        if (!k.fresh) return;
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (j0 + u * G + g == n_cache) {
            x.r[u].k = fk;
            x.r[u].v = fv;
            x.coded &= ~(1u << u);
          }
      },
      [&](int j0, Stage& x) { mix_update<L, BITS, U>(x.r, x.coded, parts, q, c0, j0 + g, G, r1, st); }, load);
  finish_block<L>(p, st, k.b, k.h, k.s, k.tail_row);
}
