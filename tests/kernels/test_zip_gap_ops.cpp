// ZipCache's streamed gap scored, ranked and quantized on the device (zip_gap_saliency from the
// probes' kept softmax states, zip_rank_gap, zip_gap_plan, then gather_rows and zip_quantize over
// zip_gap_layout's blocks, as kv_zip_gap.cu runs them) against the host's streaming:
// zipcache::gap_saliency over every row the probes saw, zipcache::rank_gap, itself checked
// against a stable sort, and zipcache::quantize_group on the same fp16 rows — flags, order,
// codes, ranges and factors equal byte for byte, on fresh random inputs; the gaps' store
// (zip_store_layout, zip_store_gap) holding every gap where its parts read it; and the decode
// kernels reading CST factors a group of rows (the store's parts) as they read each group as a
// part of its own, and keeping a probe's softmax states (KeptQueries::md).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
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
#include "tests/decode_kernel_case.h"
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
// shared, key ranges by either kernel (a block a channel, or a thread a channel for few rows);
// head sizes 128 and 40.
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
                           (shared ? ", shared ranking" : ", ranking per head") +
                           (head_ranges == shared ? ", key ranges a thread a channel" : ", key ranges a block a channel"));
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
              // (half the cases say how few rows a block holds: key ranges a thread a channel)
              a.max_block_rows = head_ranges == shared ? std::max(k, gap - k) : 0;
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

// The result allocation kv_zip_gap.cu quantizes a gap into (its offsets), for L layers of NKV heads.
cuda::ZipGapResult gap_result(const cuda::ZipGapLayout& Z, int L, int NKV, int gap, bool shared_ranges, int64_t& bytes) {
  cuda::ArrayLayout rs;
  const int64_t N = static_cast<int64_t>(L) * NKV * gap;
  cuda::ZipGapResult r{cuda::ZipOutputs(rs, Z.code, Z.range, Z.factor, shared_ranges ? L * 2LL * gap : N, shared_ranges ? N : 0)};
  r.flags = rs.put(static_cast<int64_t>(L) * NKV * ((gap + 7) / 8));
  r.pos = rs.put(N * 4);
  r.order = rs.put(N * 4);
  bytes = rs.bytes;
  return r;
}

// zip_store_gap's host twin: each run's bytes copied to its place for gap gi.
void store_gap_host(const std::vector<cuda::ZipStoreRun>& runs, const std::vector<uint8_t>& result, std::vector<uint8_t>& store,
                    int gi) {
  for (const cuda::ZipStoreRun& x : runs)
    std::copy_n(result.begin() + x.src, x.bytes, store.begin() + x.dst + static_cast<int64_t>(gi) * x.bytes);
}

struct StoreCase {
  int L, NKV, gap, k, D, hi, lo;
  bool layer_factors, shared_ranges;
};
const StoreCase kStoreCases[] = {{2, 3, 8, 3, 128, 4, 2, false, true},  {2, 3, 8, 3, 128, 4, 2, true, false},
                                 {3, 2, 37, 15, 40, 8, 1, false, false}, {1, 2, 8, 0, 64, 4, 2, true, true},
                                 {2, 2, 8, 8, 64, 4, 2, false, true},    {2, 1, 5, 2, 16, 3, 3, false, false}};

// The gaps' store laid out for every gap: each gap's result copied by the runs (their host twin)
// puts, per layer, KV head and subset, the arrays where the decode's parts read them — row i of
// gap g's subset at row g·n_s + i, its key ranges and CST factors at group g, its flags,
// positions and order at gap g — equal to the gap's result as a gap's own segment read it
// (codes by ZipGapLayout's head offsets, salient first; V ranges a row each; factors a subset or a
// head); every store byte written by at most one run and gap, every run within its arrays.
TEST(ZipGapOps, StoreHoldsEveryGapWhereItsPartsRead) {
  for (const StoreCase& c : kStoreCases) {
    SCOPED_TRACE("L=" + std::to_string(c.L) + " NKV=" + std::to_string(c.NKV) + " gap " + std::to_string(c.gap) + " k=" +
                 std::to_string(c.k) + " D=" + std::to_string(c.D) + (c.layer_factors ? " factors a head" : "") +
                 (c.shared_ranges ? " shared ranges" : ""));
    const int gaps = 3;
    const cuda::ZipGapLayout Z = cuda::zip_gap_layout(c.L, c.NKV, c.gap, c.k, c.D, c.hi, c.lo, c.layer_factors);
    int64_t rbytes = 0;
    const cuda::ZipGapResult res = gap_result(Z, c.L, c.NKV, c.gap, c.shared_ranges, rbytes);
    const cuda::ZipStoreLayout S =
        cuda::zip_store_layout(Z, res, c.L, c.NKV, c.gap, c.k, c.D, c.hi, c.lo, c.layer_factors, gaps);
    ASSERT_EQ(S.gaps, gaps);
    // Every store byte written once at most; every run inside both allocations.
    std::vector<int> writes(static_cast<size_t>(S.bytes), 0);
    for (const cuda::ZipStoreRun& x : S.runs) {
      ASSERT_GT(x.bytes, 0);
      ASSERT_LE(x.src + x.bytes, rbytes);
      for (int g = 0; g < gaps; ++g) {
        ASSERT_LE(x.dst + (g + 1) * x.bytes, S.bytes);
        for (int64_t b = 0; b < x.bytes; ++b) ++writes[static_cast<size_t>(x.dst + g * x.bytes + b)];
      }
    }
    EXPECT_EQ(*std::max_element(writes.begin(), writes.end()), 1);
    std::vector<std::vector<uint8_t>> result(gaps);
    std::vector<uint8_t> store(static_cast<size_t>(S.bytes), 0xA5);
    for (int g = 0; g < gaps; ++g) {
      result[static_cast<size_t>(g)] = random_bytes(static_cast<size_t>(rbytes));
      store_gap_host(S.runs, result[static_cast<size_t>(g)], store, g);
    }
    const int n[2] = {c.gap - c.k, c.k}, bits[2] = {c.lo, c.hi};
    const int64_t fb = (c.gap + 7) / 8, per = static_cast<int64_t>(c.NKV) * c.gap;
    auto same = [&](int64_t store_at, const std::vector<uint8_t>& from, int64_t at, int64_t bytes, const std::string& what) {
      ASSERT_GE(store_at, 0) << what;
      EXPECT_TRUE(std::equal(from.begin() + at, from.begin() + at + bytes, store.begin() + store_at)) << what;
    };
    for (int l = 0; l < c.L; ++l)
      for (int h = 0; h < c.NKV; ++h) {
        const size_t lh = static_cast<size_t>(l) * c.NKV + h;
        for (int g = 0; g < gaps; ++g) {
          const std::vector<uint8_t>& R = result[static_cast<size_t>(g)];
          const std::string at = "layer " + std::to_string(l) + " head " + std::to_string(h) + " gap " + std::to_string(g);
          int64_t code = l * Z.layer_code + Z.head_code[static_cast<size_t>(h)];
          int64_t range = l * Z.layer_range + Z.head_range[static_cast<size_t>(h)];
          int64_t row = l * per + static_cast<int64_t>(h) * c.gap;
          const int64_t factor = l * Z.layer_factor + Z.head_factor[static_cast<size_t>(h)];
          int64_t subset_factor = factor;
          for (int s = 1; s >= 0; --s) {
            const cuda::ZipStoreLayout::Subset& x = S.sub[lh][static_cast<size_t>(s)];
            if (n[s] == 0) {
              EXPECT_EQ(x.kc, -1) << at << " empty subset " << s;
              continue;
            }
            const std::string w = at + " subset " + std::to_string(s);
            const int64_t cb = static_cast<int64_t>(n[s]) * c.D * bits[s] / 8;
            same(x.kc + g * cb, R, res.out.kc + code, cb, w + " K codes");
            same(x.vc + g * cb, R, res.out.vc + code, cb, w + " V codes");
            same(x.ks + g * c.D * 2LL, R, res.out.ks + range * 2, c.D * 2LL, w + " K scales");
            same(x.kz + g * c.D * 2LL, R, res.out.kz + range * 2, c.D * 2LL, w + " K zeros");
            same(x.f + g * c.D * 2LL, R, res.out.f + (c.layer_factors ? factor : subset_factor) * 2, c.D * 2LL, w + " factors");
            const int64_t vs = c.shared_ranges ? res.out.rs : res.out.ts, vz = c.shared_ranges ? res.out.rz : res.out.tz;
            same(x.vs + g * n[s] * 2LL, R, vs + row * 2, n[s] * 2LL, w + " V scales");
            same(x.vz + g * n[s] * 2LL, R, vz + row * 2, n[s] * 2LL, w + " V zeros");
            code += cb;
            range += c.D;
            row += n[s];
            subset_factor += c.D;
          }
          same(S.flags[lh] + g * fb, R, res.flags + static_cast<int64_t>(lh) * fb, fb, at + " flags");
          const int64_t ro = (static_cast<int64_t>(l) * c.NKV + h) * c.gap * 4, so = (static_cast<int64_t>(h) * gaps + g) * c.gap * 4;
          same(S.pos[static_cast<size_t>(l)] + so, R, res.pos + ro, c.gap * 4LL, at + " positions");
          same(S.order[static_cast<size_t>(l)] + so, R, res.order + ro, c.gap * 4LL, at + " order");
        }
      }
  }
}

// zip_store_gap against its host twin: the store layouts above for gaps 0, 1 and the last, and
// runs of odd sizes at odd offsets (bytes one at a time) beside aligned ones (16 at a time), the
// store poisoned first so that bytes no run writes must stay.
TEST(ZipGapOps, StoreKernelCopiesAsItsHostTwin) {
  KVLENS_NEED_GPU();
  std::mt19937_64 r(rng()());
  for (const StoreCase& c : kStoreCases) {
    const int gaps = 4;
    const cuda::ZipGapLayout Z = cuda::zip_gap_layout(c.L, c.NKV, c.gap, c.k, c.D, c.hi, c.lo, c.layer_factors);
    int64_t rbytes = 0;
    const cuda::ZipGapResult res = gap_result(Z, c.L, c.NKV, c.gap, c.shared_ranges, rbytes);
    cuda::ZipStoreLayout S = cuda::zip_store_layout(Z, res, c.L, c.NKV, c.gap, c.k, c.D, c.hi, c.lo, c.layer_factors, gaps);
    // Odd runs past the store's arrays: 1 to 40 bytes from odd places.
    int64_t end = S.bytes;
    for (int i = 0; i < 7; ++i) {
      const int64_t b = 1 + static_cast<int64_t>(r() % 40);
      S.runs.push_back({static_cast<int64_t>(r() % static_cast<uint64_t>(rbytes - 41)), end + 3, b});
      end += 3 + gaps * b;
    }
    const std::vector<uint8_t> result = random_bytes(static_cast<size_t>(rbytes));
    std::vector<uint8_t> want(static_cast<size_t>(end), 0xA5);
    Dev R(result), St(want), runs(S.runs);
    for (const int g : {0, 1, gaps - 1}) {
      SCOPED_TRACE("gap " + std::to_string(g) + " of store case gap " + std::to_string(c.gap));
      store_gap_host(S.runs, result, want, g);
      cuda::zip_store_gap(runs.as<cuda::ZipStoreRun>(), static_cast<int>(S.runs.size()), R.as<char>(), St.as<char>(), g, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(St.host<uint8_t>(want.size()), want);
    }
  }
}

// ZipCache's streamed-gap saliency on the device against zipcache::gap_saliency (the host's
// streaming) over the same rows: each probe's scores over the rows older than the gap (random)
// and over the gap's rows (its query against the tail's fp16 keys, in double, rounded to fp32),
// the device given only the tail, the queries and each probe's softmax state over all of them
// (max and sum in fp32, as its step keeps them; NaN for slots past a layer's 0 to S probes and
// for one pair of a probe, which like the host's pair of no positive sum is neither summed nor
// counted). KV heads with different counts of older rows, the gap from tail row 3, normalized
// and accumulated, head sizes 64 and 40. Bound: a row's term exp(s − M)/z is off by the device's
// fp32 score ((D + 2)·2^-24 of Σ|q·k|, scaled) and the state's fp32 sum (2^-24), relative;
// summed over the pairs that saw the row, as the saliency sums them.
TEST(ZipGapOps, SaliencyFromTheProbesStatesAsTheHostsStreaming) {
  KVLENS_NEED_GPU();
  std::mt19937_64 r(rng()());
  const int L = 3, S = 4, NH = 6, NKV = 3, G = NH / NKV, gap = 37, first = 3, cap = first + gap + 2;
  const std::vector<int32_t> n_probes = {3, 0, 4};
  for (const int D : {64, 40}) {
    SCOPED_TRACE("D=" + std::to_string(D));
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<int32_t> seen(static_cast<size_t>(L * S), 0), before(static_cast<size_t>(L * NKV));
    for (int l = 0; l < L; ++l) {
      for (int k = 0; k < n_probes[static_cast<size_t>(l)]; ++k) seen[static_cast<size_t>(l * S + k)] = 1 + static_cast<int>(r() % gap);
      seen[static_cast<size_t>(l * S)] = gap;  // (a probe at the gap's end)
      for (int h = 0; h < NKV; ++h) before[static_cast<size_t>(l * NKV + h)] = static_cast<int32_t>(r() % 300) + (h == 1 ? 0 : 5);
    }
    const std::vector<float> q = randn(static_cast<size_t>(L * S * NH * D));
    std::vector<std::vector<float>> tail(L);  // [NKV][cap][D] fp16 values
    for (auto& t : tail) t = rounded(Dt::F16, randn(static_cast<size_t>(NKV * cap * D)));
    // Per (layer, KV head): [probe][head][before + gap] scores; the states; each term's error.
    std::vector<float> md(static_cast<size_t>(L * S * NH * 2), std::numeric_limits<float>::quiet_NaN());
    std::vector<std::vector<float>> scores(static_cast<size_t>(L * NKV));
    std::vector<std::vector<double>> rel(static_cast<size_t>(L * NKV));  // [probe][head][gap]
    for (int l = 0; l < L; ++l)
      for (int kh = 0; kh < NKV; ++kh) {
        const int nb = before[static_cast<size_t>(l * NKV + kh)], stride = nb + gap, np = n_probes[static_cast<size_t>(l)];
        std::vector<float>& sc = scores[static_cast<size_t>(l * NKV + kh)];
        std::vector<double>& e = rel[static_cast<size_t>(l * NKV + kh)];
        sc.assign(static_cast<size_t>(np * G * stride), 0.0f);
        e.assign(static_cast<size_t>(np * G * gap), 0.0);
        for (int k = 0; k < np; ++k)
          for (int g = 0; g < G; ++g) {
            const int b = l * S + k, h = kh * G + g;
            float* x = sc.data() + (k * G + g) * stride;
            const std::vector<float> older = randn(static_cast<size_t>(nb), 3.0f);  // (then the gap's)
            std::copy(older.begin(), older.end(), x);
            for (int j = 0; j < gap; ++j) {
              const float* qh = q.data() + (static_cast<size_t>(b) * NH + h) * D;
              const float* kr = tail[static_cast<size_t>(l)].data() + (static_cast<size_t>(kh) * cap + first + j) * D;
              double d = 0.0, a = 0.0;
              for (int c = 0; c < D; ++c) {
                d += static_cast<double>(qh[c]) * kr[c];
                a += std::abs(static_cast<double>(qh[c]) * kr[c]);
              }
              x[nb + j] = static_cast<float>(d * scale);
              e[static_cast<size_t>((k * G + g) * gap + j)] = (D + 2) * std::ldexp(1.0, -24) * a * scale + std::ldexp(1.0, -23);
            }
            const int n = nb + seen[static_cast<size_t>(b)];
            if (l == 2 && k == 1 && g == 1) {  // (its state stays NaN)
              std::fill(x, x + stride, -INFINITY);
              continue;
            }
            float M = -INFINITY;
            for (int i = 0; i < n; ++i) M = std::max(M, x[i]);
            double z = 0.0;
            for (int i = 0; i < n; ++i) z += std::exp(static_cast<double>(x[i]) - M);
            md[static_cast<size_t>(b * NH + h) * 2] = M;
            md[static_cast<size_t>(b * NH + h) * 2 + 1] = static_cast<float>(z);
          }
      }
    std::vector<std::unique_ptr<Dev>> tails;
    std::vector<const __half*> kptr;
    for (const auto& t : tail) kptr.push_back(tails.emplace_back(std::make_unique<Dev>(halves(t)))->as<const __half>());
    std::vector<int32_t> args(n_probes);  // n_probes, then seen
    args.insert(args.end(), seen.begin(), seen.end());
    Dev Q(q), MD(md), K(kptr), A(args), O(static_cast<size_t>(L * NKV * gap) * 8);
    cuda::ZipGapRows rows;
    rows.k = K.as<const __half* const>();
    rows.cap = cap;
    rows.first = first;
    for (const bool accumulated : {false, true}) {
      poison(O, static_cast<size_t>(L * NKV * gap) * 8);
      cuda::zip_gap_saliency(Q.as<float>(), MD.as<float2>(), rows, D, scale, L, S, NH, NKV, gap, A.as<int32_t>(),
                             A.as<int32_t>() + L, accumulated, O.as<double>(), nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<double> got = O.host<double>(static_cast<size_t>(L * NKV * gap));
      for (int l = 0; l < L; ++l)
        for (int kh = 0; kh < NKV; ++kh) {
          const int nb = before[static_cast<size_t>(l * NKV + kh)], stride = nb + gap, np = n_probes[static_cast<size_t>(l)];
          const std::vector<float>& sc = scores[static_cast<size_t>(l * NKV + kh)];
          const std::vector<double> want = zipcache::gap_saliency(
              sc.data(), G * stride, stride, np, G, nb, seen.data() + l * S, gap,
              accumulated ? zipcache::Saliency::Accumulated : zipcache::Saliency::Normalized);
          double mx = 0.0;
          for (double x : want) mx = std::max(mx, x);
          EXPECT_EQ(mx > 0, np > 0) << "layer " << l;
          for (int j = 0; j < gap; ++j) {
            // The bound: each pair's term, as the host computes it, times its relative error.
            double bound = 0.0;
            int pairs = 0;
            for (int g = 0; g < G; ++g)
              for (int k = 0; k < np; ++k) {
                const int b = l * S + k;
                const float M = md[static_cast<size_t>(b * NH + kh * G + g) * 2];
                if (seen[static_cast<size_t>(b)] <= j || std::isnan(M)) continue;
                const float* x = sc.data() + (k * G + g) * stride;
                const double z = md[static_cast<size_t>(b * NH + kh * G + g) * 2 + 1];
                bound += std::exp(static_cast<double>(x[nb + j]) - M) / z * 1.01 *
                         rel[static_cast<size_t>(l * NKV + kh)][static_cast<size_t>((k * G + g) * gap + j)];
                ++pairs;
              }
            if (!accumulated && pairs > 0) bound /= pairs;
            EXPECT_NEAR(got[static_cast<size_t>((l * NKV + kh) * gap + j)], want[static_cast<size_t>(j)], bound + 1e-15 * mx)
                << "layer " << l << " KV head " << kh << " row " << j << (accumulated ? " accumulated" : " normalized");
          }
        }
    }
  }
}

// The decode kernels over parts whose CST factors (and key ranges) come a group of rows at a time,
// as the gaps' store holds ZipCache's gaps — per KV head fp16 rows, a salient part of G groups of
// 2 rows at 4 bits, a regular one of G groups of 6 at 2 bits, fp16 rows — against the same rows
// as 2·G parts of one group each and an fp64 reference: the mixed kernel gives the same bits
// either way (each row reads its own group's factors), and the mixed and general kernels are
// within a bound derived from fp32 sums (score terms D·2^-23 of Σ|q·k|, D + N rounded additions)
// of the reference; each keeps a probe's softmax states (KeptQueries::md, the row appended before
// the attention) in its slot alone, within the scores' bound of the reference's maximum and
// log-sum-exp. Head sizes 128 and 64, one split and three.
TEST(ZipGapOps, GroupedFactorsReadAsTheGroupsOwnParts) {
  KVLENS_NEED_GPU();
  std::mt19937_64 r(rng()());
  std::uniform_real_distribution<float> u_scale(0.02f, 0.5f), u_zero(-2.0f, 1.0f), u_factor(0.5f, 2.0f);
  auto half_of = [](float x) { return quant::from_half(quant::to_half(x)); };
  const int NKV = 2, NH = 4, G = 3, n_front = 9, n_back = 4;
  const int n[2] = {6, 2}, bits[2] = {2, 4};
  for (const int D : {128, 64})
    for (const int splits : {1, 3}) {
      SCOPED_TRACE("D=" + std::to_string(D) + " splits " + std::to_string(splits));
      const int N = n_front + G * (n[0] + n[1]) + n_back;
      // Per KV head: fp16 front and back rows; per subset codes, key ranges, V ranges, factors.
      struct Sub {
        std::vector<uint8_t> kc, vc;
        std::vector<float> ks, kz, vs, vz, f;
      };
      std::vector<std::array<Sub, 2>> sub(NKV);
      std::vector<std::vector<float>> fk(NKV), fv(NKV);
      for (int h = 0; h < NKV; ++h) {
        fk[h] = rounded(Dt::F16, randn(static_cast<size_t>(n_front + n_back) * D));
        fv[h] = rounded(Dt::F16, randn(static_cast<size_t>(n_front + n_back) * D));
        for (int s = 0; s < 2; ++s) {
          Sub& x = sub[h][s];
          const size_t cb = static_cast<size_t>(G) * n[s] * D * bits[s] / 8;
          x.kc = random_bytes(cb);
          x.vc = random_bytes(cb);
          for (int i = 0; i < G * D; ++i) {
            x.ks.push_back(half_of(u_scale(r)));
            x.kz.push_back(half_of(u_zero(r)));
            x.f.push_back(half_of(u_factor(r)));
          }
          for (int i = 0; i < G * n[s]; ++i) {
            x.vs.push_back(half_of(u_scale(r)));
            x.vz.push_back(half_of(u_zero(r)));
          }
        }
      }
      const std::vector<float> q = randn(static_cast<size_t>(NH) * D);
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      // The fp64 reference and its bound.
      std::vector<double> want(static_cast<size_t>(NH) * D), bound(static_cast<size_t>(NH));
      std::vector<double> want_max(static_cast<size_t>(NH)), want_lse(want_max), score_bound(want_max), lse_bound(want_max);
      const double eps = std::ldexp(1.0, -23);
      for (int qh = 0; qh < NH; ++qh) {
        const int h = qh / (NH / NKV);
        std::vector<std::vector<double>> K, V;
        for (int i = 0; i < n_front; ++i) {
          K.emplace_back(fk[h].begin() + i * D, fk[h].begin() + (i + 1) * D);
          V.emplace_back(fv[h].begin() + i * D, fv[h].begin() + (i + 1) * D);
        }
        for (int s = 1; s >= 0; --s)
          for (int g = 0; g < G; ++g)
            for (int i = 0; i < n[s]; ++i) {
              const Sub& x = sub[h][s];
              const int row = g * n[s] + i;
              std::vector<double> k(D), v(D);
              for (int c = 0; c < D; ++c) {
                const double ck = quant::unpack_one(x.kc.data(), static_cast<int64_t>(row) * D + c, bits[s]);
                const double cv = quant::unpack_one(x.vc.data(), static_cast<int64_t>(row) * D + c, bits[s]);
                k[c] = ck * x.ks[g * D + c] + x.kz[g * D + c];
                v[c] = x.f[g * D + c] * (cv * x.vs[row] + x.vz[row]);
              }
              K.push_back(k);
              V.push_back(v);
            }
        for (int i = n_front; i < n_front + n_back; ++i) {
          K.emplace_back(fk[h].begin() + i * D, fk[h].begin() + (i + 1) * D);
          V.emplace_back(fv[h].begin() + i * D, fv[h].begin() + (i + 1) * D);
        }
        std::vector<double> sc(N);
        double mx = -INFINITY, abs_max = 0.0, vmax = 0.0;
        for (int j = 0; j < N; ++j) {
          double d = 0.0, a = 0.0;
          for (int c = 0; c < D; ++c) {
            d += static_cast<double>(q[qh * D + c]) * K[j][c];
            a += std::abs(static_cast<double>(q[qh * D + c]) * K[j][c]);
            vmax = std::max(vmax, std::abs(V[j][c]));
          }
          sc[j] = d * scale;
          mx = std::max(mx, sc[j]);
          abs_max = std::max(abs_max, a * scale);
        }
        double sum = 0.0;
        for (int j = 0; j < N; ++j) sum += std::exp(sc[j] - mx);
        for (int c = 0; c < D; ++c) {
          double o = 0.0;
          for (int j = 0; j < N; ++j) o += std::exp(sc[j] - mx) / sum * V[j][c];
          want[static_cast<size_t>(qh) * D + c] = o;
        }
        bound[qh] = vmax * (2.0 * (D + 8) * eps * abs_max + 4.0 * (N + D + 16) * eps) + 1e-6;
        want_max[qh] = mx;
        want_lse[qh] = mx + std::log(sum);
        score_bound[qh] = 2.0 * (D + 8) * eps * abs_max;
        lse_bound[qh] = score_bound[qh] + 4.0 * (N + 16) * eps;
      }
      // The device arrays (16-byte aligned offsets: each vector its own allocation).
      std::vector<std::unique_ptr<Dev>> keep;
      auto up = [&](const auto& v) {
        keep.push_back(std::make_unique<Dev>(v));
        return keep.back()->p;
      };
      auto up_half = [&](const std::vector<float>& v) { return static_cast<const __half*>(up(halves(v))); };
      std::vector<cuda::PartDesc> grouped, single;
      for (int h = 0; h < NKV; ++h) {
        cuda::PartDesc front, back;
        front.n = n_front;
        back.n = n_back;
        const auto* k16 = static_cast<const __half*>(up(halves(fk[h])));
        const auto* v16 = static_cast<const __half*>(up(halves(fv[h])));
        front.k.data = k16;
        front.v.data = v16;
        back.k.data = k16 + n_front * D;
        back.v.data = v16 + n_front * D;
        grouped.push_back(front);
        single.push_back(front);
        std::vector<cuda::PartDesc> own;
        for (int s = 1; s >= 0; --s) {
          const Sub& x = sub[h][s];
          cuda::PartDesc p;
          p.n = G * n[s];
          p.k.fmt = cuda::kChannel;
          p.v.fmt = cuda::kToken;
          p.k.bits = p.v.bits = bits[s];
          p.k.group = p.v.group = n[s];
          p.k.data = up(x.kc);
          p.v.data = up(x.vc);
          p.k.scale = up_half(x.ks);
          p.k.zero = up_half(x.kz);
          p.v.scale = up_half(x.vs);
          p.v.zero = up_half(x.vz);
          p.v.factor = up_half(x.f);
          grouped.push_back(p);
          for (int g = 0; g < G; ++g) {  // (group g as a part of its own)
            cuda::PartDesc o = p;
            o.n = n[s];
            o.k.group = o.v.group = 0;
            o.k.data = static_cast<const uint8_t*>(p.k.data) + g * n[s] * D * bits[s] / 8;
            o.v.data = static_cast<const uint8_t*>(p.v.data) + g * n[s] * D * bits[s] / 8;
            o.k.scale += g * D;
            o.k.zero += g * D;
            o.v.factor += g * D;
            o.v.scale += g * n[s];
            o.v.zero += g * n[s];
            single.push_back(o);
          }
        }
        grouped.push_back(back);
        single.push_back(back);
      }
      const int heads = NH;
      // Each run keeps the softmax states of a probe at row 3 (slot 1 of 3; the row appended
      // before the attention: counter 4), the other slots poisoned: those states against the
      // reference's maximum and log-sum-exp (M + log sum).
      auto expect_kept = [&](const std::vector<float>& kept, const std::string& what) {
        for (int i = 0; i < 3 * NH * 2; ++i)
          EXPECT_TRUE(i / (NH * 2) == 1 || std::isnan(kept[static_cast<size_t>(i)])) << what << ": slot " << i / (NH * 2) << " written";
        for (int qh = 0; qh < NH; ++qh) {
          const float M = kept[static_cast<size_t>(NH + qh) * 2], sum = kept[static_cast<size_t>(NH + qh) * 2 + 1];
          EXPECT_NEAR(M, want_max[qh], score_bound[qh]) << what << ", head " << qh << " maximum";
          EXPECT_NEAR(M + std::log(static_cast<double>(sum)), want_lse[qh], lse_bound[qh]) << what << ", head " << qh << " log-sum-exp";
        }
      };
      auto run = [&](const std::vector<cuda::PartDesc>& parts, int per_head, bool mix) {
        Dev slot(std::vector<int32_t>{-1, 0, -1, 1, 2}), counter(std::vector<int32_t>{4});
        Dev md(std::vector<float>(static_cast<size_t>(3 * NH * 2), std::numeric_limits<float>::quiet_NaN()));
        Dev d_parts(parts), d_np(std::vector<int32_t>(NKV, per_head)), d_q(q);
        Dev po(static_cast<size_t>(heads) * splits * D * 4), pm(static_cast<size_t>(heads) * splits * 2 * 4);
        Dev sem(std::vector<int32_t>(heads, 0));
        Dev out(std::vector<float>(static_cast<size_t>(heads) * D, std::numeric_limits<float>::quiet_NaN()));
        cuda::DecodeParams p;
        p.B = 1;
        p.NH = NH;
        p.NKV = NKV;
        p.D = D;
        p.scale = scale;
        p.q = d_q.as<float>();
        p.q_stride = static_cast<int64_t>(NH) * D;
        p.parts = d_parts.as<cuda::PartDesc>();
        p.n_parts = d_np.as<int32_t>();
        p.max_parts = per_head;
        p.splits = splits;
        p.part_o = po.as<float>();
        p.part_md = pm.as<float>();
        p.out = out.p;
        p.odt = Dt::F32;
        p.out_stride = static_cast<int64_t>(NH) * D;
        p.sem = sem.as<int>();
        p.mix_bits = mix ? cuda::kDecodeMixWidths : 0;
        p.keep.slot = slot.as<int32_t>();
        p.keep.rows = 5;
        p.keep.md = md.as<float>();
        p.keep.counter = counter.as<int32_t>();
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        cudaStream_t st = nullptr;
        EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
        cuda::decode_attention(p, st);
        EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
        EXPECT_EQ(cudaStreamDestroy(st), cudaSuccess);
        expect_kept(md.host<float>(static_cast<size_t>(3 * NH * 2)),
                    std::string(mix ? "mixed" : "general") + ", " + std::to_string(per_head) + " parts a head");
        return out.host<float>(static_cast<size_t>(heads) * D);
      };
      const int per_grouped = 4, per_single = 2 + 2 * G;
      const std::vector<float> mix_g = run(grouped, per_grouped, true), mix_s = run(single, per_single, true);
      const std::vector<float> gen_g = run(grouped, per_grouped, false), gen_s = run(single, per_single, false);
      EXPECT_EQ(mix_g, mix_s) << "the mixed kernel over grouped factors against one part a group";
      for (const auto& [got, what] : {std::pair{&mix_g, "mixed, grouped"}, std::pair{&gen_g, "general, grouped"},
                                      std::pair{&gen_s, "general, a part a group"}})
        for (int qh = 0; qh < NH; ++qh)
          for (int c = 0; c < D; ++c) {
            const size_t i = static_cast<size_t>(qh) * D + c;
            ASSERT_NEAR((*got)[i], want[i], bound[qh]) << what << ", head " << qh << " channel " << c;
          }
    }
}

}  // namespace
#endif
