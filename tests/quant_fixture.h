// The hand-built stores the quantization tests share: a one-layer store of system / visual /
// post-vision text tokens over GQA heads, with its original rows, prompt queries and causal
// attention, and checks of what a quantized store holds.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

#include "core/compress/quant_methods.h"
#include "core/compress/quantize.h"
#include "kernels/cpu/ops.h"
#include "tests/held_attention.h"

namespace kvlens::testing {

using quant::round_half;

inline const SegmentKind kS = SegmentKind::System, kV = SegmentKind::Visual, kT = SegmentKind::PostVisionText;

// A one-layer store of n_sys system, n_vis visual and n_txt text tokens with H query heads over
// KH KV heads, its original rows, prompt queries and causal attention of every query head.
struct Fixture {
  int H = 4, KH = 2, D = 16, T = 0;
  std::vector<SegmentKind> kinds;
  std::vector<int> ids;
  std::vector<float> k, v, q, probs, scores;  // k, v: [T][KH][D]; q: [T][H][D]; probs: [H][T][T]
  mutable std::shared_ptr<kvlens::testing::HeldAttention> held;  // over probs, for ctx()
  std::vector<float> dq;                      // decode queries [step][H][D]
  KVStore store;
  RowStorage rows = RowStorage::Fp32;  // the run's dense-row storage (decode's kv_storage)
  std::mt19937_64 rng;
  float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }

  Fixture(int n_sys, int n_vis, int n_txt, int d, uint64_t seed, int kv_heads = 2)
      : KH(kv_heads), D(d), rng(seed) {
    T = n_sys + n_vis + n_txt;
    for (int i = 0; i < T; ++i) {
      kinds.push_back(i < n_sys ? kS : i < n_sys + n_vis ? kV : kT);
      ids.push_back(i == 0 ? 1 : 100 + i);
    }
    k.resize(static_cast<size_t>(T) * KH * D), v.resize(k.size()), q.resize(static_cast<size_t>(T) * H * D);
    for (size_t i = 0; i < k.size(); ++i)  // keys with outlier channels
      k[i] = normal() * (i % D % 5 == 0 ? 6.0f : 1.0f) + (i % D % 3 == 0 ? 2.0f : 0.0f), v[i] = normal();
    for (float& x : q) x = normal();
    std::vector<int32_t> pos(T);
    std::iota(pos.begin(), pos.end(), 0), store = KVStore(1, KH, D);
    store.append(0, k.data(), v.data(), pos.data(), kinds.data(), T);
    scores.assign(static_cast<size_t>(H) * T * T, -INFINITY);  // causal: keys j ≤ query i
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < T; ++i)
        for (int j = 0; j <= i; ++j)
          scores[(static_cast<size_t>(h) * T + i) * T + j] = static_cast<float>(
              std::inner_product(key(j, h / (H / KH)), key(j, h / (H / KH)) + D, &q[(static_cast<size_t>(i) * H + h) * D], 0.0) / std::sqrt(D));
    probs = scores;
    cpu::softmax_rows(probs.data(), static_cast<int64_t>(H) * T, T);
  }
  const float* key(int t, int kh) const { return &k[(static_cast<size_t>(t) * KH + kh) * D]; }
  const float* val(int t, int kh) const { return &v[(static_cast<size_t>(t) * KH + kh) * D]; }
  PrefillContext ctx() const {
    held = std::make_shared<kvlens::testing::HeldAttention>(1, H, T, [this](int) { return &probs; });
    PrefillContext c;
    c.n_layers = 1, c.n_heads = H, c.n_kv_heads = KH, c.head_dim = D, c.prompt_len = T;
    c.attention = held.get();
    c.token_kinds = &kinds, c.token_ids = &ids;
    return c;
  }
  // As the decode loop does: dense rows stored as the policy or the run says, then on_prefill.
  void prefill(KVPolicy& p) {
    store.set_row_storage(decode_row_storage(&p, rows));
    p.on_prefill({ctx()}, store);
  }
  // Appends `steps` generated tokens, calling the decode hook after each; originals are kept.
  void decode(KVPolicy& p, int steps) {
    for (int s = 0; s < steps; ++s) {
      std::vector<float> nk(static_cast<size_t>(KH) * D), nv(nk.size()), nq(static_cast<size_t>(H) * D);
      for (std::vector<float>* x : {&nk, &nv, &nq}) std::generate(x->begin(), x->end(), [this] { return normal(); });
      DecodeContext d;  // the new token's position follows every token so far
      d.position = static_cast<int>(k.size() / (static_cast<size_t>(KH) * D));
      d.step = d.position - T, d.n_heads = H, d.n_kv_heads = KH, d.head_dim = D, d.q = nq.data();
      k.insert(k.end(), nk.begin(), nk.end()), v.insert(v.end(), nv.begin(), nv.end()), dq.insert(dq.end(), nq.begin(), nq.end());
      const SegmentKind g = SegmentKind::Generated;
      store.append(0, nk.data(), nv.data(), &d.position, &g, 1);
      p.on_decode_step(d, store.layer(0));
    }
  }
};

// The largest error of the stored affine format on values in [lo, hi] at b bits: half the
// fp16 step, the fp16 rounding of α, the part of the range the rounded step no longer covers,
// and float rounding of the arithmetic.
inline double affine_bound(double lo, double hi, int bits) {
  const double L = quant::max_code(bits);
  const double a = round_half(static_cast<float>(lo));
  const double s = hi > lo ? round_half(static_cast<float>((hi - lo) / L)) : 0.0;
  return s / 2 + std::fabs(a - lo) + std::max(0.0, hi - (a + L * s)) +
         8 * FLT_EPSILON * (std::fabs(lo) + std::fabs(hi) + L * s);
}

// Every segment reports what it holds: 4-byte positions, dense bytes for plain rows (4 B per
// fp32 value, 2 B per fp16 value), and payload bytes as allocated. Segments quantized together
// share one payload (ZipCache's per-layer groups); its bytes are counted once, on the first of
// them, so the codes, scales, zeros and meta of a payload's segments sum to what it allocated.
inline void expect_accounting(const KVStore& st) {
  for (int l = 0; l < st.n_layers(); ++l) {
    std::map<const SegmentPayload*, KVBytes> sums;
    for (const KVSegment& s : st.layer(l).segments) {
      int64_t idx = 0;
      for (const HeadRows& r : s.heads) {
        idx += 4LL * r.n();
        ASSERT_EQ(r.k.size(), static_cast<size_t>(r.n()) * st.head_dim());
        ASSERT_EQ(r.v.size(), r.k.size());
      }
      EXPECT_EQ(s.bytes.indices, idx) << s.storage;
      if (!s.payload) {
        EXPECT_TRUE(s.storage == "fp32" || s.storage == "fp16") << s.storage;
        EXPECT_EQ(s.bytes.total(), s.dense_bytes(st.head_dim(), s.storage == "fp16" ? 2 : 4).total());
        continue;
      }
      const bool first = sums.count(s.payload.get()) == 0;
      KVBytes& sum = sums[s.payload.get()];
      if (!first) {
        EXPECT_EQ(s.bytes.total(), idx) << s.storage << ": a shared payload counts on its first segment";
      }
      sum += s.bytes;
      sum.indices -= idx;
    }
    for (const auto& [p, b] : sums) {
      const KVBytes a = p->allocated();
      EXPECT_TRUE(b.codes == a.codes && b.scales == a.scales && b.zeros == a.zeros && b.meta == a.meta && b.indices == 0)
          << "layer " << l << ": " << b.total() << " counted, " << a.total() << " allocated";
    }
  }
}

inline const quant::QuantPayload& payload(const KVSegment& s) {
  if (auto p = std::dynamic_pointer_cast<quant::QuantPayload>(s.payload)) {
    p->land();
    return *p;
  }
  throw std::runtime_error("segment has no QuantPayload: " + s.storage);
}

// Indices by descending score, ties to the earlier index.
inline std::vector<int> ranked(const std::vector<double>& score) {
  std::vector<int> idx(score.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score[a] > score[b]; });
  return idx;
}

inline bool same_rows(const KVSegment& a, const KVSegment& b) {
  if (a.heads.size() != b.heads.size() || a.storage != b.storage || a.bytes.total() != b.bytes.total()) return false;
  for (size_t h = 0; h < a.heads.size(); ++h)
    if (a.heads[h].k != b.heads[h].k || a.heads[h].v != b.heads[h].v || a.heads[h].pos != b.heads[h].pos) return false;
  return true;
}


// The bits each row of head kh is stored with, over all segments in order (unannotated rows
// read as the segment's plain storage: fp32 32, fp16 16).
inline std::vector<int> row_bits_of(const LayerKV& L, int kh) {
  std::vector<int> out;
  for (const KVSegment& s : L.segments) {
    const HeadRows& r = s.heads[kh];
    if (!r.bits.empty()) {
      EXPECT_EQ(r.bits.size(), static_cast<size_t>(r.n())) << s.storage;
    } else {
      EXPECT_TRUE(s.storage == "fp32" || s.storage == "fp16") << s.storage << " has no row bits";
    }
    for (int i = 0; i < r.n(); ++i) out.push_back(quant::row_bits(r, i, s.storage == "fp16" ? 16 : 32));
  }
  return out;
}


}  // namespace kvlens::testing
