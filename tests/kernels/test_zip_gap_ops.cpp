// ZipCache's streamed gap ranked and quantized on the device (zip_rank_gap, zip_gap_plan, then
// gather_rows and zip_quantize over zip_gap_layout's blocks, as kv_zip_gap.cu runs them) against
// the host's streaming: zipcache::rank_gap, itself checked against a stable sort, and
// zipcache::quantize_group on the same fp16 rows — flags, order, codes, ranges and factors equal
// byte for byte, on fresh random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/compress/quant_methods.h"
#include "core/half.h"
#include "core/kv_format.h"
#include "tests/op_harness.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

// Saliency with ties: values drawn from a few levels, so equal keys are common.
std::vector<double> tied_saliency(std::mt19937_64& r, size_t n) {
  std::vector<double> s(n);
  for (double& x : s) x = static_cast<double>(r() % 7) * 0.125 + (r() % 4 == 0 ? 1e-3 * static_cast<double>(r() % 3) : 0.0);
  return s;
}

// The flags a stable sort by descending key gives: its first round(ratio·n) rows.
std::vector<char> stable_top(const std::vector<double>& key, double ratio) {
  const int n = static_cast<int>(key.size());
  const int k = std::clamp(static_cast<int>(std::llround(ratio * n)), 0, n);
  std::vector<int> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key[static_cast<size_t>(a)] > key[static_cast<size_t>(b)]; });
  std::vector<char> f(static_cast<size_t>(n), 0);
  for (int i = 0; i < k; ++i) f[static_cast<size_t>(idx[static_cast<size_t>(i)])] = 1;
  return f;
}

struct RankCase {
  int NKV, gap;
  double ratio;
  bool shared;
};
const RankCase kRankCases[] = {{3, 1, 0.4, false}, {3, 8, 0.4, false}, {4, 16, 0.5, true}, {2, 37, 0.3, false},
                               {5, 37, 0.6, true}, {3, 300, 0.4, false}, {3, 300, 0.4, true}, {2, 8, 0.0, false},
                               {2, 8, 1.0, true}};

}  // namespace

// The host's ranking (what the device must match) against a stable sort: per KV head and
// shared (the heads' sum, in head order), ties to the earlier row, k = 0 and k = gap.
TEST(ZipGapOps, HostRankingIsAStableSortsTop) {
  std::mt19937_64 r(rng()());
  for (const RankCase& c : kRankCases) {
    SCOPED_TRACE("gap " + std::to_string(c.gap) + (c.shared ? " shared" : " per head") + " ratio " + std::to_string(c.ratio));
    const std::vector<double> sal = tied_saliency(r, static_cast<size_t>(c.NKV) * c.gap);
    const std::vector<std::vector<char>> got = zipcache::rank_gap(sal.data(), c.NKV, c.gap, c.ratio, c.shared);
    ASSERT_EQ(static_cast<int>(got.size()), c.NKV);
    std::vector<double> sum(static_cast<size_t>(c.gap), 0.0);
    for (int h = 0; h < c.NKV; ++h)
      for (int j = 0; j < c.gap; ++j) sum[static_cast<size_t>(j)] += sal[static_cast<size_t>(h * c.gap + j)];
    for (int h = 0; h < c.NKV; ++h) {
      const std::vector<double> own(sal.begin() + h * c.gap, sal.begin() + (h + 1) * c.gap);
      EXPECT_EQ(got[static_cast<size_t>(h)], stable_top(c.shared ? sum : own, c.ratio)) << "KV head " << h;
    }
  }
}

#ifdef KVLENS_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/zip_kernels.h"
#include "tests/device_buffer.h"
namespace {

void poison(Dev& d, size_t bytes) { ASSERT_EQ(cudaMemset(d.p, 0xA5, bytes), cudaSuccess); }

// Each row's subset order for flags f: the salient rows ascending, then the others.
std::vector<int32_t> subset_order(const std::vector<char>& f) {
  std::vector<int32_t> o;
  for (int s = 1; s >= 0; --s)
    for (size_t j = 0; j < f.size(); ++j)
      if ((f[j] != 0) == (s == 1)) o.push_back(static_cast<int32_t>(j));
  return o;
}

// The device's ranking of every layer's KV heads in one launch against rank_gap: flags, order
// and packed flags exact, outputs poisoned first.
TEST(ZipGapOps, RankKernelAgainstTheHostsRanking) {
  KVLENS_NEED_GPU();
  std::mt19937_64 r(rng()());
  const int L = 3;
  for (const RankCase& c : kRankCases) {
    SCOPED_TRACE("gap " + std::to_string(c.gap) + (c.shared ? " shared" : " per head") + " ratio " + std::to_string(c.ratio));
    const size_t n = static_cast<size_t>(L) * c.NKV * c.gap, fb = static_cast<size_t>(c.gap + 7) / 8;
    const std::vector<double> sal = tied_saliency(r, n);
    const int k = std::clamp(static_cast<int>(std::llround(c.ratio * c.gap)), 0, c.gap);
    Dev S(sal), K(n * 8), M(n), O(n * 4), F(static_cast<size_t>(L) * c.NKV * fb);
    poison(O, n * 4);
    poison(F, static_cast<size_t>(L) * c.NKV * fb);
    cuda::zip_rank_gap(S.as<double>(), L, c.NKV, c.gap, k, c.shared, K.as<double>(), M.as<uint8_t>(), O.as<int32_t>(),
                       F.as<uint8_t>(), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint8_t> mark = M.host<uint8_t>(n), flags = F.host<uint8_t>(static_cast<size_t>(L) * c.NKV * fb);
    const std::vector<int32_t> order = O.host<int32_t>(n);
    for (int l = 0; l < L; ++l) {
      const std::vector<std::vector<char>> want =
          zipcache::rank_gap(sal.data() + static_cast<size_t>(l) * c.NKV * c.gap, c.NKV, c.gap, c.ratio, c.shared);
      for (int h = 0; h < c.NKV; ++h) {
        SCOPED_TRACE("layer " + std::to_string(l) + " KV head " + std::to_string(h));
        const size_t at = (static_cast<size_t>(l) * c.NKV + h) * c.gap;
        const std::vector<char>& w = want[static_cast<size_t>(h)];
        std::vector<char> got(mark.begin() + static_cast<ptrdiff_t>(at), mark.begin() + static_cast<ptrdiff_t>(at + c.gap));
        EXPECT_EQ(got, w);
        EXPECT_EQ(std::vector<int32_t>(order.begin() + static_cast<ptrdiff_t>(at), order.begin() + static_cast<ptrdiff_t>(at + c.gap)),
                  subset_order(w));
        std::vector<uint32_t> bits(w.begin(), w.end());
        std::vector<uint8_t> packed;
        quant::pack(bits.data(), static_cast<int64_t>(bits.size()), 1, packed);
        const size_t f0 = (static_cast<size_t>(l) * c.NKV + h) * fb;
        EXPECT_EQ(std::vector<uint8_t>(flags.begin() + static_cast<ptrdiff_t>(f0), flags.begin() + static_cast<ptrdiff_t>(f0 + fb)), packed);
      }
    }
  }
}

// A gap of every layer's tail ranked, laid out, gathered and quantized on the device as
// kv_zip_gap.cu does, against the host's streaming of the same fp16 rows (rank_gap, then
// mark_group and quantize_group): per layer and KV head the flags, the positions, the codes of
// both sides, the key ranges, the CST factors and each row's V token range byte for byte. Two
// layers of three KV heads at a random tail row; gaps of 8 and 37 rows; bits 4/2, 8/1, 3/3; V
// ranges shared by the heads or per row, factors per subset or per head, rankings per head or
// shared; head sizes 128 and 40.
TEST(ZipGapOps, GapQuantizedAsTheHostsStreaming) {
  KVLENS_NEED_GPU();
  std::mt19937_64 r(rng()());
  const int L = 2, NKV = 3;
  for (const int D : {128, 40})
    for (const int gap : {8, 37}) {
      const int first = static_cast<int>(r() % 11), cap = first + gap + 5;
      const size_t tail = static_cast<size_t>(NKV) * cap;
      // Each layer's tail rows (fp16), positions 1000 + row.
      std::vector<std::vector<float>> hk(L), hv(L);
      std::vector<int32_t> hpos(tail);
      for (size_t i = 0; i < tail; ++i) hpos[i] = 1000 + static_cast<int32_t>(i % static_cast<size_t>(cap));
      std::vector<std::unique_ptr<Dev>> mem;
      std::vector<const void*> ptrs(3 * static_cast<size_t>(L));
      for (int l = 0; l < L; ++l) {
        hk[l] = rounded(Dt::F16, randn(tail * D, 3.0f));
        hv[l] = rounded(Dt::F16, randn(tail * D, 0.5f));
        for (size_t i = 0; i < tail; ++i) hv[l][i * D + 1] = 0.0f;  // an all-zero value channel (factor 1)
        hk[l][static_cast<size_t>(first + 2) * D + 3] = 65504.0f;
        for (const std::vector<float>* x : {&hk[l], &hv[l]}) {
          std::vector<uint16_t> h(x->size());
          to_half_n(x->data(), h.data(), static_cast<int64_t>(h.size()));
          mem.push_back(std::make_unique<Dev>(h));
        }
        mem.push_back(std::make_unique<Dev>(hpos));
        ptrs[static_cast<size_t>(l)] = mem[mem.size() - 3]->p;
        ptrs[static_cast<size_t>(L + l)] = mem[mem.size() - 2]->p;
        ptrs[static_cast<size_t>(2 * L + l)] = mem.back()->p;
      }
      Dev T(ptrs);
      cuda::ZipGapRows rows;
      rows.k = reinterpret_cast<const __half* const*>(T.as<const void*>());
      rows.v = rows.k + L;
      rows.pos = reinterpret_cast<const int32_t* const*>(T.as<const void*>() + 2 * L);
      rows.cap = cap;
      rows.first = first;
      const int64_t N = static_cast<int64_t>(L) * NKV * gap, per = static_cast<int64_t>(NKV) * gap;
      const size_t fb = static_cast<size_t>(gap + 7) / 8;
      for (const auto& [hi, lo] : {std::pair<int, int>{4, 2}, {8, 1}, {3, 3}})
        for (const bool head_ranges : {false, true})
          for (const bool layer_factors : {false, true})
            for (const bool shared : {false, true}) {
              SCOPED_TRACE("D=" + std::to_string(D) + " gap " + std::to_string(gap) + " bits " + std::to_string(hi) + "/" +
                           std::to_string(lo) + (head_ranges ? ", ranges per row" : ", shared ranges") +
                           (layer_factors ? ", factors per head" : ", factors per subset") +
                           (shared ? ", shared ranking" : ", ranking per head"));
              const double ratio = 0.4;
              const int k = static_cast<int>(std::llround(ratio * gap));
              const std::vector<double> sal = tied_saliency(r, static_cast<size_t>(N));
              const cuda::ZipGapLayout Z = cuda::zip_gap_layout(L, NKV, gap, k, D, hi, lo, layer_factors);
              const int64_t n_slots = head_ranges ? N : static_cast<int64_t>(L) * 2 * gap;
              Dev S(sal), K(N * 8), M(N), O(N * 4), F(L * NKV * fb), P(N * 4), src(2 * N * 8), rs(N * 4),
                  sf((n_slots + 1) * 4), sr(N * 4), X(2 * N * D * 2), B(Z.blocks), FB(Z.factor_blocks), RB(Z.row_block),
                  KC(Z.code), VC(Z.code), KS(Z.range * 2), KZ(Z.range * 2), VM(Z.factor * 2), TS(n_slots * 2),
                  TZ(n_slots * 2), RS(N * 2), RZ(N * 2);
              for (Dev* d : {&KC, &VC})
                poison(*d, static_cast<size_t>(Z.code));
              for (Dev* d : {&RS, &RZ, &P}) poison(*d, static_cast<size_t>(d == &P ? N * 4 : N * 2));
              cuda::zip_rank_gap(S.as<double>(), L, NKV, gap, k, shared, K.as<double>(), M.as<uint8_t>(), O.as<int32_t>(),
                                 F.as<uint8_t>(), nullptr);
              cuda::zip_gap_plan(rows, L, NKV, gap, k, D, !head_ranges, O.as<int32_t>(), M.as<uint8_t>(),
                                 src.as<const __half*>(), rs.as<int32_t>(), sf.as<int32_t>(), sr.as<int32_t>(),
                                 P.as<int32_t>(), nullptr);
              cuda::gather_rows(src.as<const __half*>(), X.as<__half>(), static_cast<int>(2 * N), D, nullptr);
              cuda::ZipQuantArgs a;
              a.x = X.as<__half>();
              a.N = static_cast<int>(N);
              a.D = D;
              a.blocks = B.as<cuda::ZipBlock>();
              a.n_blocks = static_cast<int>(Z.blocks.size());
              a.factor_blocks = FB.as<cuda::ZipFactorBlock>();
              a.n_factor_blocks = static_cast<int>(Z.factor_blocks.size());
              a.row_block = RB.as<int32_t>();
              a.row_slot = rs.as<int32_t>();
              a.slot_first = sf.as<int32_t>();
              a.slot_rows = sr.as<int32_t>();
              a.n_slots = static_cast<int>(n_slots);
              a.k_codes = KC.as<uint8_t>();
              a.v_codes = VC.as<uint8_t>();
              a.k_scale = KS.as<__half>();
              a.k_zero = KZ.as<__half>();
              a.factor = VM.as<__half>();
              a.t_scale = TS.as<__half>();
              a.t_zero = TZ.as<__half>();
              if (!head_ranges) {
                a.row_scale = RS.as<__half>();
                a.row_zero = RZ.as<__half>();
              }
              cuda::zip_quantize(a, nullptr);
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              const auto kc = KC.host<uint8_t>(Z.code), vc = VC.host<uint8_t>(Z.code), flags = F.host<uint8_t>(L * NKV * fb);
              const auto ks = KS.host<uint16_t>(Z.range), kz = KZ.host<uint16_t>(Z.range), vm = VM.host<uint16_t>(Z.factor);
              const auto vs = (head_ranges ? TS : RS).host<uint16_t>(N), vz = (head_ranges ? TZ : RZ).host<uint16_t>(N);
              const auto pos = P.host<int32_t>(N), order = O.host<int32_t>(N);
              const zipcache::GroupSpec spec{hi, lo, head_ranges, layer_factors};
              for (int l = 0; l < L; ++l) {
                SCOPED_TRACE("layer " + std::to_string(l));
                // The host's streaming of this layer's gap.
                LayerKV layer;
                KVSegment g;
                g.kind = SegmentKind::Generated;
                g.storage = "fp16";
                g.heads.resize(NKV);
                for (int h = 0; h < NKV; ++h) {
                  HeadRows& hr = g.heads[static_cast<size_t>(h)];
                  const size_t r0 = static_cast<size_t>(h) * cap + first;
                  hr.pos.assign(hpos.begin() + static_cast<ptrdiff_t>(r0), hpos.begin() + static_cast<ptrdiff_t>(r0 + gap));
                  hr.k.assign(hk[l].begin() + static_cast<ptrdiff_t>(r0 * D), hk[l].begin() + static_cast<ptrdiff_t>((r0 + gap) * D));
                  hr.v.assign(hv[l].begin() + static_cast<ptrdiff_t>(r0 * D), hv[l].begin() + static_cast<ptrdiff_t>((r0 + gap) * D));
                }
                layer.segments.push_back(std::move(g));
                const zipcache::Flags fl{zipcache::rank_gap(sal.data() + l * per, NKV, gap, ratio, shared)};
                quant::QuantPayload p(NKV);
                zipcache::mark_group(layer, {0}, fl, spec, p);
                zipcache::quantize_group(layer, {0}, fl, D, spec, p);
                std::vector<std::array<std::vector<int32_t>, 2>> sub_pos(NKV);
                for (int h = 0; h < NKV; ++h)
                  for (int j : subset_order(fl[0][static_cast<size_t>(h)]))
                    sub_pos[static_cast<size_t>(h)][fl[0][static_cast<size_t>(h)][static_cast<size_t>(j)] ? 1 : 0].push_back(
                        layer.segments[0].heads[static_cast<size_t>(h)].pos[static_cast<size_t>(j)]);
                const quant::ZipSlots zs = head_ranges ? quant::ZipSlots{} : quant::zip_slots(sub_pos);
                for (int h = 0; h < NKV; ++h) {
                  SCOPED_TRACE("KV head " + std::to_string(h));
                  const size_t hh = static_cast<size_t>(h);
                  auto slice = [](const auto& v, int64_t from, int64_t n) {
                    return std::vector<typename std::decay_t<decltype(v)>::value_type>(v.begin() + from, v.begin() + from + n);
                  };
                  const int64_t c0 = l * Z.layer_code + Z.head_code[hh];
                  const int64_t c1 = h + 1 < NKV ? l * Z.layer_code + Z.head_code[hh + 1] : (l + 1) * Z.layer_code;
                  EXPECT_EQ(slice(kc, c0, c1 - c0), p.k[hh].codes);
                  EXPECT_EQ(slice(vc, c0, c1 - c0), p.v[hh].codes);
                  const int64_t g0 = l * Z.layer_range + Z.head_range[hh];
                  EXPECT_EQ(slice(ks, g0, static_cast<int64_t>(p.k[hh].scales.size())), p.k[hh].scales);
                  EXPECT_EQ(slice(kz, g0, static_cast<int64_t>(p.k[hh].zeros.size())), p.k[hh].zeros);
                  const int64_t f0 = l * Z.layer_factor + Z.head_factor[hh];
                  EXPECT_EQ(slice(vm, f0, static_cast<int64_t>(p.v[hh].meta.size())), p.v[hh].meta);
                  EXPECT_EQ(slice(flags, (l * NKV + h) * static_cast<int64_t>(fb), static_cast<int64_t>(fb)), p.k[hh].flags);
                  const int64_t row0 = l * per + static_cast<int64_t>(h) * gap;
                  EXPECT_EQ(slice(pos, row0, gap), layer.segments[0].heads[hh].pos);
                  const std::vector<int32_t> o = subset_order(fl[0][hh]);
                  EXPECT_EQ(slice(order, row0, gap), o);
                  // Each row's V token range: its own, or its (subset, position)'s slot's.
                  std::vector<uint16_t> want_s, want_z;
                  for (int i = 0; i < gap; ++i) {
                    if (head_ranges) {
                      want_s.push_back(p.v[hh].scales[static_cast<size_t>(i)]);
                      want_z.push_back(p.v[hh].zeros[static_cast<size_t>(i)]);
                      continue;
                    }
                    const int j = o[static_cast<size_t>(i)];
                    const int32_t at = zs.of(i < k ? 1 : 0, layer.segments[0].heads[hh].pos[static_cast<size_t>(j)]);
                    want_s.push_back(p.tokens.scales[static_cast<size_t>(at)]);
                    want_z.push_back(p.tokens.zeros[static_cast<size_t>(at)]);
                  }
                  EXPECT_EQ(slice(vs, row0, gap), want_s);
                  EXPECT_EQ(slice(vz, row0, gap), want_z);
                }
              }
            }
    }
}

}  // namespace
#endif
