// The fused decode-attention kernel called directly (kernels/cuda/kernels.h), where the model's
// path does not reach: several sequences a launch, a chosen number of splits (so that one block's
// warps walk many tiles of a long packed part and the running maximum moves between them), and
// every (sequence, kv head) holding fp16 parts around a packed channel-wise part of 1/2/3/4/8-bit
// random codes (1-bit values both as packed rows and channel-major by groups of 32 rows, the
// binary tensor-core path's layout), with calibration of the visual scores on and off. Reference: fp64 attention over
// the dequantized rows (code·scale + zero) with g(x) applied as calibrate_visual defines it.
// Caches whose parts are all fp16 (the fp16 kernel) are checked the same way, with the last
// part's rows partly counted on the device as a decode tail's are.
// A cache whose last row is appended by the kernel just before (rope_append, which lets the
// attention kernel start at once) is read through its tail counter.
// Each case runs through tests/decode_kernel_case.h, which builds the cache, launches the kernel
// and checks the outputs and counters.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "core/compress/quantize.h"
#include "kernels/cpu/ops.h"
#include "tests/op_harness.h"

#ifdef KVLENS_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "tests/decode_kernel_case.h"
#include "tests/device_buffer.h"

// Skips, saying why, on a device older than sm_90, which `what` needs.
#define KVLENS_NEED_SM90(what)                                                                      \
  do {                                                                                              \
    cudaDeviceProp sm90_prop{};                                                                     \
    ASSERT_EQ(cudaGetDeviceProperties(&sm90_prop, 0), cudaSuccess);                                 \
    if (sm90_prop.major < 9)                                                                        \
      GTEST_SKIP() << what << " needs an sm_90 device; this one is " << sm90_prop.major << "."      \
                   << sm90_prop.minor;                                                              \
  } while (0)
#endif

using namespace kvlens;
using namespace kvlens::testing;

namespace {

TEST(DecodeKernel, TensorCorePartsNeedTheirPathsAlignment) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  // Host arithmetic only: the 1- and 2-bit paths copy rows to shared memory 16 bytes at a time
  // (cp.async), so their codes must start 16-byte aligned; 4 and 8 bits read 4·bits-byte words.
  // A part that is not so aligned takes the general kernel's paths (mma_bits 0), never a copy
  // from a misaligned address.
  alignas(64) static uint8_t codes[256];
  for (int bits : {1, 2, 4, 8})
    for (int off : {0, 4, 8, 16, 32}) {
      cuda::PartDesc d;
      d.n = 100;
      for (cuda::KvSide* x : {&d.k, &d.v}) {
        x->fmt = cuda::kChannel;
        x->bits = bits;
        x->data = codes + (x == &d.k ? 0 : off);
      }
      const int need = bits <= 2 ? 16 : 4 * bits;
      EXPECT_EQ(cuda::mma_bits(d, d.n, false), off % need == 0 ? bits : 0) << bits << " bits, values at +" << off;
      d.v.data = codes;
      d.k.data = codes + off;
      EXPECT_EQ(cuda::mma_bits(d, d.n, false), off % need == 0 ? bits : 0) << bits << " bits, keys at +" << off;
    }
#endif
}

// Rows through Hadamard blocks in place on the device (hadamard_rows: how a deferred decode
// step hands back a query it rotated for rotated keys) against the host reference
// (quant::block_hadamard) on fresh random rows: the same fp32 operations in the same order, so
// equal bit for bit; and the host half checks the reference is its own inverse within fp32
// rounding (each butterfly level and the scale round once, log2(block) + 1 roundings a pass, on
// values that grow to block times the row's largest magnitude before the scale: two passes, bound
// 2·(log2(block) + 1)·block·2⁻²⁴ of that magnitude).
TEST(DecodeKernel, HadamardRowsAgainstTheHostsBlocks) {
  for (const auto& [D, block] : std::vector<std::pair<int, int>>{{128, 16}, {128, 128}, {64, 8}, {256, 2}, {24, 8}}) {
    SCOPED_TRACE("head size " + std::to_string(D) + ", blocks of " + std::to_string(block));
    const int n = 37;
    const std::vector<float> x = randn(static_cast<size_t>(n) * D, 2.0f);
    std::vector<float> ref = x;
    for (int i = 0; i < n; ++i) quant::block_hadamard(ref.data() + static_cast<size_t>(i) * D, D, block);
    std::vector<float> back = ref;
    for (int i = 0; i < n; ++i) quant::block_hadamard(back.data() + static_cast<size_t>(i) * D, D, block);
    float mx = 0;
    for (float v : x) mx = std::max(mx, std::abs(v));
    const double bound = 2.0 * (std::log2(block) + 1) * block * std::ldexp(1.0, -24) * mx;
    for (size_t i = 0; i < x.size(); ++i) EXPECT_LE(std::abs(double(back[i]) - x[i]), bound) << "value " << i;
#ifndef KVLENS_HAVE_CUDA
    GTEST_SKIP() << "host reference checked; built without the CUDA backend, the kernel not run";
#else
    KVLENS_GPU_HALF_SKIPPED();
    Dev X(x);
    cuda::hadamard_rows(X.as<float>(), n, D, block, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> got(x.size());
    ASSERT_EQ(cudaMemcpy(got.data(), X.p, x.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(got, ref);
#endif
  }
}

// A decode step's scores to the host's row order and their softmax (the deferred taps): the
// device kernel (cuda::scores_in_order) against the host reference (cpu::scores_in_order) on
// fresh random scores, GQA 4:1, KV heads holding segment rows in a shuffled order and tail rows,
// one with no segment rows, one holding fewer rows than the stride, and (KIVI's groups) tails
// whose first rows are not read, one not at all. The host half checks the
// reference itself: each head's rows land at the map's places (−inf / 0 elsewhere) and its
// probabilities sum to 1. Raw scores are a scatter: equal bit for bit. A probability is
// e / Σe with e = exp(s − max) in float: the device's expf is within 2 ulp (2·2⁻²³ relative)
// and the host's exp within 1 ulp of the exact value, so each e and the double sum differ by at
// most 3·2⁻²³ relative, the quotient by 6·2⁻²³, and the two final roundings add 2⁻²³: bound
// p · 7·2⁻²³.
void scores_in_order_case(const std::vector<int32_t>& first) {
  SCOPED_TRACE(first.empty() ? "every tail row read" : "tails' first rows not read");
  const int NKV = 3, G = 4, NH = NKV * G, tail = 5;
  const std::vector<int32_t> seg{40, 0, 23};
  const int32_t* tf = first.empty() ? nullptr : first.data();
  auto tail_of = [&](int kv) { return tail - (first.empty() ? 0 : first[static_cast<size_t>(kv)]); };
  const int64_t map_stride = 40, stride = 40 + tail + 3;
  std::vector<int32_t> map(static_cast<size_t>(NKV) * map_stride + NKV, 0);
  for (int h = 0; h < NKV; ++h) {
    std::vector<int32_t> order(static_cast<size_t>(seg[h]));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng());
    std::copy(order.begin(), order.end(), map.begin() + h * map_stride);
    map[static_cast<size_t>(NKV) * map_stride + h] = seg[h];
  }
  const std::vector<float> scores = randn(static_cast<size_t>(NH) * stride, 3.0f);
  std::vector<float> raw(scores.size()), probs(scores.size());
  cpu::scores_in_order(scores.data(), NH, G, stride, map.data() + NKV * map_stride, tail, tf, map.data(), map_stride,
                       raw.data(), probs.data());
  for (int hd = 0; hd < NH; ++hd) {
    const int kv = hd / G, n = seg[kv] + tail_of(kv);
    double sum = 0;
    std::vector<char> hit(static_cast<size_t>(stride), 0);
    for (int i = 0; i < n; ++i) {
      const int r = i < seg[kv] ? map[static_cast<size_t>(kv * map_stride + i)] : i;
      hit[static_cast<size_t>(r)] = 1;
      EXPECT_EQ(raw[static_cast<size_t>(hd * stride + r)], scores[static_cast<size_t>(hd * stride + i)]);
      sum += probs[static_cast<size_t>(hd * stride + r)];
    }
    for (int64_t r = 0; r < stride; ++r)
      if (!hit[static_cast<size_t>(r)]) {
        EXPECT_EQ(raw[static_cast<size_t>(hd * stride + r)], -std::numeric_limits<float>::infinity());
        EXPECT_EQ(probs[static_cast<size_t>(hd * stride + r)], 0.0f);
      }
    EXPECT_NEAR(sum, 1.0, 1e-6) << "head " << hd;
  }
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "host reference checked; built without the CUDA backend, the kernel not run";
#else
  KVLENS_GPU_HALF_SKIPPED();
  Dev S(scores), M(map), R(raw.size() * 4), P(probs.size() * 4), R2(raw.size() * 4),
      F(first.empty() ? std::vector<int32_t>{0} : first);
  const int32_t* ftf = first.empty() ? nullptr : F.as<int32_t>();
  cuda::scores_in_order(S.as<float>(), NH, G, stride, M.as<int32_t>() + NKV * map_stride, tail, ftf, M.as<int32_t>(),
                        map_stride, R.as<float>(), P.as<float>(), nullptr);
  cuda::scores_in_order(S.as<float>(), NH, G, stride, M.as<int32_t>() + NKV * map_stride, tail, ftf, M.as<int32_t>(),
                        map_stride, R2.as<float>(), nullptr, nullptr);  // raw scores alone
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> raw_d(raw.size()), probs_d(probs.size()), raw2_d(raw.size());
  ASSERT_EQ(cudaMemcpy(raw_d.data(), R.p, raw.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(probs_d.data(), P.p, probs.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(raw2_d.data(), R2.p, raw.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(raw_d, raw);
  EXPECT_EQ(raw2_d, raw);
  for (size_t i = 0; i < probs.size(); ++i)
    EXPECT_LE(std::abs(double(probs_d[i]) - probs[i]), probs[i] * 7 * std::ldexp(1.0, -23)) << "entry " << i;
#endif
}

TEST(DecodeKernel, ScoresToTheHostsOrderWithTheirSoftmax) {
  scores_in_order_case({});
  scores_in_order_case({2, 0, 5});
}

TEST(DecodeKernel, SplitCountsFillTheirLastWave) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  // Host arithmetic only (no device needed): 3 blocks resident per multiprocessor. At most one
  // split per 64 rows; unless that cap binds, at least 90 % of a wave of blocks, and at batch 1
  // (32 heads, 64k rows) one wave rather than one and a bit.
  const int sm = 132, resident = 3 * sm;
  for (int B : {1, 2, 16, 64})
    for (int NH : {8, 32, 40})
      for (int rows : {100, 616, 4096, 16384, 65536}) {
        const int s = cuda::decode_splits(B, NH, rows, sm), most = (rows + 63) / 64;
        SCOPED_TRACE("B=" + std::to_string(B) + " NH=" + std::to_string(NH) + " rows=" + std::to_string(rows));
        ASSERT_GE(s, 1);
        EXPECT_LE(s, std::max(1, most));
        if (s < most) {
          EXPECT_GE(static_cast<double>(B) * NH * s, 0.9 * resident - 1e-9) << s << " splits";
        }
      }
  const int s1 = cuda::decode_splits(1, 32, 65536, sm);
  EXPECT_LE(s1 * 32, resident);
  EXPECT_GE(s1 * 32, 0.9 * resident);
  // An all-fp16 cache (512 bytes a row at head size 128): never fewer splits than the wave rule,
  // and no block holds more than kDecodeSplitBytes of rows unless the 64-row cap binds.
  for (int B : {1, 16})
    for (int rows : {100, 616, 4096, 16384, 65536, 1 << 20}) {
      const int w = cuda::decode_splits(B, 32, rows, sm),
                s = cuda::decode_splits(B, 32, rows, sm, cuda::DecodePath::kF16, 128);
      const int most = std::min((rows + 63) / 64, 1024);
      SCOPED_TRACE("B=" + std::to_string(B) + " rows=" + std::to_string(rows));
      EXPECT_GE(s, w);
      EXPECT_LE(s, most);
      if (s < most) {
        EXPECT_LE(static_cast<int64_t>(rows) * 512, cuda::kDecodeSplitBytes * s);
      }
      if (s > w) {
        EXPECT_GT(static_cast<int64_t>(rows) * 512, cuda::kDecodeSplitBytes * (s - 1));
      }
    }
  EXPECT_EQ(cuda::decode_splits(1, 32, 616, sm, cuda::DecodePath::kF16, 128),
            cuda::decode_splits(1, 32, 616, sm));  // a captioning run's context
  // The packed kernels: when every head fits `wave` blocks, the most splits that keep it within
  // them; otherwise at least 90 % of a wave of `full` blocks. The tensor-core-only kernel: one
  // wave of 4 blocks a multiprocessor (one split a head at batch 16 × 32 heads, 16 at batch 1),
  // else the wave rule at 4; for calls of at most kDecodeMmaShortRows rows, half that wave and
  // blocks of at least kDecodeMmaShortBlockRows rows. The binary path: one wave of two blocks a
  // multiprocessor (8 splits at batch 1 × 32 heads), one split up to kDecodeB1OneSplitRows rows
  // and a block a multiprocessor up to kDecodeB1OneBlockRows, else the wave rule at 2 with the
  // first count whose last wave is 85 % full — never more than kGeneral's 90 % takes (1 at batch
  // 16 × 32 heads, where kGeneral takes 3).
  auto check_packed = [&](cuda::DecodePath path, const std::string& name, int wave, int full,
                          std::initializer_list<int> batches) {
    for (int B : batches)
      for (int NH : {8, 32, 40})
        for (int rows : {100, 616, 2048, 2049, 4096, 8192, 8193, 65536}) {
          const int s = cuda::decode_splits(B, NH, rows, sm, path, 128);
          SCOPED_TRACE(name + " B=" + std::to_string(B) + " NH=" + std::to_string(NH) + " rows=" + std::to_string(rows));
          ASSERT_GE(s, 1);
          const int heads = B * NH;
          const bool b1_short = path == cuda::DecodePath::kB1 && rows <= cuda::kDecodeB1OneSplitRows;
          const bool b1_block = path == cuda::DecodePath::kB1 && !b1_short && rows <= cuda::kDecodeB1OneBlockRows;
          const bool mma_short = path == cuda::DecodePath::kMma && heads <= wave &&
                                 static_cast<int64_t>(heads) * rows <= cuda::kDecodeMmaShortRows;
          const int most = mma_short ? rows / cuda::kDecodeMmaShortBlockRows : (rows + 63) / 64;
          const int w = mma_short ? wave / 2 : b1_block ? sm : wave;
          EXPECT_LE(s, std::max(1, most));
          if (heads <= wave && b1_short) {
            EXPECT_EQ(s, 1);
          } else if (heads <= wave) {
            EXPECT_LE(heads * s, std::max(heads, w)) << s << " splits";
            if (s < most) {
              EXPECT_GT(heads * (s + 1), w) << s << " splits";
            }
          } else if (s < most) {
            EXPECT_GE(static_cast<double>(heads) * s, 0.9 * full - 1e-9) << s << " splits";
            if (path == cuda::DecodePath::kB1) {
              EXPECT_LE(s, cuda::decode_splits(B, NH, rows, sm)) << s << " splits";
            }
          }
        }
  };
  check_packed(cuda::DecodePath::kMma, "kMma", 4 * sm, 4 * sm, {1, 2, 3, 16, 17, 64});
  check_packed(cuda::DecodePath::kB1, "kB1", 2 * sm, 2 * sm, {1, 2, 3, 6, 16});
  EXPECT_EQ(cuda::decode_splits(16, 32, 4096, sm, cuda::DecodePath::kMma, 128), 1);
  EXPECT_EQ(cuda::decode_splits(1, 32, 65536, sm, cuda::DecodePath::kMma, 128), 16);
  EXPECT_EQ(cuda::decode_splits(1, 32, 65536, sm, cuda::DecodePath::kB1, 128), 8);
  EXPECT_EQ(cuda::decode_splits(1, 32, 4096, sm, cuda::DecodePath::kB1, 128), 4);
  EXPECT_EQ(cuda::decode_splits(1, 32, 8192, sm, cuda::DecodePath::kB1, 128), 8);
  EXPECT_EQ(cuda::decode_splits(4, 32, 4096, sm, cuda::DecodePath::kB1, 128), 1);
  EXPECT_EQ(cuda::decode_splits(1, 32, 616, sm, cuda::DecodePath::kB1, 128), 1);  // a captioning run's context
  EXPECT_EQ(cuda::decode_splits(1, 32, 616, sm, cuda::DecodePath::kMma, 128), 4);
  EXPECT_EQ(cuda::decode_splits(1, 32, 4096, sm, cuda::DecodePath::kMma, 128), 8);
  EXPECT_EQ(cuda::decode_splits(1, 32, 16384, sm, cuda::DecodePath::kMma, 128), 16);
  EXPECT_EQ(cuda::decode_splits(4, 32, 616, sm, cuda::DecodePath::kMma, 128), 2);
  EXPECT_EQ(cuda::decode_splits(6, 32, 65536, sm, cuda::DecodePath::kB1, 128), 1);
  EXPECT_EQ(cuda::decode_splits(16, 32, 65536, sm, cuda::DecodePath::kB1, 128), 1);
  EXPECT_EQ(cuda::decode_splits(16, 32, 65536, sm), 3);
  // The binary path in pairs: a grid within two blocks a multiprocessor, blocks of 3072 rows or
  // more, or waves of pairs (3/4 of a wave each) fewer than waves of three blocks.
  EXPECT_TRUE(cuda::decode_b1_pair(1, 32, 65536, 8, sm));
  EXPECT_TRUE(cuda::decode_b1_pair(1, 32, 2048, 8, sm));
  EXPECT_TRUE(cuda::decode_b1_pair(16, 32, 4096, 1, sm));
  EXPECT_TRUE(cuda::decode_b1_pair(16, 32, 65536, 1, sm));
  EXPECT_TRUE(cuda::decode_b1_pair(193, 32, 3072, 1, sm));
  EXPECT_TRUE(cuda::decode_b1_pair(193, 32, 3388, 1, sm));  // CalibQuant's Fig. 3 at 30 GB
  EXPECT_TRUE(cuda::decode_b1_pair(16, 32, 16384, 5, sm));  // 3277 rows a block
  EXPECT_FALSE(cuda::decode_b1_pair(193, 32, 3071, 1, sm));  // 24 waves of pairs against 16
  EXPECT_FALSE(cuda::decode_b1_pair(64, 32, 2048, 1, sm));   // 8 against 6
  EXPECT_FALSE(cuda::decode_b1_pair(32, 32, 1024, 1, sm));   // 4 against 3: 3 = 3, a tie
  EXPECT_FALSE(cuda::decode_b1_pair(12, 32, 1024, 1, sm));   // 2 against one wave
  EXPECT_TRUE(cuda::decode_b1_pair(16, 32, 576, 1, sm));     // 2 (1.94) against 2 (1.29)
  EXPECT_FALSE(cuda::decode_b1_pair(16, 32, 16384, 6, sm));  // 2731 rows, 12 waves against 8
  // decode_launch: both choices for a cache's flags, or the given split count.
  for (int B : {1, 16, 193})
    for (int rows : {3368, 4096, 65536})
      for (int bits : {16, 2, 1}) {
        const bool f16 = bits == 16, b1 = bits == 1;
        const auto path = cuda::decode_path(128, f16, true, b1);
        const int s = cuda::decode_splits(B, 32, rows, sm, path, 128);
        const cuda::DecodeLaunch l = cuda::decode_launch(B, 32, rows, sm, 128, f16, true, b1);
        EXPECT_EQ(l.splits, s) << B << " x " << rows << " rows, " << bits << " bits";
        EXPECT_EQ(l.b1_pair, b1 && cuda::decode_b1_pair(B, 32, rows, s, sm)) << B << " x " << rows << " rows";
        const cuda::DecodeLaunch g = cuda::decode_launch(B, 32, rows, sm, 128, f16, true, b1, 5);
        EXPECT_EQ(g.splits, 5);
        EXPECT_EQ(g.b1_pair, b1 && cuda::decode_b1_pair(B, 32, rows, 5, sm));
      }
  EXPECT_TRUE(cuda::decode_launch(16, 32, 4096, sm, 128, false, true, true).b1_pair);
  EXPECT_TRUE(cuda::decode_launch(193, 32, 3388, sm, 128, false, true, true).b1_pair);
  EXPECT_FALSE(cuda::decode_launch(193, 32, 1000, sm, 128, false, true, true).b1_pair);
  EXPECT_FALSE(cuda::decode_launch(1, 32, 65536, sm, 128, false, true, false).b1_pair);
  // The bulk-copy fp16 kernel: head size 128 on sm_90 from kDecodeBulkRows rows a head; one
  // wave of two blocks a multiprocessor at batch 1 (8 splits of 32 heads, at any context), else
  // the wave rule at two, and at most kDecodeBulkSplitBytes of rows a block where that takes
  // kDecodeBulkMinSplits or more.
  EXPECT_TRUE(cuda::decode_f16_bulk(128, cuda::kDecodeBulkRows, true));
  EXPECT_FALSE(cuda::decode_f16_bulk(128, cuda::kDecodeBulkRows - 1, true));
  EXPECT_FALSE(cuda::decode_f16_bulk(128, 65536, false));
  EXPECT_FALSE(cuda::decode_f16_bulk(64, 65536, true));
  for (int B : {1, 16})
    for (int rows : {4096, 16384, 65536, 1 << 20}) {
      const int s = cuda::decode_splits(B, 32, rows, sm, cuda::DecodePath::kF16Bulk, 128);
      SCOPED_TRACE("bulk B=" + std::to_string(B) + " rows=" + std::to_string(rows));
      const int64_t bytes = static_cast<int64_t>(rows) * 512;
      if (B * 32 <= 2 * sm) {
        EXPECT_LE(B * 32 * s, 2 * sm);
        EXPECT_GT(B * 32 * (s + 1), 2 * sm);  // no further split fits the wave
      } else if (bytes >= cuda::kDecodeBulkSplitBytes * cuda::kDecodeBulkMinSplits) {
        EXPECT_TRUE(bytes <= cuda::kDecodeBulkSplitBytes * s || s == cuda::kDecodeMaxSplits) << s << " splits";
      } else {
        EXPECT_EQ(s, cuda::decode_splits(B, 32, rows, sm, cuda::DecodePath::kF16Bulk));  // the wave rule alone
      }
      const cuda::DecodeLaunch l = cuda::decode_launch(B, 32, rows, sm, 128, true, false, false, 0, true);
      EXPECT_TRUE(l.f16_bulk);
      EXPECT_EQ(l.splits, s);
      // Half-size stages where a head's blocks claim rows and average kDecodeBulkFineRows or more.
      EXPECT_EQ(l.bulk_fine, s > 1 && (rows + s - 1) / s >= cuda::kDecodeBulkFineRows) << s << " splits";
      EXPECT_FALSE(cuda::decode_launch(B, 32, rows, sm, 128, true, false, false, 0, false).f16_bulk);
      EXPECT_FALSE(cuda::decode_launch(B, 32, rows, sm, 128, false, true, true, 0, true).f16_bulk);
    }
  EXPECT_EQ(cuda::decode_splits(1, 32, 65536, sm, cuda::DecodePath::kF16Bulk, 128), 8);
  EXPECT_EQ(cuda::decode_splits(1, 32, 4096, sm, cuda::DecodePath::kF16Bulk, 128), 8);
  EXPECT_EQ(cuda::decode_splits(8, 32, 4096, sm, cuda::DecodePath::kF16Bulk, 128), 1);
  EXPECT_EQ(cuda::decode_splits(16, 32, 4096, sm, cuda::DecodePath::kF16Bulk, 128), 1);
  EXPECT_EQ(cuda::decode_splits(16, 32, 8192, sm, cuda::DecodePath::kF16Bulk, 128), 16);
  EXPECT_EQ(cuda::decode_splits(16, 32, 16384, sm, cuda::DecodePath::kF16Bulk, 128), 32);
  EXPECT_EQ(cuda::decode_splits(16, 32, 65536, sm, cuda::DecodePath::kF16Bulk, 128), 128);
  EXPECT_FALSE(cuda::decode_launch(1, 32, 616, sm, 128, true, false, false, 0, true).f16_bulk);  // a captioning run
  EXPECT_TRUE(cuda::decode_launch(1, 32, 65536, sm, 128, true, false, false, 0, true).bulk_fine);
  {
    // set_launch carries a plan into the kernel's parameters, as the model's cache and the
    // benchmarks pass it.
    for (const cuda::DecodeLaunch& l : {cuda::decode_launch(1, 32, 65536, sm, 128, true, false, false, 0, true),
                                        cuda::decode_launch(1, 32, 65536, sm, 128, false, true, true, 0, true)}) {
      cuda::DecodeParams q;
      cuda::set_launch(q, l);
      EXPECT_EQ(q.splits, l.splits);
      EXPECT_EQ(q.b1_pair, l.b1_pair ? 1 : 0);
      EXPECT_EQ(q.f16_bulk, l.f16_bulk ? 1 : 0);
      EXPECT_EQ(q.bulk_fine, l.bulk_fine ? 1 : 0);
    }
  }
  EXPECT_TRUE(cuda::decode_launch(1, 32, 16384, sm, 128, true, false, false, 0, true).bulk_fine);
  EXPECT_FALSE(cuda::decode_launch(1, 32, 4096, sm, 128, true, false, false, 0, true).bulk_fine);
  EXPECT_FALSE(cuda::decode_launch(16, 32, 65536, sm, 128, true, false, false, 0, true).bulk_fine);
  EXPECT_FALSE(cuda::decode_launch(1, 32, 65536, sm, 128, false, true, false, 0, true).bulk_fine);
  // The GQA kernel: all-fp16 caches of head size 32, 64 or 128 with 2 to kDecodeGqaMaxRatio query
  // heads a KV head, where its blocks get kDecodeGqaBlockRows rows or more or, at batch 2 and
  // more, from kDecodeGqaBatchRows rows, ahead of the
  // bulk-copy kernel; splits count a KV head's blocks: the wave
  // rule over B · NKV heads at kDecodeGqaBlocks blocks a multiprocessor, at least
  // kDecodeGqaMinRows rows a block.
  EXPECT_TRUE(cuda::decode_f16_gqa(128, 32, 8));
  EXPECT_TRUE(cuda::decode_f16_gqa(64, 28, 4));
  EXPECT_TRUE(cuda::decode_f16_gqa(32, 8, 1));
  EXPECT_FALSE(cuda::decode_f16_gqa(128, 32, 32));   // no GQA
  EXPECT_FALSE(cuda::decode_f16_gqa(128, 32, 2));    // 16 query heads a KV head
  EXPECT_FALSE(cuda::decode_f16_gqa(256, 32, 8));    // head size
  EXPECT_FALSE(cuda::decode_f16_gqa(80, 32, 8));
  for (int B : {1, 4, 16})
    for (auto [NH, NKV] : {std::pair{32, 8}, std::pair{28, 4}})
      for (int rows : {40, 616, 3032, 16384, 65536}) {
        SCOPED_TRACE("gqa B=" + std::to_string(B) + " NH=" + std::to_string(NH) + "/" + std::to_string(NKV) +
                     " rows=" + std::to_string(rows));
        const cuda::DecodeLaunch l = cuda::decode_launch(B, NH, rows, sm, 128, true, false, false, 0, true, NKV);
        const int gs = cuda::gqa_splits(B, NKV, rows, sm);
        EXPECT_EQ(l.f16_gqa, (rows + gs - 1) / gs >= cuda::kDecodeGqaBlockRows || (B >= 2 && rows >= cuda::kDecodeGqaBatchRows));
        EXPECT_FALSE(cuda::decode_launch(B, NH, rows, sm, 128, true, false, false, 0, false, NKV).f16_gqa)
            << "sm_90 only";
        if (!l.f16_gqa) {  // the other fp16 kernels, each query head its own blocks
          EXPECT_EQ(l.splits, cuda::decode_launch(B, NH, rows, sm, 128, true, false, false, 0, true).splits);
          continue;
        }
        EXPECT_FALSE(l.f16_bulk);
        EXPECT_EQ(l.splits, cuda::gqa_splits(B, NKV, rows, sm));
        const int most = std::max(1, rows / cuda::kDecodeGqaMinRows), slots = cuda::kDecodeGqaBlocks * sm;
        EXPECT_GE(l.splits, 1);
        EXPECT_LE(l.splits, most);
        if (l.splits < most) {
          EXPECT_GE(B * NKV * l.splits, 0.9 * slots - 1e-9) << l.splits << " splits";
        }
        cuda::DecodeParams q;
        cuda::set_launch(q, l);
        EXPECT_EQ(q.f16_gqa, 1);
        EXPECT_FALSE(cuda::decode_launch(B, NH, rows, sm, 128, false, true, false, 0, true, NKV).f16_gqa);  // packed
        EXPECT_FALSE(cuda::decode_launch(B, NH, rows, sm, 128, true, false, false, 0, true).f16_gqa);  // NKV unsaid
      }
  // 8 KV heads (Mistral, Llama-3): 8 × 30 = 240 of 264 blocks. Batch 1 takes the GQA kernel from
  // 16k rows (547 rows a block), not at LLaVA-NeXT's 3032 (101); batch 16 at 3032 (1516). Four KV
  // heads at 16k (Qwen2.5-7B): 60 splits of 273 rows at batch 1, the other kernels.
  EXPECT_EQ(cuda::gqa_splits(1, 8, 16384, sm), 30);
  EXPECT_EQ(cuda::gqa_splits(16, 8, 16384, sm), 2);
  EXPECT_TRUE(cuda::decode_launch(1, 32, 16384, sm, 128, true, false, false, 0, true, 8).f16_gqa);
  EXPECT_FALSE(cuda::decode_launch(1, 32, 3032, sm, 128, true, false, false, 0, true, 8).f16_gqa);
  EXPECT_TRUE(cuda::decode_launch(16, 32, 3032, sm, 128, true, false, false, 0, true, 8).f16_gqa);
  EXPECT_FALSE(cuda::decode_launch(1, 28, 16384, sm, 128, true, false, false, 0, true, 4).f16_gqa);
  EXPECT_TRUE(cuda::decode_launch(16, 28, 16384, sm, 128, true, false, false, 0, true, 4).f16_gqa);
  // Batch 4 from 2048 rows, whose blocks get fewer than 512 (3032 / 8 splits: 379).
  EXPECT_EQ(cuda::gqa_splits(4, 8, 3032, sm), 8);
  EXPECT_TRUE(cuda::decode_launch(4, 32, 3032, sm, 128, true, false, false, 0, true, 8).f16_gqa);
  EXPECT_TRUE(cuda::decode_launch(2, 28, 2048, sm, 128, true, false, false, 0, true, 4).f16_gqa);
  EXPECT_FALSE(cuda::decode_launch(4, 28, 1404, sm, 128, true, false, false, 0, true, 4).f16_gqa);
  // Splits given: the same rule on them.
  EXPECT_TRUE(cuda::decode_launch(1, 28, 16384, sm, 128, true, false, false, 16, true, 4).f16_gqa);
  // The path each kind of cache takes.
  EXPECT_EQ(cuda::decode_path(128, true, true, false), cuda::DecodePath::kF16);
  EXPECT_EQ(cuda::decode_path(128, false, true, false), cuda::DecodePath::kMma);
  EXPECT_EQ(cuda::decode_path(128, false, true, true), cuda::DecodePath::kB1);
  EXPECT_EQ(cuda::decode_path(64, false, true, false), cuda::DecodePath::kGeneral);
  EXPECT_EQ(cuda::decode_path(128, false, false, false), cuda::DecodePath::kGeneral);
#endif
}

TEST(DecodeKernel, PackedPartsBetweenFp16PartsBatchedAndSplit) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  for (int bits : {1, 2, 4, 8, 3})
    for (bool cal : {false, true})
      for (bool mma_only : {false, true}) {
        if (mma_only && bits == 3) continue;  // 3-bit parts are not the tensor-core path's
        KernelCase c;
        c.bits = bits;
        c.calibrate = cal;
        c.mma_only = mma_only;
        c.splits = bits == 1 ? 2 : 0;  // 2: each block ~640 rows, several tiles a warp
        kernel_case(c);
        if (bits == 1 && mma_only) {
          c.b1_pair = true;  // two 128-row sub-tiles a warp
          kernel_case(c);
          c.b1_pair = false;
        }
        if (bits <= 2 && cal) {
          c.keep_scores = false;  // the attention pass reads the keys again
          kernel_case(c);
          c.keep_scores = true;
        }
        if (bits == 1) {
          c.blocked = false;  // 1-bit values as packed rows
          kernel_case(c);
        }
      }
  for (int splits : {37, 97}) {
    KernelCase c;  // 1-bit, splits of ~34 and ~13 rows: blocks start and end inside groups of 32
    c.splits = splits;
    c.calibrate = splits == 37;
    kernel_case(c);
    c.mma_only = true;
    kernel_case(c);
    c.b1_pair = true;
    kernel_case(c);
  }
#endif
}

TEST(DecodeKernel, LongPartFewSplitsOneRangeAndOtherHeadSizes) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  {
    KernelCase c;  // one block per head walks 4099 packed rows (and writes the output itself)
    c.B = 2;
    c.n_packed = 4099;
    c.splits = 1;
    c.calibrate = true;
    kernel_case(c);
    c.mma_only = true;
    kernel_case(c);
    c.b1_pair = true;
    kernel_case(c);
    c.calibrate = false;
    kernel_case(c);
    c.bits = 2;
    kernel_case(c);
    c.calibrate = true;  // (one split: both passes in one kernel, on every path)
    kernel_case(c);
    c.keep_scores = false;
    kernel_case(c);
    c.mma_only = c.b1_pair = false;
    kernel_case(c);
    c.D = 64;
    c.bits = 1;
    kernel_case(c);
  }
  for (int bits : {1, 2}) {
    KernelCase c;  // one scale / zero for every channel
    c.bits = bits;
    c.chan_stride = 0;
    c.splits = 3;
    kernel_case(c);
    c.mma_only = true;
    kernel_case(c);
  }
  for (int D : {64, 256})
    for (int bits : {1, 4}) {
      KernelCase c;  // head sizes 64 and 256: the lookup-table path (at 256 a thread merges two channels)
      c.D = D;
      c.bits = bits;
      c.n_packed = 517;
      kernel_case(c);
    }
#endif
}

TEST(DecodeKernel, Fp16PartsWithATailCounter) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  // Every part fp16 (the fp16 kernel), the last part's rows partly counted on the device.
  for (int splits : {0, 1, 7}) {
    KernelCase c;  // GQA 3:1, three sequences, 1273 rows
    c.bits = 16;
    c.splits = splits;
    kernel_case(c);
  }
  {
    KernelCase c;  // a captioning run's size: ~616 rows, one sequence, no GQA
    c.bits = 16;
    c.B = 1;
    c.NH = c.NKV = 4;
    c.n_front = 3;
    c.n_packed = 600;
    c.n_back = 13;
    kernel_case(c);
  }
  for (int D : {64, 256})
    for (int splits : {5, 37}) {
      KernelCase c;  // head sizes 64 and 256; 37 splits: more than the merge reads at once
      c.bits = 16;
      c.D = D;
      c.n_packed = 517;
      c.splits = splits;
      kernel_case(c);
    }
#endif
}

TEST(DecodeKernel, Fp16PartsWithTheStepsTokenFusedIn) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  // RoPE of q and the token's k, the token's row attended as the last row (its split decided as
  // for any row) and appended to the tail: head sizes 128, 64 and 8, GQA 3:1 and 4:1, one split
  // or several, the token's row alone in its split.
  for (const Fp16Shape& x : {Fp16Shape{6, 2, 128, 7, 600, 9, 0}, Fp16Shape{4, 4, 64, 3, 250, 4, 3},
                             Fp16Shape{8, 2, 8, 2, 40, 1, 1}, Fp16Shape{6, 2, 128, 1, 62, 0, 64}}) {
    KernelCase c = fp16_case(x);
    c.fresh = true;
    kernel_case(c);
  }
#endif
}

TEST(DecodeKernel, Fp16PartsAfterAKernelThatAppendsTheRow) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  // rope_append lets the next kernel start at once, and writes the row and advances the count
  // after that: the fp16 kernel, launched dependent on it without rows_ready, must attend the
  // new row through the tail's counter. (Reading the counter before the wait did not fail here
  // on an H100 either, even with 512 heads: rope_append ends within the attention kernel's
  // launch latency. The test holds the path's result, not that timing.)
  for (int rep = 0; rep < 2; ++rep)
    for (const Fp16Shape& x : {Fp16Shape{512, 512, 128, 3, 40, 2, 1}, Fp16Shape{6, 2, 128, 7, 600, 9, 0},
                               Fp16Shape{32, 32, 128, 5, 611, 0, 0}, Fp16Shape{4, 4, 64, 3, 250, 4, 3}}) {
      KernelCase c = fp16_case(x);
      c.appended = true;
      kernel_case(c);
      if (::testing::Test::HasFailure()) return;
    }
#endif
}

TEST(DecodeKernel, Fp16PartsThroughTheGqaKernel) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  KVLENS_NEED_SM90("the GQA kernel");
  // The blocks a multiprocessor holds are at least those the split rule counts on.
  for (int D : {32, 64, 128}) EXPECT_GE(cuda::decode_gqa_occupancy(D), cuda::kDecodeGqaBlocks) << "D=" << D;
  // decode_f16_gqa_kernel: stages of 64 rows that start and end inside parts (7 + 1237 + 29
  // rows, the last partly counted on the device), three sequences, GQA 3:1, splits that cut
  // stages short (1 to 37 splits); 2:1 at head sizes 32 and 128,
  // 4:1 and 7:1 at 128, 5:1 and 8:1 at 64; the step's token fused in (alone in its split too)
  // and a row appended by the kernel before; 8:1 at 128 over 60 splits, merged in three chunks.
  for (int splits : {0, 1, 7, 37}) {
    KernelCase c;
    c.bits = 16;
    c.splits = splits;
    c.gqa = true;
    kernel_case(c);
  }
  for (const Fp16Shape& x : {Fp16Shape{28, 4, 128, 5, 3000, 27, 0}, Fp16Shape{28, 4, 128, 5, 3000, 27, 1},
                             Fp16Shape{8, 1, 64, 3, 250, 4, 3}, Fp16Shape{4, 2, 32, 2, 40, 1, 0},
                             Fp16Shape{6, 2, 128, 1, 62, 0, 64}, Fp16Shape{32, 8, 128, 3, 3000, 29, 0},
                             Fp16Shape{4, 2, 128, 3, 700, 5, 0}, Fp16Shape{10, 2, 64, 3, 333, 2, 5},
                             Fp16Shape{16, 2, 128, 5, 3000, 27, 60}}) {
    KernelCase c = fp16_case(x);
    c.gqa = true;
    kernel_case(c);
    c.fresh = true;
    kernel_case(c);
    c.fresh = false;
    c.appended = true;
    kernel_case(c);
    if (::testing::Test::HasFailure()) return;
  }
#endif
}

TEST(DecodeKernel, Fp16PartsThroughBulkCopies) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  KVLENS_NEED_SM90("the bulk-copy kernel");
  // decode_f16_bulk_kernel: stages of 64 rows that start and end inside parts (7 + 1237 + 29
  // rows, the last partly counted on the device), splits that cut stages short, GQA, the step's
  // token fused in (alone in its split too) and a row appended by the kernel before.
  // Each with fixed row ranges and with rows claimed from the head's counter (in chunks of a
  // stage: 5000 rows at 8 splits leave 79 chunks, 24 of them taken without a claim; 1273 rows
  // make 20 chunks, fewer than the first stages of 7 or 37 splits ask for, so no block claims
  // and at 37 splits blocks 20 to 36 get none).
  for (bool claim : {false, true}) {
    for (int splits : {0, 1, 7, 37}) {
      KernelCase c;
      c.bits = 16;
      c.splits = splits;
      c.bulk = true;
      c.claim = claim;
      kernel_case(c);
    }
    for (int splits : {8, 3}) {
      KernelCase c = fp16_case(Fp16Shape{32, 32, 128, 5, 4990, 5, splits});  // batch 1, 5000 rows: several stages a block
      c.bulk = true;
      c.claim = claim;
      kernel_case(c);
    }
    for (const Fp16Shape& x : {Fp16Shape{6, 2, 128, 7, 600, 9, 0}, Fp16Shape{6, 2, 128, 1, 62, 0, 64},
                               Fp16Shape{6, 2, 128, 3, 200, 2, 3}, Fp16Shape{4, 2, 128, 3, 3000, 2, 4}}) {
      KernelCase c = fp16_case(x);
      c.bulk = true;
      c.claim = claim;
      c.fresh = true;
      kernel_case(c);
      c.fresh = false;
      c.appended = true;
      kernel_case(c);
    }
  }
  {
    // Counters that start at 10: each head's first ten claimed chunks (640 of 5000 rows) are
    // skipped, so the output must match the reference without them — and the counters end at
    // zero. The kernel with fixed ranges would match the full reference and leave them at 10.
    KernelCase c = fp16_case(Fp16Shape{32, 32, 128, 5, 4990, 5, 8});
    c.bulk = true;
    c.claim = true;
    c.claim_start = 10;
    kernel_case(c);
  }
  {
    // Stages of half the rows (DecodeParams::bulk_fine, with claims): 5000 rows at 2, 3 and 8
    // splits (157 chunks of 32 rows, the first 6 a block taken without a claim), the fused token
    // and a row appended before at 3005 rows, and counters that start at 20 (640 rows skipped).
    for (int splits : {2, 3, 8}) {
      KernelCase c = fp16_case(Fp16Shape{32, 32, 128, 5, 4990, 5, splits});
      c.bulk = c.claim = c.fine = true;
      kernel_case(c);
    }
    KernelCase c = fp16_case(Fp16Shape{4, 2, 128, 3, 3000, 2, 4});
    c.bulk = c.claim = c.fine = true;
    c.fresh = true;
    kernel_case(c);
    c.fresh = false;
    c.appended = true;
    kernel_case(c);
    c = fp16_case(Fp16Shape{32, 32, 128, 5, 4990, 5, 2});
    c.bulk = c.claim = c.fine = true;
    c.claim_start = 20;
    kernel_case(c);
  }
#endif
}

}  // namespace
