// Quantization policies against direct computations of their formulas, on fresh seeded random
// stores built by hand (system / visual / post-vision text segments, GQA heads). Tolerances are
// derived from the stored format: half a step, the fp16 rounding of the range, float epsilon.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/compress/method.h"
#include "core/compress/quant_methods.h"
#include "core/compress/quantize.h"
#include "kernels/cpu/ops.h"
#include "tests/quant_fixture.h"

using namespace kvlens;
using namespace kvlens::testing;
using quant::round_half;


TEST(Quantize, EqThreeAndFourDirectly) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-50, 50);  // x̂ and the error bound from Eq. 3/4
  for (int bits : {1, 2, 3, 4, 8})
    for (int trial = 0; trial < 200; ++trial) {
      float a = static_cast<float>(u(rng)), b = static_cast<float>(u(rng));
      if (a > b) std::swap(a, b);  // random range [α, β], x inside it
      const float x = a + static_cast<float>(std::uniform_real_distribution<double>(0, 1)(rng)) * (b - a);
      const double L = (1 << bits) - 1;
      const uint32_t c = quant::quantize(x, a, b, bits);
      EXPECT_EQ(c, static_cast<uint32_t>(std::nearbyint((static_cast<double>(x) - a) * L / (static_cast<double>(b) - a))));
      const double xh = quant::dequantize(c, a, b, bits);  // Eq. 4, and within half a step of x
      EXPECT_NEAR(xh, c * (static_cast<double>(b) - a) / L + a, 4 * FLT_EPSILON * (std::fabs(a) + std::fabs(b)));
      EXPECT_LE(std::fabs(xh - x), (b - a) / L / 2 + 8 * FLT_EPSILON * (std::fabs(a) + std::fabs(b)));
    }
  EXPECT_TRUE(quant::quantize(3.0f, 3.0f, 3.0f, 2) == 0u && quant::dequantize(0, 3.0f, 3.0f, 2) == 3.0f);  // β = α
  EXPECT_EQ(quant::quantize(9.0f, 0.0f, 1.0f, 2), 3u);  // clamped
}

TEST(Quantize, HalfPrecisionRoundTrip) {
  for (float x : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.9604645e-08f, 1000.5f})
    EXPECT_EQ(quant::from_half(quant::to_half(x)), x) << x;
  EXPECT_TRUE(round_half(1000.25f) == 1000.0f && round_half(1000.75f) == 1001.0f);  // ties to even (ulp 0.5)
  EXPECT_TRUE(std::isinf(quant::from_half(quant::to_half(1e6f))));
  std::mt19937_64 rng(3);
  for (int i = 0; i < 10000; ++i) {  // within half an fp16 ulp: 2^-11 relative, 2^-25 near 0
    const float x = std::normal_distribution<float>(0, 100)(rng);
    EXPECT_LE(std::fabs(round_half(x) - x), std::ldexp(std::fabs(x), -11) + 3e-8f) << x;
  }
}

TEST(Quantize, BitPackingRoundTrip) {
  std::mt19937_64 rng(5);
  for (int bits : {1, 2, 3, 4, 8})
    for (int n : {1, 3, 7, 13, 64, 101}) {
      std::vector<uint32_t> codes(n), back(n);
      std::vector<uint8_t> out = {0xAB};  // packing appends after what is there
      for (uint32_t& c : codes) c = static_cast<uint32_t>(rng() % (1u << bits));
      quant::pack(codes.data(), n, bits, out);
      ASSERT_EQ(out.size(), 1 + static_cast<size_t>((n * bits + 7) / 8));
      ASSERT_EQ(out[0], 0xAB);
      quant::unpack(out.data() + 1, n, bits, back.data());
      EXPECT_EQ(back, codes) << bits << " bits, n=" << n;
    }
}

// Channel-wise and global ranges per group of rows (UniformSpec::group, KIVI's key groups): each
// group's ranges are its own rows' min and max (a shorter last group too), one after another,
// and every value decodes within half a step of its group's range.
TEST(Quantize, RangesPerGroupOfRows) {
  std::mt19937_64 rng(17);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const int n = 45, d = 16, G = 8, bits = 2;
  for (quant::Axis axis : {quant::Axis::PerChannel, quant::Axis::Global}) {
    std::vector<float> x(static_cast<size_t>(n) * d);
    for (float& v : x) v = round_half(nd(rng));
    std::vector<float> y = x;
    quant::QuantBlock b;
    quant::quantize_block(y.data(), n, d, {bits, axis, 1.0f, true, G}, b);
    const int per = axis == quant::Axis::PerChannel ? d : 1, groups = (n + G - 1) / G;
    ASSERT_EQ(b.scales.size(), static_cast<size_t>(groups * per));
    ASSERT_EQ(b.codes.size(), static_cast<size_t>(n * d * bits / 8));
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < per; ++c) {
        float lo = INFINITY, hi = -INFINITY;
        for (int r = g * G; r < std::min(n, (g + 1) * G); ++r)
          for (int e = 0; e < d; ++e)
            if (per == 1 || e == c) {
              lo = std::min(lo, x[static_cast<size_t>(r) * d + e]);
              hi = std::max(hi, x[static_cast<size_t>(r) * d + e]);
            }
        const size_t i = static_cast<size_t>(g * per + c);
        EXPECT_EQ(quant::from_half(b.zeros[i]), round_half(lo)) << "group " << g << " range " << c;
        const float step = quant::from_half(b.scales[i]);
        EXPECT_NEAR(step, (hi - lo) / 3.0f, std::ldexp(hi - lo, -10)) << "group " << g << " range " << c;
        for (int r = g * G; r < std::min(n, (g + 1) * G); ++r)
          for (int e = 0; e < d; ++e)
            if (per == 1 || e == c) {
              const size_t k = static_cast<size_t>(r) * d + e;
              EXPECT_LE(std::fabs(y[k] - x[k]), step / 2 + std::ldexp(std::fabs(hi) + std::fabs(lo), -10)) << r << "," << e;
            }
      }
  }
}

TEST(Quantize, ChannelMajorGroupsOfOneBitCodes) {
  // block_row is a permutation of 0..31; every code of a whole group is found at its word and
  // bit, the rows past the last group are untouched, and the size is the packed rows' size.
  std::set<int> rows;
  for (int i = 0; i < 32; ++i) rows.insert(quant::block_row(i));
  EXPECT_EQ(rows.size(), 32u);
  EXPECT_EQ(*rows.begin(), 0);
  EXPECT_EQ(*rows.rbegin(), 31);
  std::mt19937_64 rng(17);
  for (int d : {8, 40, 64, 128})
    for (int64_t n : {0, 5, 32, 77, 96}) {
      std::vector<uint8_t> packed(static_cast<size_t>(n * d / 8));
      for (uint8_t& b : packed) b = static_cast<uint8_t>(rng());
      const auto g = quant::channel_major_1bit(packed.data(), n, d);
      ASSERT_EQ(g.size(), packed.size()) << "d=" << d << " n=" << n;
      // (and its inverse gives the rows back)
      EXPECT_EQ(quant::rows_from_channel_major_1bit(g.data(), n, d), packed) << "d=" << d << " n=" << n;
      for (int64_t j = 0; j < n; ++j)
        for (int c = 0; c < d; ++c) {
          const uint32_t want = quant::unpack_one(packed.data(), j * d + c, 1);
          uint32_t got;
          if (j < n / 32 * 32) {
            int bit = -1;
            for (int i = 0; i < 32; ++i)
              if (quant::block_row(i) == j % 32) bit = i;
            got = quant::unpack_one(g.data(), ((j / 32) * d + c) * 32 + bit, 1);
          } else {
            got = quant::unpack_one(g.data(), j * d + c, 1);
          }
          ASSERT_EQ(got, want) << "d=" << d << " n=" << n << " row " << j << " channel " << c;
        }
    }
}

TEST(Quantize, DeferredArraysLandOnceWhenAskedFor) {
  // A payload whose arrays stay where they were made: counted before they land, landed by the
  // first reader only (however many threads ask at once), copied landed, and a landing that
  // writes other sizes than it counted is refused.
  std::mt19937_64 rng(5);
  std::vector<uint8_t> codes(4099);
  std::vector<uint16_t> ranges(37);
  for (uint8_t& b : codes) b = static_cast<uint8_t>(rng());
  for (uint16_t& x : ranges) x = static_cast<uint16_t>(rng());
  auto p = std::make_shared<quant::QuantPayload>(2);
  p->k[0].flags = {0x5a};  // (what the host holds already is counted too)
  int landings = 0;
  KVBytes counted;
  counted.codes = static_cast<int64_t>(codes.size());
  counted.scales = counted.zeros = static_cast<int64_t>(ranges.size()) * 2;
  p->defer(counted, [&, q = p.get()] {
    ++landings;
    q->k[1].codes = codes;
    q->v[0].scales = ranges;
    q->v[0].zeros = ranges;
  });
  EXPECT_TRUE(p->deferred());
  p->shrink_to_fit();  // (installing a payload lands nothing)
  EXPECT_EQ(landings, 0);
  const KVBytes before = p->allocated();
  EXPECT_EQ(before.codes, 4099);
  EXPECT_EQ(before.scales, 74);
  EXPECT_EQ(before.zeros, 74);
  EXPECT_EQ(before.meta, 1);
  EXPECT_TRUE(p->k[1].codes.empty());
  std::vector<std::thread> readers;
  for (int i = 0; i < 4; ++i) readers.emplace_back([&] { EXPECT_EQ(quant::landed(p.get()), p.get()); });
  for (std::thread& t : readers) t.join();
  EXPECT_EQ(landings, 1);
  EXPECT_FALSE(p->deferred());
  EXPECT_EQ(p->k[1].codes, codes);
  EXPECT_EQ(p->v[0].zeros, ranges);
  EXPECT_EQ(p->allocated().total(), before.total());
  p->land();
  EXPECT_EQ(landings, 1);

  // A copy of a deferred payload lands it first and is not deferred itself.
  auto r = std::make_shared<quant::QuantPayload>(1);
  r->defer(counted, [&, q = r.get()] {
    q->k[0].codes = codes;
    q->v[0].scales = q->v[0].zeros = ranges;
  });
  const quant::QuantPayload copy(*r);
  EXPECT_FALSE(r->deferred());
  EXPECT_FALSE(copy.deferred());
  EXPECT_EQ(copy.k[0].codes, codes);

  // Sizes other than those counted: an error naming both, the landing not tried again.
  quant::QuantPayload bad(1);
  int tries = 0;
  bad.defer(counted, [&] {
    ++tries;
    bad.k[0].codes = codes;
  });
  try {
    bad.land();
    ADD_FAILURE() << "a landing of other sizes than counted was taken";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("4099 bytes"), std::string::npos) << e.what();
  }
  bad.land();
  EXPECT_EQ(tries, 1);
  EXPECT_EQ(quant::landed(nullptr), nullptr);
}

TEST(Uniform, GranularitiesAndScope) {
  for (const char* g : {"global", "per-token", "per-channel"})
    for (int bits : {1, 3, 8}) {
      Fixture f(5, 20, 6, 16, 21);
      f.prefill(*make_policy("uniform:bits=" + std::to_string(bits) + ",k_granularity=" + g + ",v_granularity=" + g));
      expect_accounting(f.store);
      int start = 0;
      for (const KVSegment& s : f.store.layer(0).segments) {
        const int n = s.heads[0].n();
        for (int kh = 0; kh < f.KH; ++kh)
          for (int kv = 0; kv < 2; ++kv) {
            auto orig = [&](int t, int c) { return (kv ? f.val(start + t, kh) : f.key(start + t, kh))[c]; };
            const std::vector<float>& got = kv ? s.heads[kh].v : s.heads[kh].k;
            for (int t = 0; t < n; ++t)
              for (int c = 0; c < f.D; ++c) {
                double lo = INFINITY, hi = -INFINITY;  // the range this value was quantized with
                for (int t2 = 0; t2 < n; ++t2)
                  for (int c2 = 0; c2 < f.D; ++c2)
                    if (std::string(g) == "global" || (std::string(g) == "per-token" ? t2 == t : c2 == c))
                      lo = std::min<double>(lo, orig(t2, c2)), hi = std::max<double>(hi, orig(t2, c2));
                EXPECT_LE(std::fabs(got[t * f.D + c] - orig(t, c)), affine_bound(lo, hi, bits)) << g << bits;
              }
          }
        start += n;
      }
    }
  Fixture f(5, 20, 6, 16, 22), ref(5, 20, 6, 16, 22);
  f.prefill(*make_policy("uniform:bits=2,scope=visual"));
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(same_rows(f.store.layer(0).segments[i], ref.store.layer(0).segments[i]), i != 1) << i;
}

// The layout copy a decode hands to diagnostics: every segment's kind, storage, bytes, payload,
// positions and row annotations as in the store, no rows; after quantizing (per-row bits) and
// after merging (merge counts).
TEST(KVStore, WithoutRowsKeepsTheLayout) {
  for (const char* spec : {"zipcache", "stack:evict=lookm,quant=kivi"}) {
    SCOPED_TRACE(spec);
    Fixture f(5, 20, 6, 16, 23);
    f.prefill(*make_policy(spec));
    const KVStore c = f.store.without_rows();
    EXPECT_EQ(c.bytes().total(), f.store.bytes().total());
    ASSERT_EQ(c.n_layers(), f.store.n_layers());
    EXPECT_EQ(c.n_kv_heads(), f.store.n_kv_heads());
    EXPECT_EQ(c.head_dim(), f.store.head_dim());
    int annotated = 0;
    for (int l = 0; l < c.n_layers(); ++l) {
      const auto& a = f.store.layer(l).segments;
      const auto& b = c.layer(l).segments;
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(b[i].kind, a[i].kind);
        EXPECT_EQ(b[i].storage, a[i].storage);
        EXPECT_EQ(b[i].bytes.total(), a[i].bytes.total());
        EXPECT_EQ(b[i].payload, a[i].payload);
        ASSERT_EQ(b[i].heads.size(), a[i].heads.size());
        for (size_t h = 0; h < a[i].heads.size(); ++h) {
          EXPECT_EQ(b[i].heads[h].pos, a[i].heads[h].pos);
          EXPECT_EQ(b[i].heads[h].bits, a[i].heads[h].bits);
          EXPECT_EQ(b[i].heads[h].merged, a[i].heads[h].merged);
          EXPECT_TRUE(b[i].heads[h].k.empty() && b[i].heads[h].v.empty());
          annotated += !a[i].heads[h].bits.empty() || !a[i].heads[h].merged.empty();
        }
      }
    }
    EXPECT_GT(annotated, 0) << "the case must carry row annotations";
  }
}

// Appends in several calls, kinds changing inside a call and a call continuing the last
// segment's kind: one segment per run of a kind (a continued run extends the last segment),
// each head's rows the input's rows [t][head] in order (fp16: each value half-rounded), the
// positions as given, and the bytes of the rows held.
TEST(KVStore, AppendsRunsOfAKindPerHead) {
  const int KH = 3, D = 8;
  const std::vector<SegmentKind> kinds = {SegmentKind::System, SegmentKind::System, kV, kV, kV,
                                          SegmentKind::PostVisionText, SegmentKind::PostVisionText,
                                          SegmentKind::Generated};
  const int T = static_cast<int>(kinds.size());
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> k(static_cast<size_t>(T) * KH * D), v(k.size());
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = 10 + 3 * t;
  for (RowStorage rows : {RowStorage::Fp32, RowStorage::Fp16}) {
    KVStore s(1, KH, D, rows);
    // Calls of 3, 1 (a visual token continuing the visual run) and 4 tokens.
    for (auto [t0, n] : {std::pair{0, 3}, std::pair{3, 1}, std::pair{4, 4}})
      s.append(0, k.data() + static_cast<size_t>(t0) * KH * D, v.data() + static_cast<size_t>(t0) * KH * D,
               pos.data() + t0, kinds.data() + t0, n);
    const auto& segs = s.layer(0).segments;
    const std::vector<std::pair<SegmentKind, std::vector<int>>> want = {
        {SegmentKind::System, {0, 1}}, {kV, {2, 3, 4}}, {SegmentKind::PostVisionText, {5, 6}}, {SegmentKind::Generated, {7}}};
    ASSERT_EQ(segs.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(segs[i].kind, want[i].first) << i;
      EXPECT_EQ(segs[i].storage, row_storage_name(rows));
      EXPECT_EQ(segs[i].bytes.codes, static_cast<int64_t>(want[i].second.size()) * KH * D * 2 * row_storage_bytes(rows));
      for (int h = 0; h < KH; ++h) {
        const HeadRows& r = segs[i].heads[h];
        ASSERT_EQ(r.n(), static_cast<int>(want[i].second.size()));
        for (int j = 0; j < r.n(); ++j) {
          const int t = want[i].second[j];
          EXPECT_EQ(r.pos[j], pos[t]);
          for (int c = 0; c < D; ++c) {
            const float kx = k[(static_cast<size_t>(t) * KH + h) * D + c], vx = v[(static_cast<size_t>(t) * KH + h) * D + c];
            EXPECT_EQ(r.k[static_cast<size_t>(j) * D + c], rows == RowStorage::Fp16 ? round_half(kx) : kx);
            EXPECT_EQ(r.v[static_cast<size_t>(j) * D + c], rows == RowStorage::Fp16 ? round_half(vx) : vx);
          }
        }
      }
    }
  }
}

TEST(KVStore, Fp16RowsAreHalfRoundedAndCountTwoBytesAValue) {
  // Values chosen so that half precision rounds them (1 + 2^-12 lies between two halves) or
  // keeps them exactly (0.5, 2048), and one that overflows half to infinity.
  const int KH = 1, D = 4;
  const float k0[D] = {1.0f + 1.0f / 4096, 0.5f, 2048.0f, 3.14159265f};
  const float v0[D] = {-1.0f - 3.0f / 4096, 1e-8f, 70000.0f, 0.1f};
  const SegmentKind kinds[2] = {kV, kV};
  const int32_t pos[2] = {0, 1};
  std::vector<float> k(k0, k0 + D), v(v0, v0 + D);
  k.insert(k.end(), k0, k0 + D), v.insert(v.end(), v0, v0 + D);
  KVStore exact(1, KH, D), half(1, KH, D, RowStorage::Fp16);
  exact.append(0, k.data(), v.data(), pos, kinds, 2);
  half.append(0, k.data(), v.data(), pos, kinds, 2);
  const KVSegment& e = exact.layer(0).segments.at(0);
  const KVSegment& h = half.layer(0).segments.at(0);
  EXPECT_EQ(e.storage, "fp32");
  EXPECT_EQ(h.storage, "fp16");
  EXPECT_TRUE(e.dense() && h.dense());
  EXPECT_EQ(e.bytes.codes, 2 * 2 * D * 4);
  EXPECT_EQ(h.bytes.codes, 2 * 2 * D * 2);
  EXPECT_EQ(h.bytes.indices, e.bytes.indices);
  for (int t = 0; t < 2; ++t)
    for (int c = 0; c < D; ++c) {
      EXPECT_EQ(e.heads[0].k[t * D + c], k0[c]);
      EXPECT_EQ(h.heads[0].k[t * D + c], round_half(k0[c]));
      EXPECT_EQ(h.heads[0].v[t * D + c], round_half(v0[c]));
    }
  EXPECT_EQ(h.heads[0].k[0], 1.0f);  // ties to even
  EXPECT_EQ(h.heads[0].k[2], 2048.0f);
  EXPECT_TRUE(std::isinf(h.heads[0].v[2]));
  // Switching an exact store to fp16 rounds its rows the same way; a new row extends the segment.
  exact.set_row_storage(RowStorage::Fp16);
  EXPECT_EQ(exact.layer(0).segments.at(0).storage, "fp16");
  EXPECT_EQ(exact.layer(0).segments.at(0).heads[0].k, h.heads[0].k);
  EXPECT_EQ(exact.layer(0).segments.at(0).bytes.total(), h.bytes.total());
  const int32_t p2 = 2;
  exact.append(0, k0, v0, &p2, kinds, 1);
  ASSERT_EQ(exact.layer(0).segments.size(), 1u);
  EXPECT_EQ(exact.layer(0).segments[0].heads[0].n(), 3);
  EXPECT_EQ(exact.layer(0).segments[0].bytes.codes, 3 * 2 * D * 2);
  // Back to fp32: the fp16 segment stays as it is, new rows start an exact segment.
  exact.set_row_storage(RowStorage::Fp32);
  exact.append(0, k0, v0, &p2, kinds, 1);
  ASSERT_EQ(exact.layer(0).segments.size(), 2u);
  EXPECT_EQ(exact.layer(0).segments[1].storage, "fp32");
  EXPECT_EQ(exact.layer(0).segments[1].heads[0].k[0], k0[0]);
  // Rows appended as given (a cache's own values) extend the fp16 rows unrounded.
  const int32_t p3 = 3;
  half.append(0, k0, v0, &p3, kinds, 1, true);
  ASSERT_EQ(half.layer(0).segments.size(), 1u);
  ASSERT_EQ(h.heads[0].n(), 3);
  for (int c = 0; c < D; ++c) {
    EXPECT_EQ(h.heads[0].k[2 * D + c], k0[c]);
    EXPECT_EQ(h.heads[0].v[2 * D + c], v0[c]);
  }
  EXPECT_EQ(h.bytes.codes, 3 * 2 * D * 2);
  EXPECT_THROW(parse_row_storage("bf16", "--kv-storage"), InputError);
}

TEST(Quantizers, WorkOnFp16Stores) {
  // Each quantizer takes the fp16 rows of the default decode cache as its input and leaves
  // what it does not quantize as fp16.
  for (const char* spec : {"uniform:bits=4", "kivi:bits=2,group=4,residual=6", "calibquant:bits=1",
                           "zipcache", "turboquant", "hadamard_int4:quantize_v=off"}) {
    SCOPED_TRACE(spec);
    Fixture f(4, 20, 6, 16, 57), g(4, 20, 6, 16, 57);
    f.rows = RowStorage::Fp16;
    g.store.set_row_storage(RowStorage::Fp16);  // the same fp16 rows, quantized by hand below
    auto p = make_policy(spec);
    f.prefill(*p), f.decode(*p, 7), expect_accounting(f.store);
    for (const KVSegment& s : f.store.layer(0).segments) EXPECT_NE(s.storage, "fp32");
    if (std::string(spec) == "uniform:bits=4") {  // the codes come from the half-rounded rows
      auto q = make_policy(spec);
      q->on_prefill({g.ctx()}, g.store);
      for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(same_rows(f.store.layer(0).segments[i], g.store.layer(0).segments[i]));
    }
  }
}

TEST(Full, RowsAreStoredAsTheRunOrThePolicySays) {
  // full follows the run's row storage: fp32 leaves the store bit-identical to no policy.
  Fixture f(4, 12, 5, 16, 31), ref(4, 12, 5, 16, 31);
  auto full = make_policy("full");
  f.prefill(*full), f.decode(*full, 3), ref.decode(*full, 3);
  ASSERT_EQ(f.store.layer(0).segments.size(), ref.store.layer(0).segments.size());
  for (size_t i = 0; i < f.store.layer(0).segments.size(); ++i)
    EXPECT_TRUE(same_rows(f.store.layer(0).segments[i], ref.store.layer(0).segments[i]));
  // fp16 (the run's, or asked by full:storage=fp16 in an fp32 run): every row half(x), 2 B a value.
  for (const char* spec : {"full", "full:storage=fp16"}) {
    SCOPED_TRACE(spec);
    Fixture h(4, 12, 5, 16, 32);
    if (std::string(spec) == "full") h.rows = RowStorage::Fp16;
    auto p = make_policy(spec);
    h.prefill(*p), h.decode(*p, 4), expect_accounting(h.store);
    ASSERT_EQ(h.store.layer(0).segments.size(), 4u);  // system, visual, text, one generated segment
    for (const KVSegment& s : h.store.layer(0).segments) {
      EXPECT_TRUE(s.storage == "fp16" && s.bytes.total() == s.dense_bytes(h.D, 2).total()) << s.storage;
      EXPECT_EQ(s.bytes.codes, 2LL * 2 * s.heads[0].n() * h.KH * h.D);
      for (int kh = 0; kh < h.KH; ++kh)
        for (int t = 0; t < s.heads[kh].n(); ++t)
          for (int c = 0; c < h.D; ++c) {
            EXPECT_EQ(s.heads[kh].k[t * h.D + c], round_half(h.key(s.heads[kh].pos[t], kh)[c]));
            EXPECT_EQ(s.heads[kh].v[t * h.D + c], round_half(h.val(s.heads[kh].pos[t], kh)[c]));
          }
    }
  }
  // full:storage=fp32 in an fp16 run keeps the exact rows.
  Fixture e(4, 12, 5, 16, 33), exact(4, 12, 5, 16, 33);
  e.rows = RowStorage::Fp16;
  auto p32 = make_policy("full:storage=fp32");
  e.prefill(*p32), e.decode(*p32, 2), exact.decode(*p32, 2);
  for (size_t i = 0; i < e.store.layer(0).segments.size(); ++i) {
    EXPECT_EQ(e.store.layer(0).segments[i].storage, "fp32");
    EXPECT_TRUE(same_rows(e.store.layer(0).segments[i], exact.store.layer(0).segments[i]));
  }
}

TEST(CalibQuant, PostScalingEqualsDequantizeThenDot) {
  for (int bits : {1, 2, 4, 8}) {
    Fixture f(3, 40, 4, 32, 40 + bits);
    f.prefill(*make_policy("calibquant:bits=" + std::to_string(bits)));
    const KVSegment& vis = f.store.layer(0).segments[1];
    const quant::QuantPayload& p = payload(vis);
    for (int kh = 0; kh < f.KH; ++kh) {  // q·k̂ and w·V̂ from the codes vs the dequantized rows
      const int n = vis.heads[kh].n(), D = f.D;
      std::vector<float> qv(D), w(n), got(std::max(n, D));
      std::generate(qv.begin(), qv.end(), [&] { return f.normal(); }), std::generate(w.begin(), w.end(), [&] { return std::fabs(f.normal()); });
      calibquant::post_scaled_scores(qv.data(), D, p.k[kh].codes.data(), n, bits, p.k[kh].scales.data(), p.k[kh].zeros.data(), got.data());
      for (int j = 0; j < n; ++j) {  // relative to Σ|q_c k̂_c|, the scale of the sum's rounding
        double dot = 0, mag = 0;
        for (int c = 0; c < D; ++c) dot += qv[c] * vis.heads[kh].k[j * D + c], mag += std::fabs(qv[c] * vis.heads[kh].k[j * D + c]);
        EXPECT_LE(std::fabs(got[j] - dot), 1e-5 * mag + 1e-30) << bits;
      }
      calibquant::post_scaled_values(w.data(), n, p.v[kh].codes.data(), D, bits, p.v[kh].scales.data(), p.v[kh].zeros.data(), got.data());
      for (int c = 0; c < D; ++c) {
        double acc = 0, mag = 0;
        for (int j = 0; j < n; ++j) acc += w[j] * vis.heads[kh].v[j * D + c], mag += std::fabs(w[j] * vis.heads[kh].v[j * D + c]);
        EXPECT_LE(std::fabs(got[c] - acc), 1e-5 * mag + 1e-30) << bits;
      }
    }
  }
}

TEST(CalibQuant, CalibrationMapsTheVisualRangeAndTouchesOnlyVisualKeys) {
  std::mt19937_64 rng(50);
  std::uniform_real_distribution<float> u(-20, 20), t(0, 8);
  for (int trial = 0; trial < 100; ++trial) {
    float g = u(rng), d = u(rng);
    if (g > d) std::swap(g, d);
    const float t1 = t(rng), t2 = t(rng), eps = 16 * FLT_EPSILON * (std::fabs(g) + std::fabs(d) + 16);
    EXPECT_NEAR(calibquant::calibrate(g, g, d, t1, t2), g - t1, eps);
    EXPECT_NEAR(calibquant::calibrate(d, g, d, t1, t2), d - t2, eps);
    const float x = u(rng), y = u(rng), a = 0.3f;  // linear: g(ax + (1−a)y) = a g(x) + (1−a) g(y)
    EXPECT_NEAR(calibquant::calibrate(a * x + (1 - a) * y, g, d, t1, t2),
                a * calibquant::calibrate(x, g, d, t1, t2) + (1 - a) * calibquant::calibrate(y, g, d, t1, t2), eps * 4);
  }
  const int n = 30;  // scores of one query
  std::vector<float> s(n);
  std::vector<SegmentKind> kinds(n);  // visual, system and generated keys
  for (int j = 0; j < n; ++j) s[j] = u(rng), kinds[j] = j % 3 ? kV : (j % 2 ? kS : SegmentKind::Generated);
  const std::vector<float> orig = s;
  auto p = make_policy("calibquant:bits=1,tau1=1,tau2=3");
  ASSERT_TRUE(p->has_score_transform());
  p->transform_scores(0, 0, s.data(), kinds.data(), n);
  float g = INFINITY, d = -INFINITY, ng = INFINITY, nd = -INFINITY;
  for (int j = 0; j < n; ++j)
    if (kinds[j] != kV) EXPECT_EQ(s[j], orig[j]);  // other keys untouched
    else g = std::min(g, orig[j]), d = std::max(d, orig[j]), ng = std::min(ng, s[j]), nd = std::max(nd, s[j]);
  EXPECT_NEAR(ng, g - 1, 1e-4);  // [γ, δ] → [γ − τ1, δ − τ2]
  EXPECT_NEAR(nd, d - 3, 1e-4);
  EXPECT_TRUE(!make_policy("calibquant:bits=4")->has_score_transform() && make_policy("calibquant:bits=4,calibrate=force")->has_score_transform() &&
              !make_policy("calibquant:bits=1,calibrate=off")->has_score_transform());  // auto: only when bits ≤ 2
}

TEST(CalibQuant, TauOrderWidensOrReversesAsEquationSevenSays) {
  // τ1 > τ2 is allowed: the calibrated range [γ−τ1, δ−τ2] is wider, and order is kept.
  const float g = -1.0f, d = 2.0f;
  const float lo = calibquant::calibrate(g, g, d, 3.0f, 1.0f), hi = calibquant::calibrate(d, g, d, 3.0f, 1.0f);
  EXPECT_FLOAT_EQ(lo, g - 3.0f);
  EXPECT_FLOAT_EQ(hi, d - 1.0f);
  EXPECT_GT(hi - lo, d - g);
  EXPECT_LT(calibquant::calibrate(0.0f, g, d, 3.0f, 1.0f), calibquant::calibrate(1.0f, g, d, 3.0f, 1.0f));
  // τ2 − τ1 larger than the range δ − γ = 3: the slope (3 + 0 − 4) / 3 is negative and the
  // visual scores reverse order, as Eq. 7 defines; kvlens applies the equation as written.
  EXPECT_GT(calibquant::calibrate(0.0f, g, d, 0.0f, 4.0f), calibquant::calibrate(1.0f, g, d, 0.0f, 4.0f));
  EXPECT_NEAR(calibquant::calibrate(1.0f, g, d, 0.0f, 4.0f) - calibquant::calibrate(0.0f, g, d, 0.0f, 4.0f),
              -1.0f / 3.0f, 1e-6);
  EXPECT_NO_THROW(parse_method_spec("calibquant:tau1=5,tau2=1"));
}

TEST(CalibQuant, VisualOnlyChannelWiseWithOptionalShrink) {
  for (const char* spec : {"calibquant:preset=paper", "calibquant:preset=official"}) {
    Fixture f(6, 50, 7, 16, 60), ref(6, 50, 7, 16, 60);
    const Params prm = parse_method_spec(spec);
    f.prefill(*make_policy(prm)), expect_accounting(f.store);
    const LayerKV& L = f.store.layer(0);  // system and text untouched, visual 1-bit channel-wise
    EXPECT_TRUE(same_rows(L.segments[0], ref.store.layer(0).segments[0]) && same_rows(L.segments[2], ref.store.layer(0).segments[2]));
    const KVSegment& vis = L.segments[1];
    EXPECT_EQ(vis.storage, "q1-channel");
    for (int kv = 0; kv < 2; ++kv) {
      const float s = static_cast<float>(prm.num(kv ? "v_shrink" : "k_shrink"));
      for (int kh = 0; kh < f.KH; ++kh)
        for (int c = 0; c < f.D; ++c) {
          float lo = INFINITY, hi = -INFINITY;
          for (int t = 6; t < 56; ++t) lo = std::min(lo, (kv ? f.val(t, kh) : f.key(t, kh))[c]), hi = std::max(hi, (kv ? f.val(t, kh) : f.key(t, kh))[c]);
          lo *= s, hi *= s;  // shrink about zero
          const float a = round_half(lo), st = round_half(hi - lo);  // 1 bit: 2^b − 1 = 1
          for (int t = 0; t < 50; ++t) {
            const float got = (kv ? vis.heads[kh].v : vis.heads[kh].k)[t * f.D + c];
            const float x = (kv ? f.val(6 + t, kh) : f.key(6 + t, kh))[c];
            const float code = std::clamp(std::nearbyint((x - a) / st), 0.0f, 1.0f);
            EXPECT_EQ(got, code * st + a);  // the channel's shrunk range: α or β
          }
        }
    }
  }
}

TEST(CalibQuant, CompressionRatioOfOneBitVisualStore) {
  const int n = 100, D = 64, KH = 2;
  Fixture f(0, n, 0, D, 70, KH);
  f.prefill(*make_policy("calibquant:bits=1")), expect_accounting(f.store);
  // Per head: K and V codes ceil(n·D·1/8) bytes each, fp16 scale and zero per channel, positions.
  const int64_t per_head = 2 * ((n * D + 7) / 8) + 2 * 2 * D * 2 + 4 * n;
  EXPECT_EQ(f.store.bytes().total(), KH * per_head);
  const double ratio = KH * (2.0 * n * D * 2 + 4 * n) / f.store.bytes().total();  // vs fp16 rows
  EXPECT_TRUE(ratio > 8.0 && ratio < 16.0) << ratio;  // below 16/b only by the ranges and positions
}

TEST(Kivi, RecentWindowExactAndGroupRangesPerChannel) {
  const int G = 8, R = 10;
  Fixture f(7, 60, 9, 16, 80);
  auto p = make_policy("kivi:bits=2,group=" + std::to_string(G) + ",residual=" + std::to_string(R));
  f.prefill(*p);
  const LayerKV& L = f.store.layer(0);
  for (int step = 0; step < 23; ++step) {  // after each token: fp32 tail in [R, R + G), all at the end
    f.decode(*p, 1);
    size_t i = L.segments.size(), tail = 0;
    while (i > 0 && L.segments[i - 1].storage == "fp32") tail += L.segments[--i].heads[0].n();
    EXPECT_TRUE(tail >= static_cast<size_t>(R) && tail < static_cast<size_t>(R + G)) << tail;
  }
  expect_accounting(f.store);
  for (int kh = 0; kh < f.KH; ++kh) {
    int fp32_rows = 0;
    std::vector<int32_t> order;
    for (const KVSegment& s : L.segments) {
      const HeadRows& r = s.heads[kh];
      for (int32_t ps : r.pos) order.push_back(ps);
      if (s.storage == "fp32") {
        fp32_rows += r.n();
        for (int t = 0; t < r.n(); ++t)
          for (int c = 0; c < f.D; ++c) EXPECT_EQ(r.k[t * f.D + c], f.key(r.pos[t], kh)[c]);
        continue;
      }
      EXPECT_EQ(fp32_rows, 0) << "quantized rows after fp32 ones";
      const quant::QuantPayload& q = payload(s);
      int groups = 0;
      for (int g0 = 0; g0 < r.n(); g0 += G, ++groups)
        for (int c = 0; c < f.D; ++c) {
          float lo = INFINITY, hi = -INFINITY;
          for (int t = g0; t < std::min(r.n(), g0 + G); ++t)
            lo = std::min(lo, f.key(r.pos[t], kh)[c]), hi = std::max(hi, f.key(r.pos[t], kh)[c]);
          EXPECT_EQ(quant::from_half(q.k[kh].scales[groups * f.D + c]), round_half((hi - lo) / 3));
          EXPECT_EQ(quant::from_half(q.k[kh].zeros[groups * f.D + c]), round_half(lo));
          for (int t = g0; t < std::min(r.n(), g0 + G); ++t)
            EXPECT_LE(std::fabs(r.k[t * f.D + c] - f.key(r.pos[t], kh)[c]), affine_bound(lo, hi, 2));
        }
      EXPECT_EQ(q.k[kh].scales.size(), static_cast<size_t>(groups * f.D));
      EXPECT_EQ(q.v[kh].scales.size(), static_cast<size_t>(r.n()));  // V: one range per token
    }
    EXPECT_TRUE(std::is_sorted(order.begin(), order.end()));
    EXPECT_EQ(static_cast<int>(order.size()), f.T + 23);
  }
}

TEST(HadamardInt4, DequantizedKeysKeepDotProducts) {
  Fixture f(4, 30, 5, 64, 160);
  std::vector<float> x(64), y;
  std::generate(x.begin(), x.end(), [&] { return f.normal(); }), y = x;  // H twice gives x back
  for (int twice = 0; twice < 2; ++twice) quant::block_hadamard(y.data(), 64, 16);
  for (int j = 0; j < 64; ++j) EXPECT_NEAR(y[j], x[j], 1e-5);  // its own inverse
  auto p = make_policy("hadamard_int4:block=16");
  f.prefill(*p), f.decode(*p, 3);
  expect_accounting(f.store);
  const LayerKV& L = f.store.layer(0);
  EXPECT_EQ(L.segments.size(), 4u);  // the generated tokens merge into one segment
  std::vector<float> qv(x), hq(x);  // q·k̂ = (Hq)·k̂_rot: the error is bounded in the rotated basis
  quant::block_hadamard(hq.data(), f.D, 16);
  for (const KVSegment& s : L.segments)
    for (int kh = 0; kh < f.KH; ++kh)
      for (int t = 0; t < s.heads[kh].n(); ++t) {
        std::vector<float> kr(f.key(s.heads[kh].pos[t], kh), f.key(s.heads[kh].pos[t], kh) + f.D);
        quant::block_hadamard(kr.data(), f.D, 16);
        const float lo = *std::min_element(kr.begin(), kr.end()), hi = *std::max_element(kr.begin(), kr.end());
        double exact = 0, got = 0, bound = 0;
        for (int c = 0; c < f.D; ++c)
          exact += qv[c] * f.key(s.heads[kh].pos[t], kh)[c], got += qv[c] * s.heads[kh].k[t * f.D + c],
              bound += std::fabs(hq[c]) * affine_bound(lo, hi, 4);
        EXPECT_LE(std::fabs(got - exact), bound + 1e-5 * std::fabs(exact));
      }
  Fixture g(2, 4, 2, 64, 161);
  EXPECT_THROW(make_policy("hadamard_int4:block=128")->on_prefill({g.ctx()}, g.store), InputError);
}

TEST(AllQuantMethods, BytesEqualAllocatedAfterPrefillAndDecode) {
  std::vector<std::string> specs = {"zipcache:gap=7,saliency_heads=shared", "kivi:bits=4,group=5,residual=3",
                                    "turboquant:bits=1,qjl=on,scope=visual", "hadamard_int4:quantize_v=off",
                                    "uniform:bits=3,k_granularity=per-channel,v_granularity=global"};
  for (const MethodSpec& m : {full_method(), uniform_method(), kivi_method(), calibquant_method(),
                              zipcache_method(), turboquant_method(), hadamard_int4_method()}) {
    specs.push_back(m.name);
    for (const auto& pr : m.presets) specs.push_back(m.name + ":preset=" + pr.first);
  }
  for (const std::string& spec : specs) {
    SCOPED_TRACE(spec);
    Fixture f(6, 70, 8, 32, 170);
    auto p = make_policy(spec);
    f.prefill(*p), f.decode(*p, 40), expect_accounting(f.store);
    for (int kh = 0; kh < f.KH; ++kh) EXPECT_EQ(f.store.n_rows(0, kh), f.T + 40);
  }
}

// ---- per-row annotations: what token fate reads --------------------------------------------------


TEST(TokenFate, KiviCalibQuantAndUniformRowBits) {
  {  // KIVI: quantized rows b bits, the fp32 residual window 32, through decode
    Fixture f(7, 60, 9, 16, 81);
    auto p = make_policy("kivi:bits=2,group=8,residual=10");
    f.prefill(*p), f.decode(*p, 13);
    for (int kh = 0; kh < f.KH; ++kh) {
      int fp32 = 0, q = 0;
      for (const KVSegment& s : f.store.layer(0).segments)
        for (int i = 0; i < s.heads[kh].n(); ++i) {
          const int b = quant::row_bits(s.heads[kh], i, s.dense() ? 32 : -1);
          EXPECT_EQ(b, s.dense() ? 32 : 2) << s.storage;
          (s.dense() ? fp32 : q)++;
        }
      EXPECT_TRUE(fp32 >= 10 && fp32 < 18) << fp32;
      EXPECT_EQ(q + fp32, f.T + 13);
      EXPECT_EQ(q % 8, 0);
    }
  }
  {  // CalibQuant: visual rows b bits, system and text rows untouched (unannotated, fp32)
    Fixture f(6, 20, 7, 16, 61);
    f.prefill(*make_policy("calibquant:bits=2"));
    const LayerKV& L = f.store.layer(0);
    for (int kh = 0; kh < f.KH; ++kh) {
      const std::vector<int> b = row_bits_of(L, kh);
      ASSERT_EQ(static_cast<int>(b.size()), f.T);
      for (int t = 0; t < f.T; ++t) EXPECT_EQ(b[t], f.kinds[t] == kV ? 2 : 32) << t;
      EXPECT_TRUE(L.segments[0].heads[kh].bits.empty() && L.segments[2].heads[kh].bits.empty());
    }
  }
  // Every row a policy stores: bits as the format says, aligned with pos after decode merges.
  const std::vector<std::pair<std::string, int>> cases = {
      {"uniform:bits=3", 3}, {"hadamard_int4", 4}, {"hadamard_int4:quantize_v=off", 4},
      {"turboquant:bits=2", 2}, {"turboquant:bits=3,qjl=on", 3}, {"full:storage=fp16", 16},
      {"full:storage=fp32", 32}};
  for (const auto& [spec, bits] : cases) {
    SCOPED_TRACE(spec);
    Fixture f(4, 12, 5, 16, 90);
    auto p = make_policy(spec);
    f.prefill(*p), f.decode(*p, 5);
    for (int kh = 0; kh < f.KH; ++kh) {
      const std::vector<int> b = row_bits_of(f.store.layer(0), kh);
      EXPECT_EQ(static_cast<int>(b.size()), f.T + 5);
      for (int x : b) EXPECT_EQ(x, bits);
    }
  }
}

TEST(TokenFate, SegmentHelpersKeepAnnotationsAlignedAndPayloadsUnshared) {
  // split_segment splits bits/merged with the rows.
  LayerKV L;
  KVSegment s;
  s.heads.resize(1);
  for (int i = 0; i < 5; ++i) {
    s.heads[0].k.insert(s.heads[0].k.end(), 2, static_cast<float>(i));
    s.heads[0].v.insert(s.heads[0].v.end(), 2, static_cast<float>(i));
    s.heads[0].pos.push_back(i);
  }
  s.heads[0].merged = {1, 2, 3, 4};  // one row appended after it was written
  L.segments.push_back(s);
  quant::split_segment(L, 0, {2}, 2);
  ASSERT_EQ(L.segments.size(), 2u);
  EXPECT_EQ(L.segments[0].heads[0].merged, (std::vector<uint16_t>{1, 2}));
  EXPECT_EQ(L.segments[1].heads[0].merged, (std::vector<uint16_t>{3, 4, 0}));
  EXPECT_TRUE(L.segments[0].heads[0].bits.empty() && L.segments[1].heads[0].bits.empty());

  // merge_last_into_previous grows a clone: a copy of the store keeps its payload as it was.
  Fixture f(3, 6, 2, 16, 95);
  auto p = make_policy("uniform:bits=4");
  f.prefill(*p), f.decode(*p, 2);  // the generated segment now holds 2 rows
  const KVStore copy = f.store;
  const KVSegment& gen = copy.layer(0).segments.back();
  ASSERT_EQ(gen.kind, SegmentKind::Generated);
  ASSERT_EQ(gen.heads[0].n(), 2);
  const int64_t held = gen.payload->allocated().total();
  const size_t codes = payload(gen).k[0].codes.size();
  f.decode(*p, 3);
  EXPECT_EQ(f.store.layer(0).segments.back().heads[0].n(), 5);
  EXPECT_EQ(f.store.layer(0).segments.back().heads[0].bits, std::vector<uint8_t>(5, 4));
  EXPECT_EQ(gen.payload->allocated().total(), held);
  EXPECT_EQ(payload(gen).k[0].codes.size(), codes);
  EXPECT_EQ(gen.bytes.total(), held + 4 * 2 * f.KH);
}

// KIVI's answer before a step (acts_at_step: the device's decode loop skips the host work where
// it says no) is whether its hook then changes the store: over 3·G + 5 steps at several group
// and window sizes, fp32 and fp16 rows, and prompts whose dense tail starts short, long or empty.
TEST(Kivi, ActsAtStepSaysWhenTheHookChangesTheStore) {
  struct Case {
    int G, R, n_txt;
    RowStorage rows;
  };
  auto signature = [](const LayerKV& L) {
    std::vector<std::tuple<std::string, const void*, std::vector<int>>> s;
    for (const KVSegment& seg : L.segments) {
      std::vector<int> n;
      for (const HeadRows& r : seg.heads) n.push_back(r.n());
      s.emplace_back(seg.storage, seg.payload.get(), n);
    }
    return s;
  };
  for (const Case c : {Case{8, 10, 9, RowStorage::Fp32}, Case{4, 0, 1, RowStorage::Fp16},
                       Case{16, 32, 40, RowStorage::Fp32}, Case{1, 3, 0, RowStorage::Fp16}, Case{5, 7, 2, RowStorage::Fp16}}) {
    SCOPED_TRACE("G=" + std::to_string(c.G) + " R=" + std::to_string(c.R) + " text=" + std::to_string(c.n_txt));
    Fixture f(5, 40, c.n_txt, 16, 90 + c.G);
    f.rows = c.rows;
    auto p = make_policy("kivi:bits=2,group=" + std::to_string(c.G) + ",residual=" + std::to_string(c.R));
    f.prefill(*p);
    const int steps = 3 * c.G + 5;
    int acted = 0;
    for (int step = 0; step < steps; ++step) {
      DecodeContext d;
      d.layer = 0, d.step = step, d.position = f.T + step, d.n_heads = f.H, d.n_kv_heads = f.KH, d.head_dim = f.D;
      const bool asked = p->acts_at_step(d, f.store.layer(0));
      std::vector<float> nk(static_cast<size_t>(f.KH) * f.D), nv(nk.size());
      for (float& x : nk) x = f.normal();
      for (float& x : nv) x = f.normal();
      const SegmentKind g = SegmentKind::Generated;
      f.store.append(0, nk.data(), nv.data(), &d.position, &g, 1);
      const auto before = signature(f.store.layer(0));
      p->on_decode_step(d, f.store.layer(0));
      EXPECT_EQ(asked, signature(f.store.layer(0)) != before) << "step " << step;
      acted += asked;
    }
    EXPECT_GT(acted, 0);
    if (c.G > 1) {
      EXPECT_LT(acted, steps);
    }
  }
}
