// The general path of decode attention (included by decode_attention.cu after its softmax
// state, inside its anonymous namespace): any storage on either side — fp16 rows, channel-wise
// codes with one range per channel, per group of rows (KIVI keys) or one for all, token-wise
// codes with the CST factors, 1-bit values channel-major — one row per group of L lanes, 8
// channels a lane, with the same online softmax as the fast paths; and the only path that reads
// or writes materialized scores (kScores, scores_in).
#pragma once

// The `bits` bytes holding one lane's 8 codes of a row (bits·8 bits), as an integer.
__device__ __forceinline__ uint64_t load_codes(const uint8_t* p, int bits) {
  switch (bits) {
    case 1: return *p;
    case 2: return (reinterpret_cast<uintptr_t>(p) & 1) ? (p[0] | (uint32_t(p[1]) << 8)) : *reinterpret_cast<const uint16_t*>(p);
    case 4:
      if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) return *reinterpret_cast<const uint32_t*>(p);
      break;
    case 8:
      if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
      break;
    default: break;
  }
  uint64_t w = 0;
  for (int i = 0; i < bits; ++i) w |= static_cast<uint64_t>(p[i]) << (8 * i);
  return w;
}

__device__ __forceinline__ void codes8(uint64_t w, int bits, float* f) {
  const uint32_t mask = (1u << bits) - 1u;
#pragma unroll
  for (int c = 0; c < 8; ++c) f[c] = code_f(static_cast<uint32_t>(w >> (c * bits)) & mask);
}

// One side's 8 values of row j for this lane, in the side's own terms: fp16 values, or codes.
__device__ __forceinline__ void load_side(const KvSide& s, int j, int D, int c0, float* f) {
  if (s.fmt == kF16) {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const __half*>(s.data) + static_cast<int64_t>(j) * D + c0);
    unpack8<__half>(u, f);
  } else {
    const uint8_t* row = static_cast<const uint8_t*>(s.data) + static_cast<int64_t>(j) * (D * s.bits / 8);
    codes8(load_codes(row + (c0 / 8) * s.bits, s.bits), s.bits, f);
  }
}

// The same for values stored channel-major by groups of 32 rows (kChannelT; n rows in the part,
// the rows past the last whole group row-major).
__device__ __forceinline__ void load_blocked(const KvSide& s, int j, int n, int D, int c0, float* f) {
  if (j >= (n & ~31)) {
    load_side(s, j, D, c0, f);
    return;
  }
  const uint32_t* w = static_cast<const uint32_t*>(s.data) + static_cast<int64_t>(j >> 5) * D + c0;
  const int o = j & 31, bit = 4 * (o & 7) + 2 * (o >> 4) + ((o >> 3) & 1);  // block_row's inverse
#pragma unroll
  for (int c = 0; c < 8; ++c) f[c] = static_cast<float>((w[c] >> bit) & 1u);
}

// Per-part precomputation of the K side for this lane: qk (q in the side's terms) and qa (the
// lane's share of the additive term).
__device__ __forceinline__ void k_prep(const KvSide& k, int n, const float* q, const Lane& ln, float* qk, float& qa,
                                       bool& grouped) {
  qa = 0.0f;
  grouped = k.fmt == kChannel && k.group > 0 && k.group < n;
#pragma unroll
  for (int c = 0; c < 8; ++c) qk[c] = q[c];
  if (!ln.active) return;
  if (k.fmt == kChannel && !grouped) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int ch = k.chan_stride ? ln.c0 + c : 0;
      qk[c] = q[c] * __half2float(k.scale[ch]);
      qa = fmaf(q[c], __half2float(k.zero[ch]), qa);
    }
  } else if (k.fmt == kToken) {
#pragma unroll
    for (int c = 0; c < 8; ++c) qa += q[c];  // Σq, multiplied by each row's zero
  }
}

// This lane's share of row j's score (before the group reduction).
__device__ __forceinline__ float k_partial(const KvSide& k, bool grouped, int j, const float* q, const float* qk,
                                           float qa, const Lane& ln) {
  if (!ln.active) return 0.0f;
  float f[8];
  load_side(k, j, ln.D, ln.c0, f);
  float s = 0.0f;
  if (k.fmt == kF16) {
#pragma unroll
    for (int c = 0; c < 8; ++c) s = fmaf(qk[c], f[c], s);
  } else if (k.fmt == kChannel) {
    if (!grouped) {
#pragma unroll
      for (int c = 0; c < 8; ++c) s = fmaf(qk[c], f[c], s);
      s += qa;
    } else {
      const int g = j / k.group;
      const int nr = k.chan_stride ? ln.D : 1;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int ch = g * nr + (k.chan_stride ? ln.c0 + c : 0);
        s = fmaf(q[c], fmaf(f[c], __half2float(k.scale[ch]), __half2float(k.zero[ch])), s);
      }
    }
  } else {
    float d = 0.0f;
#pragma unroll
    for (int c = 0; c < 8; ++c) d = fmaf(qk[c], f[c], d);
    s = d * __half2float(k.scale[j]) + qa * __half2float(k.zero[j]);
  }
  return s;
}

// Rows [a, e) of one part for every group of the block. mode kAttend: softmax + values; kRange:
// min/max of visual scores into lo/hi; kScores: raw scores to srow (index base + row).
template <int L>
__device__ __forceinline__ void run_part_in(const PartDesc& P, int n, int a, int e, int base, const float* q,
                                            const Lane& ln, int g, int mode, bool cal, float cal_t, float cal_g,
                                            float tau1, const float* sin, float* sout, State& st, float& lo, float& hi) {
  constexpr int G = kThreads / L;
  float qk[8], qa;
  bool kgrouped;
  const bool need_k = sin == nullptr;
  if (need_k) k_prep(P.k, n, q, ln, qk, qa, kgrouped);
  const KvSide& V = P.v;
  const bool vgrouped = V.fmt == kChannel && V.group > 0 && V.group < n;
  // (token-wise values with CST factors a group of rows, ZipCache's streamed gaps: each row's own)
  const bool fgrouped = V.fmt == kToken && V.factor && V.group > 0 && V.group < n;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float psum = 0.0f;
  for (int j0 = a; j0 < e; j0 += G * kUnroll) {
    float sc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * G + g;
      float part = 0.0f;
      if (j < e && need_k) part = k_partial(P.k, kgrouped, j, q, qk, qa, ln);
      if (need_k) part = group_sum<L>(part);
      sc[u] = j < e ? (need_k ? part : sin[base + j]) : -INFINITY;
    }
    if (mode == kScores) {
      if (ln.c0 == 0) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int j = j0 + u * G + g;
          if (j < e) sout[base + j] = sc[u];
        }
      }
      continue;
    }
    if (mode == kRange) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (isfinite(sc[u])) {
          lo = fminf(lo, sc[u]);
          hi = fmaxf(hi, sc[u]);
        }
      continue;
    }
    if (cal) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (isfinite(sc[u])) sc[u] = cal_t == 0.0f ? cal_g - tau1 : cal_t * (sc[u] - cal_g) + cal_g - tau1;
    }
    float mx = st.m;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) mx = fmaxf(mx, sc[u]);
    if (mx > st.m) rescale(st, mx, expf(st.m - mx), acc, &psum);  // (no valid row in this batch leaves mx = st.m)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * G + g;
      if (j >= e || sc[u] == -INFINITY) continue;
      const float p = expf(sc[u] - st.m);
      st.d += p;
      if (!ln.active) continue;
      float f[8];
      if (V.fmt == kChannelT) load_blocked(V, j, n, ln.D, ln.c0, f);
      else load_side(V, j, ln.D, ln.c0, f);
      if (V.fmt == kF16) {
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = fmaf(p, f[c], acc[c]);
      } else if ((V.fmt == kChannel || V.fmt == kChannelT) && !vgrouped) {
        psum += p;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = fmaf(p, f[c], acc[c]);
      } else if (V.fmt == kChannel) {
        const int gr = j / V.group, nr = V.chan_stride ? ln.D : 1;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const int ch = gr * nr + (V.chan_stride ? ln.c0 + c : 0);
          acc[c] = fmaf(p, fmaf(f[c], __half2float(V.scale[ch]), __half2float(V.zero[ch])), acc[c]);
        }
      } else if (fgrouped) {
        const float ps = p * __half2float(V.scale[j]), pz = p * __half2float(V.zero[j]);
        const __half* fr = V.factor + static_cast<int64_t>(j / V.group) * ln.D + ln.c0;
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = fmaf(__half2float(fr[c]), fmaf(ps, f[c], pz), acc[c]);
      } else {
        const float ps = p * __half2float(V.scale[j]), pz = p * __half2float(V.zero[j]);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] = fmaf(ps, f[c], acc[c]) + pz;
      }
    }
  }
  if (mode != kAttend || !ln.active) return;
  // Fold the part's accumulators into the output (post-scaling / CST factors).
  if ((V.fmt == kChannel || V.fmt == kChannelT) && !vgrouped) {
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int ch = V.chan_stride ? ln.c0 + c : 0;
      st.o[c] += __half2float(V.scale[ch]) * acc[c] + __half2float(V.zero[ch]) * psum;
    }
  } else if (V.fmt == kToken && V.factor && !fgrouped) {
#pragma unroll
    for (int c = 0; c < 8; ++c) st.o[c] += __half2float(V.factor[ln.c0 + c]) * acc[c];
  } else {
#pragma unroll
    for (int c = 0; c < 8; ++c) st.o[c] += acc[c];
  }
}

template <int L>
__device__ __noinline__ void run_part(const PartDesc& P, int n, int a, int e, int base, const float* q_in,
                                      const Lane& ln, int g, int mode, bool cal, float cal_t, float cal_g, float tau1,
                                      const float* sin, float* sout, State& st_io, float& lo_io, float& hi_io) {
  float q[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) q[c] = q_in[c];
  State st = st_io;
  float lo = lo_io, hi = hi_io;
  run_part_in<L>(P, n, a, e, base, q, ln, g, mode, cal, cal_t, cal_g, tau1, sin, sout, st, lo, hi);
  st_io = st;
  lo_io = lo;
  hi_io = hi;
}
