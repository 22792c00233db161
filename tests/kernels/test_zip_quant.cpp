// ZipCache's mixed-bit quantization where the rows are (Backend::zip_quantize_rows, the
// zip_quantize kernels) against its host reference (zipcache::quantize_group) on fresh random
// fp16 rows in a device cache: every array of the payload equal byte for byte, and the group
// stored by kv_sync from the arrays made on the device as it is from an upload of the payload.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/compress/quant_methods.h"
#include "core/kv_format.h"
#include "tests/op_harness.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

// A layer of three segments (system, visual, text) of 5, n and 7 rows in every KV head.
LayerKV random_layer(int NKV, int D, int n) {
  LayerKV L;
  int pos = 0;
  const std::pair<SegmentKind, int> kinds[] = {{SegmentKind::System, 5}, {SegmentKind::Visual, n}, {SegmentKind::PostVisionText, 7}};
  for (const auto& [kind, rows] : kinds) {
    KVSegment s;
    s.kind = kind;
    s.storage = "fp16";
    s.heads.resize(static_cast<size_t>(NKV));
    for (int h = 0; h < NKV; ++h) {
      HeadRows& hr = s.heads[static_cast<size_t>(h)];
      for (int i = 0; i < rows; ++i) hr.pos.push_back(pos + i);
      hr.k = rounded(Dt::F16, randn(hr.pos.size() * static_cast<size_t>(D), 3.0f));
      hr.v = rounded(Dt::F16, randn(hr.pos.size() * static_cast<size_t>(D), 0.5f));
      for (size_t i = 0; i < hr.pos.size(); ++i) {
        hr.v[i * D + 1] = 0.0f;  // an all-zero value channel (factor 1)
        if (i == 2) hr.k[i * D + 3] = 65504.0f;
      }
    }
    pos += rows;
    L.segments.push_back(std::move(s));
  }
  return L;
}

void expect_same_payload(const quant::QuantPayload& dev, const quant::QuantPayload& host) {
  ASSERT_EQ(dev.k.size(), host.k.size());
  for (size_t h = 0; h < host.k.size(); ++h) {
    SCOPED_TRACE("KV head " + std::to_string(h));
    EXPECT_EQ(dev.k[h].codes, host.k[h].codes);
    EXPECT_EQ(dev.k[h].scales, host.k[h].scales);
    EXPECT_EQ(dev.k[h].zeros, host.k[h].zeros);
    EXPECT_EQ(dev.k[h].flags, host.k[h].flags);
    EXPECT_EQ(dev.v[h].codes, host.v[h].codes);
    EXPECT_EQ(dev.v[h].meta, host.v[h].meta);
    EXPECT_EQ(dev.v[h].scales, host.v[h].scales);
    EXPECT_EQ(dev.v[h].zeros, host.v[h].zeros);
  }
  EXPECT_EQ(dev.tokens.scales, host.tokens.scales);
  EXPECT_EQ(dev.tokens.zeros, host.tokens.zeros);
}

}  // namespace

// Two layers of three KV heads: layer 0 as a prefill leaves it (every segment mirrors a device
// segment: the rows read where they are), layer 1 after an eviction (each head its own visual
// rows, found by position). Salient flags at random, with a head all salient and one with none
// (empty subsets); bits 4/2, 8/1 and 3/3; ranges per row or shared over the heads, factors per
// subset or per head; head sizes 128, 64 and 40.
TEST(Ops, ZipCacheQuantizeKernels) {
  KVLENS_NEED_GPU();
  Backend& be = *op_backends().gpu;
  std::mt19937_64 r(rng()());
  const int NKV = 3;
  for (const int D : {128, 64, 40}) {
    SCOPED_TRACE("D=" + std::to_string(D));
    KVStore host(2, NKV, D, RowStorage::Fp16);
    host.layer(0) = random_layer(NKV, D, 150 + static_cast<int>(r() % 100));
    host.layer(1) = random_layer(NKV, D, 150 + static_cast<int>(r() % 100));
    std::unique_ptr<DeviceKV> dev = be.kv_create(2, NKV, D);
    {
      KVStore up = host;
      be.kv_sync(*dev, up, -1);
    }
    // Layer 1's layout after an eviction: each head its own subset of the visual rows (some
    // positions held by every head, some not), while the device still holds them all.
    {
      LayerKV& l1 = host.layer(1);
      for (KVSegment& s : l1.segments) {
        if (s.kind != SegmentKind::Visual) continue;
        for (int h = 0; h < NKV; ++h) {
          HeadRows& hr = s.heads[static_cast<size_t>(h)];
          HeadRows kept;
          for (int i = 0; i < hr.n(); ++i) {
            if (i % 3 != 0 && (r() % 3 == 0 || (h == 1 && i % 2 == 1))) continue;
            kept.pos.push_back(hr.pos[static_cast<size_t>(i)]);
            kept.k.insert(kept.k.end(), hr.k.begin() + static_cast<ptrdiff_t>(i) * D, hr.k.begin() + static_cast<ptrdiff_t>(i + 1) * D);
            kept.v.insert(kept.v.end(), hr.v.begin() + static_cast<ptrdiff_t>(i) * D, hr.v.begin() + static_cast<ptrdiff_t>(i + 1) * D);
          }
          hr = std::move(kept);
        }
      }
    }
    for (const auto& [hi, lo] : {std::pair<int, int>{4, 2}, {8, 1}, {3, 3}})
      for (const bool head_ranges : {false, true})
        for (const bool layer_factors : {false, true}) {
          const zipcache::GroupSpec spec{hi, lo, head_ranges, layer_factors};
          SCOPED_TRACE("bits " + std::to_string(hi) + "/" + std::to_string(lo) + (head_ranges ? ", ranges per row" : ", shared ranges") +
                       (layer_factors ? ", factors per head" : ", factors per subset"));
          std::unique_ptr<DeviceKV> made = dev->clone(), uploaded = dev->clone();
          KVStore a = host, b = host;  // device, host
          std::vector<std::shared_ptr<quant::QuantPayload>> pa, pb;
          const std::vector<size_t> group{0, 1, 2};
          be.queue_then_finish([&] {
            std::vector<ZipRowsGroup> both;  // (both layers in one call)
            for (int l = 0; l < 2; ++l) {
              zipcache::Flags flags(3, std::vector<std::vector<char>>(NKV));
              for (size_t s = 0; s < 3; ++s)
                for (int h = 0; h < NKV; ++h)
                  for (int i = 0; i < host.layer(l).segments[s].heads[static_cast<size_t>(h)].n(); ++i)
                    flags[s][static_cast<size_t>(h)].push_back(l == 0 && h == 0 ? 1 : l == 1 && h == 2 ? 0 : r() % 5 < 2);
              pa.push_back(std::make_shared<quant::QuantPayload>(NKV));
              pb.push_back(std::make_shared<quant::QuantPayload>(NKV));
              zipcache::mark_group(a.layer(l), group, flags, spec, *pa.back());
              ZipRowsGroup z;
              z.layer = l;
              for (size_t s : group) z.segs.push_back(&a.layer(l).segments[s]);
              z.out = pa.back().get();
              both.push_back(z);
              zipcache::mark_group(b.layer(l), group, flags, spec, *pb.back());
              zipcache::quantize_group(b.layer(l), group, flags, D, spec, *pb.back());
            }
            ASSERT_TRUE(be.zip_quantize_rows(*made, both));
          });
          for (int l = 0; l < 2; ++l) {
            SCOPED_TRACE("layer " + std::to_string(l));
            // Left on the device, counted as the host's bytes; they land when asked for.
            quant::QuantPayload& p = *pa[static_cast<size_t>(l)];
            EXPECT_TRUE(p.deferred());
            EXPECT_TRUE(p.k[0].codes.empty());
            const int64_t counted = p.allocated().total();
            p.land();
            EXPECT_FALSE(p.deferred());
            EXPECT_EQ(counted, p.allocated().total());
            expect_same_payload(p, *pb[static_cast<size_t>(l)]);
          }
          // Stored from where the arrays were made, and from an upload of a copy of the payload:
          // the same segments and bytes.
          KVStore c = a;
          for (int l = 0; l < 2; ++l) {
            zipcache::install_group(a.layer(l), group, spec, pa[static_cast<size_t>(l)]);
            zipcache::install_group(c.layer(l), group, spec, std::make_shared<quant::QuantPayload>(*pa[static_cast<size_t>(l)]));
          }
          be.kv_sync(*made, a, -1);
          be.kv_sync(*uploaded, c, -1);
          EXPECT_EQ(made->bytes().total(), uploaded->bytes().total());
          EXPECT_GT(made->bytes().codes, 0);
          for (int l = 0; l < 2; ++l) EXPECT_EQ(made->storage(l), uploaded->storage(l)) << "layer " << l;
        }
  }
}
