// Decode attention's fast paths for token-wise values (included by decode_attention.cu, inside
// its anonymous namespace, after softmax_step): token-wise keys too (uniform's per-token parts
// and the packed decode rows), or channel-wise keys in range groups (KIVI's layout; with the
// values' CST factors, ZipCache's subsets).
#pragma once

// Token-wise BITS-bit keys and values, a range per row and no CST factors (per-token uniform
// quantization, the decode rows StepQuant packs): score_j = scale_j·(q·code_j) + zero_j·Σq, and
// the values accumulate (p_j·scale_j)·code_j + p_j·zero_j — the general path's arithmetic with
// the width known at compile time and every row's loads issued before any is used.
template <int L, int BITS, int U>
__device__ void token_rows(const PartDesc& P, int a, int e, const float* q, const Lane& ln, int g, bool cal,
                           float cal_t, float cal_g, float tau1, State& st) {
  constexpr int G = kThreads / L;
  constexpr uint32_t mask = (1u << BITS) - 1u;
  using Word = typename std::conditional<(BITS <= 4), uint32_t, uint64_t>::type;
  const int rowb = ln.D * BITS / 8;
  const uint8_t* K = static_cast<const uint8_t*>(P.k.data) + (ln.c0 / 8) * BITS;
  const uint8_t* V = static_cast<const uint8_t*>(P.v.data) + (ln.c0 / 8) * BITS;
  float qsum = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) qsum += q[c];
  qsum = group_sum<L>(qsum);
  for (int j0 = a; j0 < e; j0 += G * U) {
    Word kc[U], vc[U];
    float ks[U], kz[U], vs[U], vz[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * G + g;
      const bool in = j < e, ok = in && ln.active;
      kc[u] = ok ? static_cast<Word>(load_bits<BITS>(K + static_cast<int64_t>(j) * rowb)) : 0;
      vc[u] = ok ? static_cast<Word>(load_bits<BITS>(V + static_cast<int64_t>(j) * rowb)) : 0;
      ks[u] = in ? __half2float(__ldg(P.k.scale + j)) : 0.0f;
      kz[u] = in ? __half2float(__ldg(P.k.zero + j)) : 0.0f;
      vs[u] = in ? __half2float(__ldg(P.v.scale + j)) : 0.0f;
      vz[u] = in ? __half2float(__ldg(P.v.zero + j)) : 0.0f;
    }
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float d = 0.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c) d = fmaf(q[c], code_f(static_cast<uint32_t>(kc[u] >> (c * BITS)) & mask), d);
      d = group_sum<L>(d);
      sc[u] = j0 + u * G + g < e ? calibrated(fmaf(d, ks[u], qsum * kz[u]), cal, cal_t, cal_g, tau1) : -INFINITY;
    }
    softmax_step<U>(sc, st, [&](int u, float p) {
      const float ps = p * vs[u], pz = p * vz[u];
#pragma unroll
      for (int c = 0; c < 8; ++c)
        st.o[c] = fmaf(ps, code_f(static_cast<uint32_t>(vc[u] >> (c * BITS)) & mask), st.o[c]) + pz;
    });
  }
}

// Channel-wise BITS-bit keys (a range per channel and group of P.k.group rows: KIVI's key
// groups) with token-wise values of the same width: score_j = Σ_c q_c·(code_jc·s_gc + z_gc), g
// the row's group (this lane's 8 scales and zeros in two loads), values as token_rows takes them
// — with FACTOR, times their channels' CST factors (ZipCache's values: v_jc = f_c·(code_jc·s_j +
// z_j), this lane's 8 factors loaded once).
template <int L, int BITS, int U, bool FACTOR>
__device__ void channel_token_rows(const PartDesc& P, int a, int e, const float* q, const Lane& ln, int g, bool cal,
                                   float cal_t, float cal_g, float tau1, State& st) {
  constexpr int G = kThreads / L;
  constexpr uint32_t mask = (1u << BITS) - 1u;
  using Word = typename std::conditional<(BITS <= 4), uint32_t, uint64_t>::type;
  const int rowb = ln.D * BITS / 8, group = P.k.group;
  const uint8_t* K = static_cast<const uint8_t*>(P.k.data) + (ln.c0 / 8) * BITS;
  const uint8_t* V = static_cast<const uint8_t*>(P.v.data) + (ln.c0 / 8) * BITS;
  float f[8];
  if constexpr (FACTOR) unpack8<__half>(__ldg(reinterpret_cast<const uint4*>(P.v.factor + ln.c0)), f);
  for (int j0 = a; j0 < e; j0 += G * U) {
    Word kc[U], vc[U];
    uint4 ks[U], kz[U];
    float vs[U], vz[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * G + g;
      const bool in = j < e;
      const int64_t r = static_cast<int64_t>(in && group > 0 ? j / group : 0) * ln.D + ln.c0;
      kc[u] = in ? static_cast<Word>(load_bits<BITS>(K + static_cast<int64_t>(j) * rowb)) : 0;
      vc[u] = in ? static_cast<Word>(load_bits<BITS>(V + static_cast<int64_t>(j) * rowb)) : 0;
      ks[u] = __ldg(reinterpret_cast<const uint4*>(P.k.scale + r));
      kz[u] = __ldg(reinterpret_cast<const uint4*>(P.k.zero + r));
      vs[u] = in ? __half2float(__ldg(P.v.scale + j)) : 0.0f;
      vz[u] = in ? __half2float(__ldg(P.v.zero + j)) : 0.0f;
    }
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float sf[8], zf[8];
      unpack8<__half>(ks[u], sf);
      unpack8<__half>(kz[u], zf);
      float d = 0.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c)
        d = fmaf(q[c], fmaf(code_f(static_cast<uint32_t>(kc[u] >> (c * BITS)) & mask), sf[c], zf[c]), d);
      d = group_sum<L>(d);
      sc[u] = j0 + u * G + g < e ? calibrated(d, cal, cal_t, cal_g, tau1) : -INFINITY;
    }
    softmax_step<U>(sc, st, [&](int u, float p) {
      const float ps = p * vs[u], pz = p * vz[u];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const float x = code_f(static_cast<uint32_t>(vc[u] >> (c * BITS)) & mask);
        if constexpr (FACTOR) st.o[c] = fmaf(f[c], fmaf(ps, x, pz), st.o[c]);
        else st.o[c] = fmaf(ps, x, st.o[c]) + pz;
      }
    });
  }
}
