// Packed channel-wise parts of 1- and 2-bit codes in decode attention, on integer tensor cores
// (head size 128; included by decode_attention.cu after decode_mma.cuh). Rows and codes
// are as core/compress/quantize.h packs them: row j at byte 16·BITS·j, channel c at bits
// [c·BITS, (c+1)·BITS), least significant first.
//
// Codes are never shifted into place. One AND with the mask of code slot m of every byte,
// M_m = (2^BITS − 1)·0x01010101 << BITS·m, leaves four codes, each multiplied by 2^(BITS·m), as
// the four unsigned bytes of an operand of `mma.sync.m16n8k32` (u8 × s8 → s32); the factor
// 2^(BITS·m) is folded into the other operand (keys) or into the output channel (values).
//
// Keys: S = K·U per 32 channels, A = 16 rows × 32 channels: lane (g, t) takes its BITS words of
// rows g and g+8 (words BITS·t.., so a quad reads whole rows) and the J = 8/BITS slot masks of
// each, eight operands a row for four mma. B = U'_c = round(σ·q_c·scale_c)
// · 2^(BITS·(J−1−m_c)) — CalibQuant's post-scaling with σ a power of two putting max |q⊙scale| at
// 2^22, m_c channel c's slot in its byte — in four balanced base-256 digits (signed bytes), digit
// d in column d: one mma gives four partial sums a row, and Σ_d 256^d·C_d (in fp32; the columns
// are exact integers) ÷ σ·2^(BITS·(J−1)), plus q·zero, is the score. The block builds the digits
// once per part (a channel a thread) in the order the B fragments want them.
// Softmax: per 32 rows and warp one maximum (after calibration g(x) on visual scores); the weight
// p = exp(s − m) becomes the 16-bit integer P = round(65535·p), used for both the values' product
// and the part's sum, so each row's weight is the same in both.
// Values: O^T = V^T·P per 32 rows, A = 16 channels × 32 rows: lane (g, t) loads the 2·BITS bytes
// of channels 16g..16g+15 of rows t + 8i and t + 4 + 8i (i = 0..3), transposes them bytewise
// (two byte permutes a register), and the slot masks give channel 16g + J·b + m of the four rows
// in one register; B = the low and high bytes of P in columns 0 and 1, gathered from the quads
// that hold the rows' scores with two shuffles. The integer accumulators keep Σ P·code·2^(BITS·m)
// while the running maximum holds (at most 512 iterations, far from overflow); when it moves, and
// at the end, lane (g, 0) weighs low + 256·high into fp32 sums, which the move's factor rescales.
// At the end of the part scale_c·Σ P·code + zero_c·Σ P (÷ 65535) joins the warp's state.
// Per 32 rows and warp: 8 + 8 mma and, at 2 bits, 32 ANDs for the keys' operands, 16 byte
// permutes and 32 ANDs for the values' (the fp16-operand path needs 32 mma and about twice the
// logic for the same rows).
// Staging: a 32-row tile's codes are contiguous (16·BITS bytes a row and side); each warp copies
// its next kI8Stages − 1 tiles into its shared-memory stages with cp.async (in a kernel with
// the binary path, decode_b1.cuh, the same per-warp region as its) while it computes this one,
// and reads the tile's operands from there: the copies in flight hold no registers. One tile ahead in registers (the
// earlier scheme) left the loop waiting on memory at 4k rows a block (an H100 timeline: 81 % of
// the copy bandwidth inside the loop, 95 % at 64k).
#pragma once

namespace kvlens::cuda::i8_path {

// d += A·B for A 16 × 32 unsigned bytes and B 32 × 8 signed (BS) or unsigned bytes.
template <bool BS>
__device__ __forceinline__ void imma(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BS)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int BITS>
struct Layout {
  static constexpr int J = 8 / BITS;                  // codes a byte
  static constexpr int NB = 2 * BITS;                 // value bytes a lane and row
  static constexpr int VW = BITS >= 2 ? BITS / 2 : 1;  // their words (1 bit: the low half of one)
  // The slot mask of code slot m of every byte.
  __host__ __device__ static constexpr uint32_t mask(int m) { return ((1u << BITS) - 1u) * 0x01010101u << (BITS * m); }
};

// The 32-row tile's codes one lane holds: key rows g, g+8, g+16, g+24 (BITS words each) and
// value rows t + 4s + 8i (VW words each).
template <int BITS>
struct Tile {
  uint32_t k[4][BITS];
  uint32_t v[2][4][Layout<BITS>::VW];
};

// A warp's kI8Stages stages (decode_attention.cu) in 16-byte chunks (2 bits; 1 bit needs half).
constexpr int kI8WarpChunks = kI8Stages * 128;

// A tile's rows j0.. (zeros from row e) from its stage: keys at the stage's start, values after
// them (16·BITS bytes a row and side).
template <int BITS>
__device__ __forceinline__ void load_keys(const uint8_t* S, int j0, int e, int g, int t, Tile<BITS>& T) {
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const int r = g + 8 * x;
    const uint8_t* p = S + r * (16 * BITS) + 4 * BITS * t;
    if constexpr (BITS == 1) {
      T.k[x][0] = j0 + r < e ? *reinterpret_cast<const uint32_t*>(p) : 0u;
    } else {
      const uint2 u = j0 + r < e ? *reinterpret_cast<const uint2*>(p) : make_uint2(0u, 0u);
      T.k[x][0] = u.x, T.k[x][1] = u.y;
    }
  }
}
template <int BITS>
__device__ __forceinline__ void load_values(const uint8_t* S, int j0, int e, int g, int t, Tile<BITS>& T) {
  using L = Layout<BITS>;
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = t + 4 * s + 8 * i;
      const uint8_t* p = S + 32 * (16 * BITS) + r * (16 * BITS) + L::NB * g;
      if constexpr (BITS == 1) T.v[s][i][0] = j0 + r < e ? *reinterpret_cast<const uint16_t*>(p) : 0u;
      else T.v[s][i][0] = j0 + r < e ? *reinterpret_cast<const uint32_t*>(p) : 0u;
    }
}

// Rows [a, e) of one packed part for this warp (warp w of nw takes the 32-row tiles w, w + nw, ...
// from a). RANGE: min / max of the scores into lo / hi only. Otherwise the part's softmax state is
// merged into st of lanes 0..15 (8 channels a lane). qs: the block's scaled query in shared memory;
// buf: this warp's stages (kI8Stages of 64·BITS 16-byte chunks, keys only when RANGE: half that).
// vsc (the part's row 0 in DecodeParams::vis_scores, or null): RANGE writes each row's raw score
// there; SCORES (attention with calibration) stages a tile's scores in its keys' chunks (from
// the 16-byte boundary at or before its first row's: nine chunks) and multiplies no keys.
// Every thread of the block calls it (the digits of U are built by the whole block).
template <int BITS, bool RANGE, bool SCORES = false>
__device__ __noinline__ void packed_i8(const PartDesc& Pd, int a, int e, const float* qs, int warp, int nw, bool cal,
                                       float cal_t, float cal_g, float tau1, State& st_io, float& lo, float& hi,
                                       uint4* buf, float* vsc) {
  static_assert(!(RANGE && SCORES), "the range pass computes the scores");
  using L = Layout<BITS>;
  constexpr int J = L::J;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint8_t* K = static_cast<const uint8_t*>(Pd.k.data);
  const uint8_t* V = static_cast<const uint8_t*>(Pd.v.data);

  static_assert(BITS == 1 || BITS == 2, "the integer path takes 1- and 2-bit codes");
  // Tile k of this warp (rows a + 32(warp + k·nw) ..) into stage k mod kI8Stages: chunk q of a
  // side is row q / BITS; rows past e are not copied (their stale bytes are masked). Every call
  // commits one group (empty past the warp's last tile), so waiting for all but the newest
  // kI8Stages − 1 groups is waiting for the tile about to be computed.
  constexpr int SIDE = 32 * BITS, SZ = (RANGE ? 1 : 2) * SIDE;  // a stage's 16-byte chunks
  const uint32_t sbase = smem_addr(buf);
  // SCORES: a tile's 32 scores start `soff` floats into its first copied chunk (tiles start 32
  // rows apart, so every tile has the same offset); past e they are stale and masked
  // (kDecodeScorePad keeps the copies in bounds).
  const int soff = SCORES ? static_cast<int>((reinterpret_cast<uintptr_t>(vsc + a) & 15) >> 2) : 0;
  const uint4* const ssrc = SCORES ? reinterpret_cast<const uint4*>(vsc + a - soff) : nullptr;
  auto issue = [&](int k) {
    const int j0 = a + 32 * (warp + k * nw);
    if (j0 < e) {
      const uint32_t dst = sbase + 16u * static_cast<uint32_t>((k % kI8Stages) * SZ);
#pragma unroll
      for (int q = lane; q < SZ; q += 32) {
        const int side = q / SIDE, cq = q % SIDE;
        if (SCORES && side == 0) {
          if (cq < 9) cp_async16(dst + 16u * q, ssrc + (j0 - a) / 4 + cq);
        } else if (j0 + cq / BITS < e) {
          cp_async16(dst + 16u * q, (side ? V : K) + static_cast<int64_t>(j0) * (16 * BITS) + 16 * cq);
        }
      }
    }
    cp_async_commit();
  };
  // Channel c's key range (thread c of the block) is read before the first tiles, which would
  // otherwise queue it behind every multiprocessor's first tiles; the first tiles' copies are
  // issued before the query's preparation, which they overlap.
  const int c = threadIdx.x;
  const int kst = Pd.k.chan_stride;
  const __half k_scale = Pd.k.scale[c * kst], k_zero = Pd.k.zero[c * kst];
#pragma unroll
  for (int k = 0; k + 1 < kI8Stages; ++k) issue(k);

  // Thread c (one a channel): q⊙scale, q·zero and max |q⊙scale| over the block; then its U'
  // digits go to the bytes the B fragments read: lane (d, t) word ρ byte i, where channel c is
  // byte i, slot m of lane t's key word k (ρ = J·k + m).
  __shared__ float sh_red[2][4];
  __shared__ __align__(16) uint8_t sh_dig[4][4][8][4];
  const float u = qs[c] * __half2float(k_scale);
  const float qa_w = warp_sum(qs[c] * __half2float(k_zero)), umax_w = warp_max(fabsf(u));
  if (lane == 0) sh_red[0][warp] = qa_w, sh_red[1][warp] = umax_w;
  __syncthreads();
  const float qa = sh_red[0][0] + sh_red[0][1] + sh_red[0][2] + sh_red[0][3];
  const float umax = fmaxf(fmaxf(sh_red[1][0], sh_red[1][1]), fmaxf(sh_red[1][2], sh_red[1][3]));
  int ex = 0;
  frexpf(umax, &ex);  // umax < 2^ex
  const float sigma = umax > 0.0f ? ldexpf(1.0f, 22 - ex) : 1.0f;
  const float kfac = 1.0f / (sigma * static_cast<float>(1 << (BITS * (J - 1))));
  {
    const int m = c % J, i = (c / J) & 3, W = c / (4 * J), ct = W / BITS, k = W % BITS;  // word W = BITS·ct + k
    int x = __float2int_rn(u * sigma) * (1 << (BITS * (J - 1 - m)));  // |x| < 2^29
#pragma unroll
    for (int d = 0; d < 4; ++d) {
      const int dig = ((x & 255) ^ 128) - 128;  // balanced: x = dig + 256·x'
      sh_dig[d][ct][J * k + m][i] = static_cast<uint8_t>(dig);
      x = (x - dig) >> 8;
    }
  }
  __syncthreads();
  uint32_t bk[8];
  {
    const uint4* src = reinterpret_cast<const uint4*>(sh_dig[g & 3][t]);
    const uint4 x0 = src[0], x1 = src[1];
    const bool on = g < 4;
    bk[0] = on ? x0.x : 0u, bk[1] = on ? x0.y : 0u, bk[2] = on ? x0.z : 0u, bk[3] = on ? x0.w : 0u;
    bk[4] = on ? x1.x : 0u, bk[5] = on ? x1.y : 0u, bk[6] = on ? x1.z : 0u, bk[7] = on ? x1.w : 0u;
  }
  // Lane (·, t)'s share of a row's score: columns 2t and 2t+1 are digits 2t and 2t+1.
  const float dw = t == 0 ? 1.0f : t == 1 ? 65536.0f : 0.0f;

  // Values: D[u] (lane (g, 0): columns 0 and 1, the low and high bytes of P, of channels 16g + u
  // and 16g + 8 + u) while the maximum holds; acc[u][h] their fp32 sums low + 256·high.
  int D[8][4];
  float acc[8][2];
#pragma unroll
  for (int u2 = 0; u2 < 8; ++u2) {
    D[u2][0] = D[u2][1] = D[u2][2] = D[u2][3] = 0;
    acc[u2][0] = acc[u2][1] = 0.0f;
  }
  auto flush = [&](float alpha) {
#pragma unroll
    for (int u2 = 0; u2 < 8; ++u2) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float x = fmaf(256.0f, static_cast<float>(D[u2][2 * h + 1]), static_cast<float>(D[u2][2 * h]));
        acc[u2][h] = (acc[u2][h] + x) * alpha;
      }
      D[u2][0] = D[u2][1] = D[u2][2] = D[u2][3] = 0;
    }
  };
  float mw = -INFINITY, dsum = 0.0f;  // dsum in units of P
  float lo_ = lo, hi_ = hi;
  int held = 0;  // iterations since the last flush

  for (int j0 = a + 32 * warp, k = 0; j0 < e; j0 += 32 * nw, ++k) {
    __syncwarp();  // every lane is past the stage the next copy refills (read an iteration ago)
    issue(k + kI8Stages - 1);
    cp_async_wait<kI8Stages - 1>();
    __syncwarp();
    const uint8_t* stg = reinterpret_cast<const uint8_t*>(buf + (k % kI8Stages) * SZ);
    Tile<BITS> cur;
    if constexpr (!SCORES) load_keys<BITS>(stg, j0, e, g, t, cur);
    if constexpr (!RANGE) load_values<BITS>(stg, j0, e, g, t, cur);
    // Scores of rows g + 8x (x = 2·tile + h), full in lanes t = 0 and 1.
    float s[4];
    if constexpr (SCORES) {
      const float* ss = reinterpret_cast<const float*>(stg) + soff;
#pragma unroll
      for (int x = 0; x < 4; ++x) s[x] = t < 2 && j0 + 8 * x + g < e ? ss[8 * x + g] : -INFINITY;
    }
#pragma unroll
    for (int tile = 0; tile < 2 && !SCORES; ++tile) {
      int C[4] = {0, 0, 0, 0};
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        const int r0 = 2 * mm, r1 = 2 * mm + 1;  // operands ρ = J·k + m
        const uint32_t af[4] = {cur.k[2 * tile][r0 / J] & L::mask(r0 % J), cur.k[2 * tile + 1][r0 / J] & L::mask(r0 % J),
                                cur.k[2 * tile][r1 / J] & L::mask(r1 % J), cur.k[2 * tile + 1][r1 / J] & L::mask(r1 % J)};
        imma<true>(C, af, bk[r0], bk[r1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float x = fmaf(256.0f, static_cast<float>(C[2 * h + 1]), static_cast<float>(C[2 * h])) * dw;
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        const int r = j0 + 16 * tile + 8 * h + g;
        s[2 * tile + h] = (t < 2 && r < e) ? fmaf(x, kfac, qa) : -INFINITY;
      }
    }
    if constexpr (RANGE) {
      widen_range<4>(s, lo_, hi_);
      if (vsc && t == 0) {
#pragma unroll
        for (int x = 0; x < 4; ++x)
          if (j0 + 8 * x + g < e) vsc[j0 + 8 * x + g] = s[x];
      }
    } else {
      const float mx = warp_max_redux(calibrated_max<4>(s, mw, cal, cal_t, cal_g, tau1));
      if (mx > mw || held == 512) {  // the same in every lane
        const float alpha = mx > mw ? __expf(mw - mx) : 1.0f;
        dsum *= alpha;
        flush(alpha);
        mw = fmaxf(mw, mx);
        held = 0;
      }
      ++held;
      uint32_t P[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const float p = s[x] == -INFINITY ? 0.0f : fminf(__expf(s[x] - mw), 1.0f);
        P[x] = __float2uint_rn(p * 65535.0f);
      }
      if (t == 0) dsum += static_cast<float>(P[0] + P[1] + P[2] + P[3]);
      // Lane t of quad q: byte x = plane t of P(row q + 8x) (t ≥ 2: zeros).
      const uint32_t pk = t < 2 ? __byte_perm(P[0] | (P[1] << 16), P[2] | (P[3] << 16), t == 0 ? 0x6420 : 0x7531) : 0u;
      // B: lane (g, t) takes plane g of rows t + 8i (b0) and t + 4 + 8i (b1).
      const uint32_t z0 = __shfl_sync(0xffffffffu, pk, 4 * t + (g & 3));
      const uint32_t z1 = __shfl_sync(0xffffffffu, pk, 4 * t + 16 + (g & 3));
      const uint32_t b0 = g < 2 ? z0 : 0u, b1 = g < 2 ? z1 : 0u;
      // Bytewise transposes: T[s][b] = byte b of rows t + 4s + 8i in byte i.
      uint32_t Tb[2][L::NB];
#pragma unroll
      for (int s2 = 0; s2 < 2; ++s2)
#pragma unroll
        for (int w = 0; w < L::VW; ++w) {
          const uint32_t r0 = cur.v[s2][0][w], r1 = cur.v[s2][1][w], r2 = cur.v[s2][2][w], r3 = cur.v[s2][3][w];
          const uint32_t lo01 = __byte_perm(r0, r1, 0x5140), lo23 = __byte_perm(r2, r3, 0x5140);
          Tb[s2][4 * w] = __byte_perm(lo01, lo23, 0x5410);
          Tb[s2][4 * w + 1] = __byte_perm(lo01, lo23, 0x7632);
          if constexpr (L::NB >= 4) {
            const uint32_t hi01 = __byte_perm(r0, r1, 0x7362), hi23 = __byte_perm(r2, r3, 0x7362);
            Tb[s2][4 * w + 2] = __byte_perm(hi01, hi23, 0x5410);
            Tb[s2][4 * w + 3] = __byte_perm(hi01, hi23, 0x7632);
          }
        }
#pragma unroll
      for (int u2 = 0; u2 < 8; ++u2) {
        // Channel 16g + σ is byte σ / J, slot σ % J; mma u2 takes σ = u2 (rows g) and u2 + 8 (g + 8).
        const int sa = u2, sb = u2 + 8;
        const uint32_t af[4] = {Tb[0][sa / J] & L::mask(sa % J), Tb[0][sb / J] & L::mask(sb % J),
                                Tb[1][sa / J] & L::mask(sa % J), Tb[1][sb / J] & L::mask(sb % J)};
        imma<false>(D[u2], af, b0, b1);
      }
    }
  }
  if constexpr (RANGE) {
    lo = lo_;
    hi = hi_;
    return;
  }
  flush(1.0f);
  // Fold the part into lanes 0..15: lane li takes channels 8li..8li+7 = σ 8(li & 1)..+7 of lane
  // (li / 2, 0), each weighed by 2^−BITS·(σ mod J) and 1/65535.
  const float psum = warp_sum(dsum) * (1.0f / 65535.0f);
  const int src = 4 * ((lane & 15) >> 1), half = lane & 1;
  float raw[8];
#pragma unroll
  for (int u2 = 0; u2 < 8; ++u2) {
    const float v0 = __shfl_sync(0xffffffffu, acc[u2][0], src), v1 = __shfl_sync(0xffffffffu, acc[u2][1], src);
    raw[u2] = (half ? v1 : v0) * (1.0f / (65535.0f * static_cast<float>(1 << (BITS * (u2 % J)))));
  }
  if (lane >= 16 || mw == -INFINITY) return;
  float o[8];
#pragma unroll
  for (int u2 = 0; u2 < 8; ++u2) {
    const int r = (8 * lane + u2) * Pd.v.chan_stride;
    o[u2] = __half2float(Pd.v.scale[r]) * raw[u2] + __half2float(Pd.v.zero[r]) * psum;
  }
  join_part(st_io, mw, psum, o);
}

}  // namespace kvlens::cuda::i8_path
