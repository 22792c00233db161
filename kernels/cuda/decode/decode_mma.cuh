// Packed channel-wise parts of decode attention on tensor cores (head size 128; included by
// decode_attention.cu, which holds the rest of the kernel and the description of the cache).
//
// A part of BITS-bit codes (4 or 8: 1 and 2 bits take the integer operands of decode_i8.cuh,
// which need fewer instructions a row) with fp16 scale/zero per channel (or one for all) is read
// by each warp in tiles of 16·TILES rows. Codes are never converted to floats one by one: a code at bit
// position p' ≤ 9 of a 16-bit half, with every other bit of the half cleared by one AND, *is* the
// fp16 subnormal code·2^(p'−24), so one logic operation turns two codes into an f16x2 operand of
// `mma.sync.m16n8k16` (codes higher in a half are shifted down first, one shift per word). The
// weights 2^(p'−24) are exact powers of two, folded into the other operand or into the output.
//
// Keys: S = K·q' with A = 16 rows × 16 channels of codes, as they lie in the row (thread t of a
// quad reads the 4·BITS bytes of channels 32t..32t+31 of rows g and g+8), and B = q' for those
// channels: q⊙scale (CalibQuant's post-scaling) times σ·2^(9−p') — σ a power of two that keeps
// it below 2^15 — split into an fp16 high and low part in the operand's columns 0 and 1, so the
// score C[r][0] + C[r][1] carries about 22 bits of q. q·zero is added once per row.
// Softmax: the scores of a tile (held by the quads' first lanes) give one maximum per tile and
// warp; p = exp(s − m) (after calibration g(x) on visual scores) is scaled by 2^14 and split into
// fp16 high/low parts the same way.
// Values: O^T = V^T·p with A = 16 channels × 16 rows of codes — lane g of the quad takes the
// 2·BITS bytes of channels 16g..16g+15 of rows 2t, 2t+1, 2t+8, 2t+9; one byte permute puts a pair
// of rows into the two halves of a register, and the same AND selects one channel of both — and
// B = p. The accumulators stay in the mma's fp32 fragments for the whole part; at its end
// scale_c·Σ p·code·2^(10−p') + zero_c·Σ p is folded into the warp's online-softmax state.
// Per row and thread group this is ~64 logic operations, 16 mma for 16 rows and no shared
// memory: 4-bit codes stream at close to the memory's rate; at 2 bits this path was bound by its
// logic operations (77 % of copy bandwidth at batch 16 / 64k on an H100, 90 % on decode_i8.cuh).
#pragma once

namespace kvlens::cuda::mma_path {

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int BITS>
struct Codes {
  static_assert(BITS == 4 || BITS == 8, "the fp16-operand path takes 4- and 8-bit codes (1 and 2: decode_i8.cuh)");
  static constexpr int per = 16 / BITS;  // codes per 16-bit half
  static constexpr int shift = 8;        // for codes that end above bit 9
  static constexpr int VW = BITS / 2;    // 32-bit words of a lane's 16 value codes
  // Position after the shift of code m of a half, and its AND mask over both halves.
  __host__ __device__ static constexpr bool direct(int m) { return m * BITS + BITS <= 10; }
  __host__ __device__ static constexpr int pos(int m) { return direct(m) ? m * BITS : m * BITS - shift; }
  __host__ __device__ static constexpr uint32_t mask(int m) { return (((1u << BITS) - 1u) << pos(m)) * 0x10001u; }
  // The f16x2 operand of code m of both halves of x (m is a constant once loops are unrolled).
  __device__ static __forceinline__ uint32_t pick(uint32_t x, int m) {
    return (direct(m) ? x : (x >> shift)) & mask(m);
  }
};

// A lane's key words and value words of one row (4 and 8 bits; 1 and 2 bits take decode_i8.cuh).
template <int BITS>
__device__ __forceinline__ void load_k(const uint8_t* p, uint32_t* w) {
#pragma unroll
  for (int i = 0; i < BITS / 4; ++i) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p) + i);
    w[4 * i] = u.x, w[4 * i + 1] = u.y, w[4 * i + 2] = u.z, w[4 * i + 3] = u.w;
  }
}

template <int BITS>
__device__ __forceinline__ void load_v(const uint8_t* p, uint32_t* w) {
  if constexpr (BITS == 4) {
    const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = u.x, w[1] = u.y;
  } else {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
  }
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float h_lo(uint32_t x) { return __half2float(__ushort_as_half(static_cast<unsigned short>(x))); }
__device__ __forceinline__ float h_hi(uint32_t x) { return __half2float(__ushort_as_half(static_cast<unsigned short>(x >> 16))); }

// Rows j0.. of one tile for lane (g, t): K rows g and g+8 of each 16-row block (4·BITS bytes of
// channels 32t..), V rows 2t, 2t+1, 2t+8, 2t+9 (2·BITS bytes of channels 16g..); zeros past e.
template <int BITS, int TILES, bool RANGE>
__device__ __forceinline__ void load_tile(const uint8_t* K, const uint8_t* V, int j0, int e, int g, int t,
                                          uint32_t (&kw)[TILES][2][BITS], uint32_t (&vw)[TILES][4][Codes<BITS>::VW]) {
  constexpr int RB = 16 * BITS;
#pragma unroll
  for (int i = 0; i < TILES; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = j0 + 16 * i + g + 8 * h;
      if (r < e) load_k<BITS>(K + static_cast<int64_t>(r) * RB + 4 * BITS * t, kw[i][h]);
      else
#pragma unroll
        for (int x = 0; x < BITS; ++x) kw[i][h][x] = 0u;
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int r = j0 + 16 * i + 2 * t + (h & 1) + 8 * (h >> 1);
      if (!RANGE && r < e) load_v<BITS>(V + static_cast<int64_t>(r) * RB + 2 * BITS * g, vw[i][h]);
      else
#pragma unroll
        for (int x = 0; x < Codes<BITS>::VW; ++x) vw[i][h][x] = 0u;
    }
  }
}

// Rows [a, e) of one packed part for this warp (warp w of nw takes tiles w, w + nw, ...).
// RANGE: min / max of the scores into lo / hi only. Otherwise the part's softmax state is merged
// into st of lanes 0..15 (the warp's first group of 16 lanes, 8 channels a lane); lanes 16..31
// keep theirs. qs: the block's scaled query in shared memory (128 floats).
template <int BITS, int TILES, bool RANGE>
__device__ __noinline__ void packed_mma(const PartDesc& P, int a, int e, const float* qs, int warp, int nw, bool cal, float cal_t,
                           float cal_g, float tau1, State& st_io, float& lo, float& hi) {
  using C = Codes<BITS>;
  constexpr int TR = 16 * TILES;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint8_t* K = static_cast<const uint8_t*>(P.k.data);
  const uint8_t* V = static_cast<const uint8_t*>(P.v.data);

  // The first tile's loads are issued before the query's preparation, which they overlap.
  uint32_t kw[TILES][2][BITS], vw[TILES][4][C::VW];
  load_tile<BITS, TILES, RANGE>(K, V, a + warp * TR, e, g, t, kw, vw);

  // q⊙scale of this lane's 4 channels for q·zero and the largest |q⊙scale| (σ).
  float qa = 0.0f, qmax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = lane * 4 + i;
    const float qk = qs[c] * __half2float(P.k.scale[c * P.k.chan_stride]);
    qa = fmaf(qs[c], __half2float(P.k.zero[c * P.k.chan_stride]), qa);
    qmax = fmaxf(qmax, fabsf(qk));
  }
  qa = warp_sum(qa);
  qmax = warp_max(qmax);
  int ex = 0;
  frexpf(qmax, &ex);  // qmax ≤ 2^ex
  const float sigma = qmax > 0.0f ? ldexpf(1.0f, 6 - ex) : 1.0f;
  const float kfac = 1.0f / (sigma * (1.0f / 32768.0f));
  // B operand of the keys: k-step s takes pairs 2s (k = 2t, 2t+1) and 2s+1 (k = 2t+8, 2t+9) of
  // lane t's channels; column 0 holds the high part, column 1 the low part, the rest zeros.
  uint32_t bq[8][2];
#pragma unroll
  for (int pi = 0; pi < 16; ++pi) {
    constexpr int per = C::per;
    const int wi = pi / per, m = pi % per;
    const int c_lo = 32 * t + wi * 2 * per + m, c_hi = c_lo + per;
    const float f = sigma * ldexpf(1.0f, 9 - C::pos(m));
    const float x0 = qs[c_lo] * __half2float(P.k.scale[c_lo * P.k.chan_stride]) * f;
    const float x1 = qs[c_hi] * __half2float(P.k.scale[c_hi * P.k.chan_stride]) * f;
    const uint32_t h = pack_h2(x0, x1);
    const uint32_t l = pack_h2(x0 - h_lo(h), x1 - h_hi(h));
    bq[pi >> 1][pi & 1] = g == 0 ? h : g == 1 ? l : 0u;
  }

  float oacc[8][4];
#pragma unroll
  for (int u = 0; u < 8; ++u) oacc[u][0] = oacc[u][1] = oacc[u][2] = oacc[u][3] = 0.0f;
  float mw = -INFINITY, dsum = 0.0f;

  // Each tile's codes are loaded one iteration ahead, while the previous tile is computed.
  float lo_ = lo, hi_ = hi;
  for (int j0 = a + warp * TR; j0 < e; j0 += nw * TR) {
    uint32_t kn[TILES][2][BITS], vn[TILES][4][C::VW];
    load_tile<BITS, TILES, RANGE>(K, V, j0 + nw * TR, e, g, t, kn, vn);
    // Scores of rows g and g+8 of each tile, in the quads' first lanes (−inf elsewhere).
    float sc[TILES][2];
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        uint32_t af[4];
        constexpr int per = C::per;
        // pairs 2s and 2s+1: word (2s)/per, code (2s)%per, and the next
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int p0 = 2 * s, p1 = 2 * s + 1;
          const uint32_t w0 = kw[i][h][p0 / per], w1 = kw[i][h][p1 / per];
          const uint32_t x0 = C::pick(w0, p0 % per), x1 = C::pick(w1, p1 % per);
          af[h] = x0;      // a0a1 (row g) / a2a3 (row g+8): k = 2t, 2t+1
          af[2 + h] = x1;  // a4a5 / a6a7: k = 2t+8, 2t+9
        }
        mma16816(c, af, bq[s]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = j0 + 16 * i + g + 8 * h;
        const float s = fmaf(c[2 * h] + c[2 * h + 1], kfac, qa);
        sc[i][h] = (t == 0 && r < e) ? s : -INFINITY;
      }
    }
    if constexpr (RANGE) {
      widen_range<2 * TILES>(&sc[0][0], lo_, hi_);
    } else {
      const float mx = warp_max_redux(calibrated_max<2 * TILES>(&sc[0][0], mw, cal, cal_t, cal_g, tau1));
      if (__any_sync(0xffffffffu, mx > mw)) {  // the same in every lane: a branch, not predication
        const float alpha = __expf(mw - mx);
        dsum *= alpha;
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int x = 0; x < 4; ++x) oacc[u][x] *= alpha;
        mw = mx;
      }
#pragma unroll
      for (int i = 0; i < TILES; ++i) {
        float pr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          pr[h] = sc[i][h] == -INFINITY ? 0.0f : __expf(sc[i][h] - mw);
          dsum += pr[h];
          pr[h] *= 16384.0f;
        }
        // Rows g (low half) and g+8 (high half), high and low parts.
        const uint32_t ph = pack_h2(pr[0], pr[1]);
        const uint32_t pl = pack_h2(pr[0] - h_lo(ph), pr[1] - h_hi(ph));
        const uint32_t h0 = __shfl_sync(0xffffffffu, ph, 8 * t), h1 = __shfl_sync(0xffffffffu, ph, 8 * t + 4);
        const uint32_t l0 = __shfl_sync(0xffffffffu, pl, 8 * t), l1 = __shfl_sync(0xffffffffu, pl, 8 * t + 4);
        const uint32_t x0 = g == 0 ? h0 : g == 1 ? l0 : 0u, x1 = g == 0 ? h1 : g == 1 ? l1 : 0u;
        const uint32_t bp[2] = {__byte_perm(x0, x1, 0x5410), __byte_perm(x0, x1, 0x7632)};
        // Rows (2t, 2t+1) and (2t+8, 2t+9) in the two halves of each register.
        uint32_t X[2][2 * C::VW];
#pragma unroll
        for (int pr2 = 0; pr2 < 2; ++pr2)
#pragma unroll
          for (int k = 0; k < C::VW; ++k) {
            X[pr2][2 * k] = __byte_perm(vw[i][2 * pr2][k], vw[i][2 * pr2 + 1][k], 0x5410);
            X[pr2][2 * k + 1] = __byte_perm(vw[i][2 * pr2][k], vw[i][2 * pr2 + 1][k], 0x7632);
          }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          constexpr int per = C::per;
          uint32_t af[4];
#pragma unroll
          for (int pr2 = 0; pr2 < 2; ++pr2) {
            const uint32_t xa = X[pr2][u / per], xb = X[pr2][(u + 8) / per];
            const uint32_t ya = C::pick(xa, u % per), yb = C::pick(xb, (u + 8) % per);
            af[2 * pr2] = ya;      // channel 16g + u
            af[2 * pr2 + 1] = yb;  // channel 16g + 8 + u
          }
          mma16816(oacc[u], af, bp);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int x = 0; x < BITS; ++x) kw[i][h][x] = kn[i][h][x];
#pragma unroll
      for (int h = 0; h < 4; ++h)
#pragma unroll
        for (int x = 0; x < C::VW; ++x) vw[i][h][x] = vn[i][h][x];
    }
  }
  if constexpr (RANGE) {
    lo = lo_;
    hi = hi_;
    return;
  }
  // Fold the part into lanes 0..15: lane li takes channels 8li..8li+7 = codes 8(li&1)..+7 of quad
  // li/2, whose first lane holds them as C[·][0] + C[·][1].
  const float psum = warp_sum(dsum);
  const int src = 4 * ((lane & 15) >> 1), half = lane & 1;
  float raw[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const float v0 = __shfl_sync(0xffffffffu, oacc[u][0] + oacc[u][1], src);
    const float v1 = __shfl_sync(0xffffffffu, oacc[u][2] + oacc[u][3], src);
    raw[u] = half ? v1 : v0;
  }
  if (lane >= 16 || mw == -INFINITY) return;
  float o[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int c = 8 * lane + u, code = 8 * half + u;
    const float w = ldexpf(1.0f / 16384.0f, 24 - C::pos(code % C::per));
    const int r = c * P.v.chan_stride;
    o[u] = __half2float(P.v.scale[r]) * raw[u] * w + __half2float(P.v.zero[r]) * psum;
  }
  join_part(st_io, mw, psum, o);
}

}  // namespace kvlens::cuda::mma_path
