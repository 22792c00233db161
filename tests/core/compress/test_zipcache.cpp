// ZipCache against direct computations: saliency (Eq. 7/8), probes, CSTQuant (Algorithm 1),
// the salient / regular split and its ranges at each granularity (Algorithm 2), the bytes each
// granularity stores, and streaming re-compression every `gap` tokens (Algorithm 3).
#include <algorithm>
#include <array>
#include <tuple>
#include <cmath>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/compress/method.h"
#include "tests/quant_fixture.h"

using namespace kvlens;
using namespace kvlens::testing;

TEST(ZipCache, SaliencyOnAHandMadeLowerTriangularMatrix) {
  // Rows are queries, columns keys. Column sums: 2.3, 0.8, 0.5, 0.4; visible to 4, 3, 2, 1 rows.
  const std::vector<float> A = {1.0f, 0, 0, 0,  0.5f, 0.5f, 0, 0,  0.4f, 0.2f, 0.4f, 0,  0.4f, 0.1f, 0.1f, 0.4f};
  const auto acc = zipcache::saliency(A.data(), 4, {0, 1, 2, 3}, zipcache::Saliency::Accumulated);
  const auto nor = zipcache::saliency(A.data(), 4, {0, 1, 2, 3}, zipcache::Saliency::Normalized);
  const std::vector<double> want_acc = {2.3, 0.8, 0.5, 0.4}, want_nor = {2.3 / 4, 0.8 / 3, 0.5 / 2, 0.4 / 1};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(acc[i], want_acc[i], 1e-6);
    EXPECT_NEAR(nor[i], want_nor[i], 1e-6);
  }
  // Accumulated ranks the last token last; normalized ranks it second (the paper's point).
  EXPECT_LT(acc[3], acc[2]);
  EXPECT_GT(nor[3], nor[1]);
  // Probes {2, 3} only: nnz = 2, 2, 2, 1.
  const auto pn = zipcache::saliency(A.data(), 4, {2, 3}, zipcache::Saliency::Normalized);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(pn[i], (std::vector<double>{0.8 / 2, 0.3 / 2, 0.5 / 2, 0.4 / 1}[i]), 1e-6);
}

TEST(ZipCache, ProbeSelection) {
  const int T = 200;
  auto rr = zipcache::select_probes(zipcache::Probe::RandomRecent, T, nullptr, nullptr, 0.05, 0.05, 7);
  EXPECT_EQ(rr.size(), 20u);
  for (int i = T - 10; i < T; ++i) EXPECT_TRUE(std::binary_search(rr.begin(), rr.end(), i));
  for (uint64_t seed : {7, 8})  // seeded: the same seed draws the same probes
    EXPECT_EQ(rr == zipcache::select_probes(zipcache::Probe::RandomRecent, T, nullptr, nullptr, 0.05, 0.05, seed), seed == 7);
  EXPECT_TRUE(zipcache::select_probes(zipcache::Probe::Random, T, nullptr, nullptr, 0.05, 0.1, 1).size() == 20u &&
              zipcache::select_probes(zipcache::Probe::All, T, nullptr, nullptr, 0, 0, 1).size() == 200u);
  Fixture f(4, 10, 5, 8, 90);
  const auto sp = zipcache::select_probes(zipcache::Probe::Special, f.T, &f.kinds, &f.ids, 0, 0, 0);
  EXPECT_EQ(sp, (std::vector<int>{0, 3, 14, 18}));  // BOS, before / after the visual run, last
}

TEST(ZipCache, TopFlagsMarkTheHighestScoresTiesToTheEarlierToken) {
  // Against a stable sort by descending score: many ties (a few distinct values), every ratio's
  // rounding, lengths of 0 to 700.
  std::mt19937 rng(23);
  for (int n : {0, 1, 2, 7, 64, 333, 700})
    for (double ratio : {0.0, 0.01, 0.4, 0.5, 0.999, 1.0}) {
      std::vector<double> score(static_cast<size_t>(n));
      for (double& x : score) x = static_cast<double>(rng() % 5) * 0.25 - 0.5;
      std::vector<int> idx(static_cast<size_t>(n));
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return score[a] > score[b]; });
      const int k = std::clamp(static_cast<int>(std::llround(ratio * n)), 0, n);
      std::vector<char> want(static_cast<size_t>(n), 0);
      for (int i = 0; i < k; ++i) want[static_cast<size_t>(idx[static_cast<size_t>(i)])] = 1;
      EXPECT_EQ(zipcache::top_flags(score, ratio), want) << "n " << n << ", ratio " << ratio;
    }
}

TEST(ZipCache, ChannelSeparableTokenWiseMatchesDirectComputation) {
  std::mt19937_64 rng(100);
  const int n = 9, d = 12, bits = 2;
  std::vector<float> x(n * d);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::normal_distribution<float>(0, 1)(rng) * (i % d == 4 ? 20.f : 1.f);
  std::vector<float> got = x;  // channel 4 is an outlier
  quant::QuantBlock blk;
  zipcache::cst_quantize(got.data(), n, d, bits, blk);
  std::vector<float> c(d, 0);  // c_j = sqrt(max_t |x_tj|), stored as fp16
  for (int t = 0; t < n * d; ++t) c[t % d] = std::max(c[t % d], std::fabs(x[t]));
  for (float& cj : c) cj = round_half(std::sqrt(cj));
  for (int t = 0; t < n; ++t) {
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < d; ++j) lo = std::min(lo, x[t * d + j] / c[j]), hi = std::max(hi, x[t * d + j] / c[j]);
    const float a = round_half(lo), s = round_half((hi - lo) / 3);
    for (int j = 0; j < d; ++j) {
      const float code = std::clamp(std::nearbyint((x[t * d + j] / c[j] - a) / s), 0.0f, 3.0f);
      EXPECT_EQ(got[t * d + j], (code * s + a) * c[j]);
    }
  }
  EXPECT_TRUE(blk.meta.size() == static_cast<size_t>(d) && blk.scales.size() == static_cast<size_t>(n));
  EXPECT_EQ(blk.codes.size(), static_cast<size_t>(n * ((d * bits + 7) / 8)));
}

TEST(ZipCache, SalientTokensFollowProbeSaliencyAndBytesFollowTheFormat) {
  // Per-segment ranges and per-head token ranges (the finer options): each segment has its own
  // payload, whose bytes follow the format below.
  Fixture f(5, 30, 6, 16, 110);
  auto p = make_policy("zipcache:probe=all,saliency_ratio=0.4,gap=4,recent_ratio=1,random_ratio=0,"
                       "ranges=segment,value_token_range=head");
  f.prefill(*p), expect_accounting(f.store);
  const LayerKV& L = f.store.layer(0);
  const int group = f.H / f.KH;
  for (int kh = 0; kh < f.KH; ++kh) {
    std::vector<double> sal(f.T, 0);  // Eq. 8 with every query as probe, mean over the group
    for (int h = kh * group; h < (kh + 1) * group; ++h)
      for (int i = 0; i < f.T; ++i)
        for (int r = i; r < f.T; ++r) sal[i] += f.probs[(static_cast<size_t>(h) * f.T + r) * f.T + i] / (f.T - i) / group;
    const std::vector<int> idx = ranked(sal);  // top round(0.4·T), ties to the earlier token
    std::set<int> want(idx.begin(), idx.begin() + std::llround(0.4 * f.T)), got;
    for (const KVSegment& s : L.segments) {
      const quant::QuantPayload& q = payload(s);
      const int n = s.heads[kh].n();
      int n_sal = 0;
      for (int t = 0; t < n; ++t)
        if (quant::unpack_one(q.k[kh].flags.data(), t, 1)) got.insert(s.heads[kh].pos[t]), ++n_sal;
      // K: codes of each subset as one stream + fp16 scale/zero per channel and subset; V: codes
      // row by row + fp16 scale/zero per token + fp16 c per channel and subset; 1 flag bit per row.
      const int64_t nr = n - n_sal, D = f.D, subsets = (n_sal > 0) + (nr > 0);
      EXPECT_EQ(q.k[kh].allocated().total() + q.v[kh].allocated().total(),
                (n_sal * D * 4 + 7) / 8 + (nr * D * 2 + 7) / 8 + 4 * D * subsets + n_sal * ((D * 4 + 7) / 8) +
                    nr * ((D * 2 + 7) / 8) + 4 * n + 2 * D * subsets + (n + 7) / 8);
    }
    EXPECT_EQ(got, want);
  }
  // Streaming: each gap of 4 tokens is quantized when the 5th arrives, ranked by Eq. 8 over the
  // attention of its own tokens' queries (all probes here) on the rows as they were at each step.
  f.decode(*p, 9), expect_accounting(f.store);
  ASSERT_EQ(L.segments.size(), 6u);
  EXPECT_TRUE(L.segments[5].storage == "fp32" && L.segments[5].heads[0].n() == 1);
  for (int gi = 0; gi < 2; ++gi)
    for (int kh = 0; kh < f.KH; ++kh) {
      std::vector<double> sal(4, 0.0);
      for (int h = kh * group; h < (kh + 1) * group; ++h)
        for (int k = 0; k < 4; ++k) {
          const int pk = f.T + 4 * gi + k;  // the probe's position; it saw rows up to pk
          std::vector<double> e(4, 0.0);  // exp(q·k/√D) of the gap rows, z over every visible row
          double z = 0;
          for (const KVSegment& s : L.segments)
            for (int t = 0; t < s.heads[kh].n(); ++t) {
              const int ps = s.heads[kh].pos[t];  // rows after the probe were not there yet
              if (ps > pk) continue;
              const float* row = ps >= f.T + 4 * gi ? f.key(ps, kh) : &s.heads[kh].k[t * f.D];  // fp32 then
              const double x = std::exp(std::inner_product(row, row + f.D, &f.dq[((pk - f.T) * f.H + h) * f.D], 0.0) / std::sqrt(f.D));
              z += x;
              if (ps >= f.T + 4 * gi) e[ps - f.T - 4 * gi] = x;
            }
          for (int j = 0; j <= k; ++j) sal[j] += e[j] / z / (4 - j) / group;
        }
      const std::vector<int> idx = ranked(sal);
      const quant::QuantPayload& q = payload(L.segments[3 + gi]);
      for (int j = 0; j < 4; ++j)  // round(0.4·4) = 2 salient
        EXPECT_EQ(quant::unpack_one(q.k[kh].flags.data(), j, 1), idx[0] == j || idx[1] == j ? 1u : 0u) << gi << " " << j;
    }
}

TEST(TokenFate, ZipCacheRowsCarryHighOrLowBitsWithTheSalientShareHigh) {
  Fixture f(5, 30, 6, 16, 111);
  auto p = make_policy("zipcache:high_bits=3,low_bits=1,saliency_ratio=0.4,gap=4");
  f.prefill(*p);
  const LayerKV& L = f.store.layer(0);
  for (int kh = 0; kh < f.KH; ++kh) {
    int high = 0, at = 0;  // the flags of the layer's one payload run over its segments in order
    for (const KVSegment& s : L.segments) {
      const HeadRows& r = s.heads[kh];
      ASSERT_EQ(r.bits.size(), static_cast<size_t>(r.n()));
      ASSERT_EQ(s.payload, L.segments[0].payload);
      for (int t = 0; t < r.n(); ++t) {
        const bool salient = quant::unpack_one(payload(s).k[kh].flags.data(), at++, 1) != 0;
        EXPECT_EQ(r.bits[t], salient ? 3 : 1);
        high += r.bits[t] == 3;
      }
    }
    EXPECT_EQ(high, std::llround(0.4 * f.T));
  }
  f.decode(*p, 9);  // two gaps of 4 quantized, round(0.4·4) = 2 salient each; the last row fp32
  ASSERT_EQ(L.segments.size(), 6u);
  for (int kh = 0; kh < f.KH; ++kh) {
    for (int gi = 3; gi < 5; ++gi) {
      const HeadRows& r = L.segments[gi].heads[kh];
      ASSERT_EQ(r.bits.size(), 4u);
      EXPECT_EQ(std::count(r.bits.begin(), r.bits.end(), uint8_t{3}), 2);
      EXPECT_EQ(std::count(r.bits.begin(), r.bits.end(), uint8_t{1}), 2);
    }
    EXPECT_EQ(row_bits_of(L, kh).back(), 32);
  }
  try {
    make_policy("zipcache:high_bits=2,low_bits=4");
    ADD_FAILURE() << "high_bits < low_bits accepted";
  } catch (const InputError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("high_bits"), std::string::npos) << w;
    EXPECT_NE(w.find("low_bits"), std::string::npos) << w;
  }
  EXPECT_NO_THROW(make_policy("zipcache:high_bits=2,low_bits=2"));
}


namespace {

// Salient flags by Eq. 8 with every query as probe: per KV head (mean over its query group) or
// one ranking for the layer (mean over all heads); top round(r·T), ties to the earlier token.
std::vector<std::vector<char>> direct_flags(const Fixture& f, bool shared, double r) {
  const int group = f.H / f.KH;
  std::vector<std::vector<char>> flags(f.KH, std::vector<char>(f.T, 0));
  for (int kh = 0; kh < f.KH; ++kh) {
    std::vector<double> sal(f.T, 0);
    const int h0 = shared ? 0 : kh * group, h1 = shared ? f.H : (kh + 1) * group;
    for (int h = h0; h < h1; ++h)
      for (int i = 0; i < f.T; ++i)
        for (int q = i; q < f.T; ++q) sal[i] += f.probs[(static_cast<size_t>(h) * f.T + q) * f.T + i] / (f.T - i) / (h1 - h0);
    const std::vector<int> idx = ranked(sal);
    for (int i = 0; i < std::llround(r * f.T); ++i) flags[kh][idx[i]] = 1;
  }
  return flags;
}

// Expected payload bytes of ZipCache groups of rows (each group: the rows of some segments), from
// the rows' stored bits (hi = salient): K codes of each subset as one channel-wise stream and an
// fp16 scale/zero per channel and subset; V codes row by row; fp16 factors c per channel and
// subset (or per channel for the layer); fp16 scale/zero per token range (per head and token,
// or per subset and token over the heads); a 1-bit flag per row.
int64_t expected_bytes(const LayerKV& L, const std::vector<std::vector<size_t>>& groups, int D, int hi, int lo,
                       bool heads_ranges, bool layer_scales) {
  auto packed = [](int64_t n, int b) { return (n * b + 7) / 8; };
  int64_t total = 0;
  for (const auto& g : groups) {
    std::set<std::pair<int, int32_t>> tokens;  // (salient, position)
    for (size_t h = 0; h < L.segments[g[0]].heads.size(); ++h) {
      int64_t n[2] = {0, 0};
      for (size_t si : g) {
        const HeadRows& r = L.segments[si].heads[h];
        for (int i = 0; i < r.n(); ++i) {
          const int s = r.bits.at(i) == hi ? 1 : 0;
          ++n[s];
          tokens.insert({s, r.pos[i]});
        }
      }
      for (int s = 0; s < 2; ++s) {
        const int b = s ? hi : lo;
        if (n[s] == 0) continue;
        total += packed(n[s] * D, b) + 4 * D + n[s] * packed(D, b);  // K stream + ranges, V codes
        if (!layer_scales) total += 2 * D;                             // c per subset
        if (!heads_ranges) total += 4 * n[s];                          // a range per row
      }
      if (layer_scales && n[0] + n[1] > 0) total += 2 * D;
      total += (n[0] + n[1] + 7) / 8;  // flags
    }
    if (heads_ranges) total += 4 * static_cast<int64_t>(tokens.size());
  }
  return total;
}

int64_t payload_bytes(const LayerKV& L) {
  int64_t b = 0;
  for (const KVSegment& s : L.segments) b += s.bytes.total() - s.bytes.indices;
  return b;
}

}  // namespace

TEST(ZipCache, LayerSubsetsAndHeadSpanningTokenRangesMatchDirectComputation) {
  // The defaults: each layer's salient and regular rows quantized as wholes (Algorithm 2); K one
  // range per KV head, channel and subset; V normalised by c_j = sqrt(max|v_j|) over the head's
  // subset rows, then one range per token over every head that holds it in that subset.
  for (const bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "shared saliency" : "per-head saliency");
    Fixture f(5, 30, 6, 16, 130);
    auto p = make_policy(std::string("zipcache:probe=all,recent_ratio=1,random_ratio=0") +
                         (shared ? ",saliency_heads=shared" : ""));
    f.prefill(*p), expect_accounting(f.store);
    const LayerKV& L = f.store.layer(0);
    ASSERT_EQ(L.segments.size(), 3u);
    for (const KVSegment& s : L.segments) EXPECT_EQ(s.payload, L.segments[0].payload) << "one payload per layer";
    const auto flags = direct_flags(f, shared, 0.4);
    const int D = f.D;
    auto row = [&](int kh, int t) {  // the stored K and V rows of token t in head kh
      for (const KVSegment& s : L.segments)
        for (int i = 0; i < s.heads[kh].n(); ++i)
          if (s.heads[kh].pos[i] == t) return std::make_tuple(&s.heads[kh].k[i * D], &s.heads[kh].v[i * D], s.heads[kh].bits[i]);
      ADD_FAILURE() << "no row " << t;
      return std::make_tuple(static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), uint8_t{0});
    };
    // c[kh][s][j] from the original values of the subset's rows.
    std::vector<std::array<std::vector<float>, 2>> c(f.KH);
    for (int kh = 0; kh < f.KH; ++kh)
      for (int s = 0; s < 2; ++s) {
        c[kh][s].assign(D, 0.0f);
        for (int t = 0; t < f.T; ++t)
          if (flags[kh][t] == s)
            for (int j = 0; j < D; ++j) c[kh][s][j] = std::max(c[kh][s][j], std::fabs(f.val(t, kh)[j]));
        for (float& x : c[kh][s]) x = x > 0 ? round_half(std::sqrt(x)) : 1.0f;
      }
    int ranges = 0;
    for (int s = 0; s < 2; ++s) {
      const float L_ = s ? 15.0f : 3.0f;  // 4 and 2 bits
      // K: per head and channel over the subset, whatever the segment.
      for (int kh = 0; kh < f.KH; ++kh)
        for (int j = 0; j < D; ++j) {
          float lo = INFINITY, hi = -INFINITY;
          for (int t = 0; t < f.T; ++t)
            if (flags[kh][t] == s) lo = std::min(lo, f.key(t, kh)[j]), hi = std::max(hi, f.key(t, kh)[j]);
          const float a = round_half(lo), sc = round_half((hi - lo) / L_);
          for (int t = 0; t < f.T; ++t)
            if (flags[kh][t] == s) {
              const float code = std::clamp(std::nearbyint((f.key(t, kh)[j] - a) / sc), 0.0f, L_);
              EXPECT_EQ(std::get<0>(row(kh, t))[j], code * sc + a) << "K token " << t << " head " << kh;
              EXPECT_EQ(std::get<2>(row(kh, t)), s ? 4 : 2);
            }
        }
      // V: one range per token over the heads that put it in subset s.
      for (int t = 0; t < f.T; ++t) {
        float lo = INFINITY, hi = -INFINITY;
        int heads = 0;
        for (int kh = 0; kh < f.KH; ++kh)
          if (flags[kh][t] == s) {
            ++heads;
            for (int j = 0; j < D; ++j) lo = std::min(lo, f.val(t, kh)[j] / c[kh][s][j]), hi = std::max(hi, f.val(t, kh)[j] / c[kh][s][j]);
          }
        if (!heads) continue;
        ++ranges;
        const float a = round_half(lo), sc = round_half((hi - lo) / L_);
        for (int kh = 0; kh < f.KH; ++kh)
          if (flags[kh][t] == s)
            for (int j = 0; j < D; ++j) {
              const float code = std::clamp(std::nearbyint((f.val(t, kh)[j] / c[kh][s][j] - a) / sc), 0.0f, L_);
              EXPECT_EQ(std::get<1>(row(kh, t))[j], (code * sc + a) * c[kh][s][j]) << "V token " << t << " head " << kh;
            }
      }
    }
    // One range per token when every head ranks alike (hd + 2bl parameters); more otherwise.
    if (shared) {
      EXPECT_EQ(ranges, f.T);
    } else {
      EXPECT_GT(ranges, f.T);
    }
    EXPECT_EQ(payload_bytes(L), expected_bytes(L, {{0, 1, 2}}, D, 4, 2, true, false));
  }
}

TEST(ZipCache, BytesFollowTheRangeGranularity) {
  // The same store at each granularity: the bytes are what its ranges, factors and codes take.
  struct Case {
    std::string spec;
    bool per_segment, heads_ranges, layer_scales;
  };
  const std::vector<Case> cases = {
      {"", false, true, false},
      {"channel_scales=layer", false, true, true},
      {"value_token_range=head", false, false, false},
      {"ranges=segment", true, true, false},
      {"ranges=segment,value_token_range=head", true, false, false},
      {"preset=official", false, true, true},
      {"preset=paper", false, true, false},
  };
  std::map<std::string, int64_t> bytes;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec);
    Fixture f(6, 40, 9, 16, 140);
    auto p = make_policy("zipcache:high_bits=4,low_bits=2" + (c.spec.empty() ? "" : "," + c.spec));
    f.prefill(*p), expect_accounting(f.store);
    const LayerKV& L = f.store.layer(0);
    std::vector<std::vector<size_t>> groups;
    if (c.per_segment) groups = {{0}, {1}, {2}};
    else groups = {{0, 1, 2}};
    for (size_t i = 0; i < L.segments.size(); ++i)
      EXPECT_EQ(L.segments[i].payload == L.segments[0].payload, !c.per_segment || i == 0);
    bytes[c.spec] = payload_bytes(L);
    EXPECT_EQ(bytes[c.spec], expected_bytes(L, groups, f.D, 4, 2, c.heads_ranges, c.layer_scales));
  }
  // Layer-wide subsets store fewer ranges than per-segment ones; one range per token over the
  // heads fewer than one per token and head; layer-wide factors fewer than per subset.
  EXPECT_LT(bytes[""], bytes["ranges=segment"]);
  EXPECT_LT(bytes[""], bytes["value_token_range=head"]);
  EXPECT_LT(bytes["channel_scales=layer"], bytes[""]);
  EXPECT_EQ(bytes["preset=paper"], bytes[""]);
  EXPECT_EQ(bytes["preset=official"], bytes["channel_scales=layer"]);
}

TEST(ZipCache, LayerChannelScalesComeFromEveryRowOfTheHead) {
  // channel_scales=layer: c_j = sqrt(max|v_j|) over the head's salient and regular rows alike
  // (the authors' code), so both subsets divide by the same factor.
  Fixture f(4, 20, 6, 16, 150);
  auto p = make_policy("zipcache:channel_scales=layer,value_token_range=head");
  f.prefill(*p);
  const auto& q = payload(f.store.layer(0).segments[0]);
  for (int kh = 0; kh < f.KH; ++kh) {
    ASSERT_EQ(q.v[kh].meta.size(), static_cast<size_t>(f.D));
    for (int j = 0; j < f.D; ++j) {
      float m = 0;
      for (int t = 0; t < f.T; ++t) m = std::max(m, std::fabs(f.val(t, kh)[j]));
      EXPECT_EQ(quant::from_half(q.v[kh].meta[j]), round_half(std::sqrt(m)));
    }
  }
}

TEST(ZipCache, PayloadDecodesAsItsCodeLayoutSays) {
  // A device reads ZipCache's payload as quant::CodeLayout::ZipMixed describes it (the CUDA cache
  // holds it packed): decoding the codes, ranges and factors by that description alone gives
  // every stored row of every group exactly — the prompt's group over three segments, one
  // segment a group, shared or per-head token ranges, factors per subset or per layer, one
  // ranking for every head, and streaming gaps quantized during decode.
  for (const std::string spec :
       {"zipcache:gap=4", "zipcache:preset=official,gap=5", "zipcache:value_token_range=head,gap=4",
        "zipcache:saliency_heads=shared,saliency_ratio=0.3,gap=4", "zipcache:ranges=segment,gap=6",
        "zipcache:ranges=segment,value_token_range=head,high_bits=8,low_bits=1,gap=3"}) {
    SCOPED_TRACE(spec);
    Fixture f(5, 30, 6, 16, 170);
    auto pol = make_policy(spec);
    f.prefill(*pol);
    f.decode(*pol, 13);
    const LayerKV& L = f.store.layer(0);
    const int D = f.D;
    int groups = 0;
    for (size_t i = 0; i < L.segments.size();) {
      size_t j = i + 1;
      while (j < L.segments.size() && L.segments[j].payload == L.segments[i].payload) ++j;
      const auto* p = dynamic_cast<const quant::QuantPayload*>(L.segments[i].payload.get());
      if (!p) {
        i = j;
        continue;
      }
      ++groups;
      const quant::CodeLayout& y = p->layout;
      ASSERT_EQ(y.kind, quant::CodeLayout::Kind::ZipMixed);
      const int bits[2] = {y.lo_bits, y.hi_bits};
      // The shared token ranges: per subset (salient first) the positions some head holds in
      // it, ascending.
      std::array<std::map<int32_t, size_t>, 2> token;
      std::vector<std::vector<const float*>> K(f.KH), V(f.KH);
      std::vector<std::vector<int32_t>> P(f.KH);
      for (int h = 0; h < f.KH; ++h)
        for (size_t g = i; g < j; ++g)
          for (int r = 0; r < L.segments[g].heads[h].n(); ++r) {
            K[h].push_back(&L.segments[g].heads[h].k[static_cast<size_t>(r) * D]);
            V[h].push_back(&L.segments[g].heads[h].v[static_cast<size_t>(r) * D]);
            P[h].push_back(L.segments[g].heads[h].pos[r]);
          }
      auto flag = [&](int h, size_t r) { return static_cast<int>(quant::unpack_one(p->k[h].flags.data(), static_cast<int64_t>(r), 1)); };
      for (int h = 0; h < f.KH; ++h)
        for (size_t r = 0; r < P[h].size(); ++r) token[flag(h, r)][P[h][r]] = 0;
      size_t t = 0;
      for (int s = 1; s >= 0; --s)
        for (auto& e : token[s]) e.second = t++;
      if (y.shared_token_ranges) {
        ASSERT_EQ(p->tokens.scales.size(), t);
      }
      for (int h = 0; h < f.KH; ++h) {
        const quant::QuantBlock &kb = p->k[h], &vb = p->v[h];
        ASSERT_EQ(kb.flags.size(), (P[h].size() + 7) / 8);
        size_t kbyte = 0, vbyte = 0, ranges = 0, vrow = 0;
        for (int s = 1; s >= 0; --s) {
          std::vector<size_t> rows;
          for (size_t r = 0; r < P[h].size(); ++r)
            if (flag(h, r) == s) rows.push_back(r);
          if (rows.empty()) continue;
          const int b = bits[s];
          ASSERT_LE(ranges + D, kb.scales.size());
          for (size_t m = 0; m < rows.size(); ++m) {
            const size_t r = rows[m];
            const size_t tr = y.shared_token_ranges ? token[s].at(P[h][r]) : vrow;
            const float vs = quant::from_half(y.shared_token_ranges ? p->tokens.scales[tr] : vb.scales.at(tr));
            const float vz = quant::from_half(y.shared_token_ranges ? p->tokens.zeros[tr] : vb.zeros.at(tr));
            for (int c = 0; c < D; ++c) {
              const uint32_t kc = quant::unpack_one(kb.codes.data() + kbyte, static_cast<int64_t>(m) * D + c, b);
              const float kx = static_cast<float>(kc) * quant::from_half(kb.scales[ranges + c]) + quant::from_half(kb.zeros[ranges + c]);
              ASSERT_EQ(K[h][r][c], kx) << "K head " << h << " position " << P[h][r] << " channel " << c;
              const uint32_t vc = quant::unpack_one(vb.codes.data() + vbyte + m * D * b / 8, c, b);
              const float fac = quant::from_half(vb.meta.at((y.layer_factors ? 0 : ranges) + c));
              ASSERT_EQ(V[h][r][c], (static_cast<float>(vc) * vs + vz) * fac)
                  << "V head " << h << " position " << P[h][r] << " channel " << c;
            }
            ++vrow;
          }
          kbyte += rows.size() * D * b / 8;
          vbyte += rows.size() * D * b / 8;
          ranges += D;
        }
        EXPECT_EQ(kbyte, kb.codes.size());
        EXPECT_EQ(vbyte, vb.codes.size());
        EXPECT_EQ(ranges, kb.scales.size());
      }
      i = j;
    }
    EXPECT_GE(groups, 2) << "the prompt and at least one streaming gap";
  }
}

// Streaming acts only once `gap` generated rows are followed by a new one (Algorithm 3): a decode
// of new_tokens tokens appends new_tokens − 1 rows, so ZipCache says it acts within it
// (acts_on_decode_within) exactly when those rows can complete a gap — and the decode loop,
// which skips its steps' hook otherwise, loses nothing. Each step's hook is called here.
TEST(ZipCache, ActsWithinADecodeOnlyWhenAGapCompletes) {
  for (const int gap : {3, 4, 6}) {
    for (int rows = 1; rows <= 2 * gap + 2; ++rows) {
      SCOPED_TRACE("gap " + std::to_string(gap) + ", " + std::to_string(rows) + " rows appended");
      Fixture f(3, 20, 4, 16, 500 + gap);
      auto p = make_policy("zipcache:gap=" + std::to_string(gap));
      f.prefill(*p);
      f.decode(*p, rows);
      int quantized = 0;  // generated segments the steps quantized
      for (const KVSegment& s : f.store.layer(0).segments)
        if (s.kind == SegmentKind::Generated && !s.dense()) ++quantized;
      const bool acts = p->acts_on_decode_within(rows + 1);
      if (!acts) {
        EXPECT_EQ(quantized, 0) << "said it would not act, and did";
      }
      EXPECT_EQ(quantized > 0, rows >= gap + 1);
      EXPECT_EQ(acts, rows + 1 > gap);
    }
  }
  // In a stack, the quantization side's answer carries (an eviction acts at prefill alone), and
  // a method with no such answer acts in any decode.
  EXPECT_FALSE(make_policy("stack:evict=snapkv,quant=zipcache,gap=9")->acts_on_decode_within(9));
  EXPECT_TRUE(make_policy("stack:evict=snapkv,quant=zipcache,gap=9")->acts_on_decode_within(10));
  EXPECT_TRUE(make_policy("kivi")->acts_on_decode_within(2));
}
