// Packed channel-wise parts of decode attention through lookup tables (head sizes other than
// 128, where such parts do not take the tensor-core path): included by decode_attention.cu,
// inside its anonymous namespace, which holds the rest of the kernel and the description of
// the cache.
#pragma once

// Channel-wise BITS-bit keys and values with one range per channel over the part: CalibQuant's
// post-scaling (q⊙scale folded into q, q·zero added; values scaled once per part). RANGE: only
// the min / max of the scores (the first pass of calibration).
//
// For BITS ≤ 4 the keys go through a table in shared memory built once per part: entry
// [byte position][byte value] = Σ over the byte's 8/BITS channels of (q⊙scale)_c · code_c, so a
// row's dot product is one lookup per byte of codes instead of a multiply-add per channel.
// Values: 1-bit codes add p to the channels whose bit is set; wider codes multiply-add.
template <int L, int BITS, int U, bool RANGE>
__device__ void packed_rows(const PartDesc& P, int a, int e, const float* q, const Lane& ln, int g, bool cal,
                            float cal_t, float cal_g, float tau1, State& st, float& lo, float& hi, float* lut) {
  constexpr int G = kThreads / L;
  constexpr uint32_t mask = (1u << BITS) - 1u;
  constexpr bool LUT = BITS <= 4;
  using Word = typename std::conditional<(BITS <= 4), uint32_t, uint64_t>::type;
  const int rowb = ln.D * BITS / 8;
  const uint8_t* K = static_cast<const uint8_t*>(P.k.data) + (ln.c0 / 8) * BITS;
  const uint8_t* V = static_cast<const uint8_t*>(P.v.data) + (ln.c0 / 8) * BITS;
  float qk[8], qa = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int ch = P.k.chan_stride ? ln.c0 + c : 0;
    qk[c] = ln.active ? q[c] * __half2float(P.k.scale[ch]) : 0.0f;
    if (ln.active) qa = fmaf(q[c], __half2float(P.k.zero[ch]), qa);
  }
  if constexpr (LUT) {
    // qk of every channel into the table's tail, then the table itself.
    constexpr int per = 8 / BITS;  // channels per byte
    const int npos = rowb, tab = npos * 256;
    float* qs = lut + tab;
    __syncthreads();  // the previous part's table is no longer read
    if (ln.active) {
#pragma unroll
      for (int c = 0; c < 8; ++c) qs[ln.c0 + c] = qk[c];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < tab; i += kThreads) {
      const int pos = i >> 8, v = i & 255;
      float t = 0.0f;
#pragma unroll
      for (int k = 0; k < per; ++k) t = fmaf(qs[pos * per + k], code_f((v >> (k * BITS)) & mask), t);
      lut[i] = t;
    }
    __syncthreads();
  }
  const float* mylut = lut + (ln.c0 / 8) * BITS * 256;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float psum = 0.0f;
  for (int j0 = a; j0 < e; j0 += G * U) {
    Word kc[U], vc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * G + g;
      const bool ok = j < e && ln.active;
      kc[u] = ok ? static_cast<Word>(load_bits<BITS>(K + static_cast<int64_t>(j) * rowb)) : 0;
      if constexpr (!RANGE) vc[u] = ok ? static_cast<Word>(load_bits<BITS>(V + static_cast<int64_t>(j) * rowb)) : 0;
    }
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float d = qa;
      if constexpr (LUT) {
#pragma unroll
        for (int b = 0; b < BITS; ++b) d += mylut[b * 256 + ((kc[u] >> (8 * b)) & 255u)];
      } else {
#pragma unroll
        for (int c = 0; c < 8; ++c) d = fmaf(qk[c], code_f(static_cast<uint32_t>(kc[u] >> (c * BITS)) & mask), d);
      }
      if (!ln.active) d = 0.0f;
      d = group_sum<L>(d);
      sc[u] = j0 + u * G + g < e ? d : -INFINITY;
    }
    if constexpr (RANGE) {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (sc[u] != -INFINITY) {
          lo = fminf(lo, sc[u]);
          hi = fmaxf(hi, sc[u]);
        }
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) sc[u] = calibrated(sc[u], cal, cal_t, cal_g, tau1);
      float mx = st.m;
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u]);
      if (mx > st.m) rescale(st, mx, __expf(st.m - mx), acc, &psum);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float p = sc[u] == -INFINITY ? 0.0f : __expf(sc[u] - st.m);
        st.d += p;
        psum += p;
        if constexpr (BITS == 1) {
#pragma unroll
          for (int c = 0; c < 8; ++c)
            if ((vc[u] >> c) & 1u) acc[c] += p;
        } else {
#pragma unroll
          for (int c = 0; c < 8; ++c) acc[c] = fmaf(p, code_f(static_cast<uint32_t>(vc[u] >> (c * BITS)) & mask), acc[c]);
        }
      }
    }
  }
  if constexpr (RANGE) return;
  if (!ln.active) return;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int ch = P.v.chan_stride ? ln.c0 + c : 0;
    st.o[c] += __half2float(P.v.scale[ch]) * acc[c] + __half2float(P.v.zero[ch]) * psum;
  }
}
