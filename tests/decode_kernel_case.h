// One decode-attention case on the device (kernels/cuda/kernels.h called directly) against an
// fp64 reference, for tests/kernels/test_decode_kernel.cpp: a cache of fp16 parts around a packed
// channel-wise part (or all fp16), its launch flags, and the checks every case makes (outputs
// within bounds derived from the dtypes and reduction lengths, the merge and row-claim counters
// back at zero, a fused token written to the tail). Include only where KVLENS_HAVE_CUDA is
// defined.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/compress/quantize.h"
#include "kernels/cuda/kernels.h"
#include "tests/device_buffer.h"
#include "tests/op_harness.h"

namespace kvlens::testing {

struct KernelCase {
  int B = 3, NH = 6, NKV = 2, D = 128;
  int n_front = 7, n_packed = 1237, n_back = 29;  // fp16, packed (visual), fp16 rows
  int bits = 1;  // 16: the middle part holds fp16 rows too (every part fp16: the fp16 kernel)
  int chan_stride = 1;
  int splits = 0;  // 0: decode_splits
  bool mma_only = false;  // DecodeParams::all_mma: the kernel with only the fp16 and tensor-core paths
  bool fresh = false;     // (bits 16, B 1) the step's token fused in: RoPE, its row attended and appended
  // (bits 16, B 1) the same token rotated and appended by rope_append just before, on the same
  // stream (a kernel that lets the next one in at once): the attention kernel must wait for it
  // before it reads the row counts, or it misses the row.
  bool appended = false;
  bool calibrate = false;
  float tau1 = 0.5f, tau2 = 2.0f;
  // (calibrate) DecodeParams::vis_scores given, poisoned with NaN: the binary path's range pass
  // must write every visual row's score its attention pass reads; false: both read the keys.
  bool keep_scores = true;
  // 1-bit values uploaded channel-major by groups of 32 rows (kChannelT: the binary tensor-core
  // path at head size 128); false: as packed rows (the fp16-operand path).
  bool blocked = true;
  // (mma_only, blocked) DecodeParams::b1_pair: the binary path's kernel of two sub-tiles a warp.
  bool b1_pair = false;
  // (bits 16, D 128, an sm_90 device) DecodeParams::f16_bulk: rows staged by bulk copies.
  bool bulk = false;
  // DecodeParams::claim given: the bulk-copy kernel's blocks take their rows from the head's
  // counter, which the last block must leave at zero. claim_start > 0: the counters start there
  // instead, so the claiming kernel skips that many of each head's chunks and the output must
  // match the reference without them (the kernel with fixed ranges would ignore the counter,
  // read every row and leave the counter set).
  bool claim = false;
  int claim_start = 0;
  // (claim) DecodeParams::bulk_fine: stages of kDecodeBulkFineChunkRows rows.
  bool fine = false;
  // (bits 16) DecodeParams::f16_gqa: a block a KV head's rows for all its query heads.
  bool gqa = false;
};

// A batch-1 case whose parts are all fp16: front, middle and back rows, splits (0: decode_splits).
struct Fp16Shape {
  int NH, NKV, D, front, mid, back, splits;
};
inline KernelCase fp16_case(const Fp16Shape& x) {
  KernelCase c;
  c.bits = 16;
  c.B = 1;
  c.NH = x.NH;
  c.NKV = x.NKV;
  c.D = x.D;
  c.n_front = x.front;
  c.n_packed = x.mid;
  c.n_back = x.back;
  c.splits = x.splits;
  return c;
}

inline std::vector<uint8_t> random_bytes(size_t n) {
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(d(rng()));
  return v;
}

inline std::vector<uint16_t> halves(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = quant::to_half(v[i]);
  return h;
}

inline void kernel_case(const KernelCase& c) {
  const bool blocked = c.blocked && c.bits == 1;
  const std::string what = "B=" + std::to_string(c.B) + " bits=" + std::to_string(c.bits) + " D=" + std::to_string(c.D) +
                           (blocked ? " channel-major values" : "") +
                           " splits=" + std::to_string(c.splits) +
                           (c.calibrate ? (c.keep_scores ? " calibrated (scores kept)" : " calibrated") : "") +
                           (c.chan_stride ? "" : " one range") + (c.mma_only ? " mma-only kernel" : "") +
                           (c.fresh ? " fused token" : "") + (c.appended ? " token appended before" : "") +
                           (c.bulk ? " bulk copies" : "") + (c.claim ? " rows claimed" : "") +
                           (c.fine ? " in fine stages" : "") + (c.gqa ? " GQA kernel" : "") +
                           " heads=" + std::to_string(c.NH) + "/" + std::to_string(c.NKV);
  SCOPED_TRACE(what);
  const int D = c.D, G = c.NH / c.NKV, seqs = c.B * c.NKV;
  const int ranges = c.chan_stride ? D : 1;
  const int64_t row_bytes = static_cast<int64_t>(D) * c.bits / 8;
  // Host data per (sequence, kv head): fp16 rows (rounded), codes, fp16 scale / zero.
  const bool all16 = c.bits == 16;
  // (a fused token's row is written after the back rows: one spare row)
  const bool tok = c.fresh || c.appended;  // the step's token joins the back part (the tail)
  const int nf = c.n_front + c.n_back + (all16 ? c.n_packed : 0) + (tok ? 1 : 0);
  // Back rows counted on the device, as a tail's (with the step's token: all of them, as in a tail).
  const int n_counted = tok ? c.n_back : all16 ? std::min(5, c.n_back) : 0;
  const auto f16 = rounded(Dt::F16, randn(static_cast<size_t>(seqs) * nf * D * 2));
  const auto codes = random_bytes(static_cast<size_t>(seqs) * 2 * c.n_packed * row_bytes);
  std::vector<float> scale(static_cast<size_t>(seqs) * 2 * ranges), zero(scale.size());
  {
    std::uniform_real_distribution<float> s(0.02f, 0.5f), z(-2.0f, 1.0f);
    for (size_t i = 0; i < scale.size(); ++i) scale[i] = quant::from_half(quant::to_half(s(rng())));
    for (size_t i = 0; i < zero.size(); ++i) zero[i] = quant::from_half(quant::to_half(z(rng())));
  }
  const auto q = randn(static_cast<size_t>(c.B) * c.NH * D);
  // rope_append's input row: q, then k, then v (B = 1).
  std::vector<float> qkv_row(q);
  auto code_at = [&](int sq, int kv) { return (static_cast<size_t>(sq) * 2 + kv) * c.n_packed * row_bytes; };
  std::vector<uint8_t> dev_codes = codes;  // as uploaded: values regrouped when blocked
  if (blocked)
    for (int sq = 0; sq < seqs; ++sq) {
      const auto g = quant::channel_major_1bit(codes.data() + code_at(sq, 1), c.n_packed, D);
      std::copy(g.begin(), g.end(), dev_codes.begin() + static_cast<std::ptrdiff_t>(code_at(sq, 1)));
    }
  Dev d_f16(halves(f16)), d_codes(dev_codes), d_scale(halves(scale)), d_zero(halves(zero)), d_q(q);
  Dev d_count(std::vector<int32_t>{n_counted});
  // The fused token: fp32 k and v rows per kv head (before RoPE), its position, RoPE's table.
  const auto fresh_k = randn(static_cast<size_t>(c.NKV) * D), fresh_v = randn(fresh_k.size());
  const int fresh_pos = 777;
  std::vector<float> inv_freq(static_cast<size_t>(D / 2));
  for (int i = 0; i < D / 2; ++i) inv_freq[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / static_cast<float>(D));
  qkv_row.insert(qkv_row.end(), fresh_k.begin(), fresh_k.end());
  qkv_row.insert(qkv_row.end(), fresh_v.begin(), fresh_v.end());
  Dev d_qkv(qkv_row);
  Dev d_fk(fresh_k), d_fv(fresh_v), d_fpos(std::vector<int32_t>{fresh_pos}), d_inv(inv_freq);
  Dev d_tpos(std::vector<int32_t>(static_cast<size_t>(c.NKV) * 2 * nf, -1)), d_done(std::vector<int32_t>{0});
  // Parts: [fp16 front][packed][fp16 back] per (sequence, kv head).
  auto f16_at = [&](int sq, int kv, int row) {  // index of row `row` of the sequence's fp16 rows
    return ((static_cast<size_t>(sq) * 2 + kv) * nf + row) * D;
  };
  auto range_at = [&](int sq, int kv) { return (static_cast<size_t>(sq) * 2 + kv) * ranges; };
  std::vector<cuda::PartDesc> parts(static_cast<size_t>(seqs) * 3);
  for (int sq = 0; sq < seqs; ++sq) {
    cuda::PartDesc* P = &parts[static_cast<size_t>(sq) * 3];
    const __half* base = d_f16.as<__half>();
    P[0].n = c.n_front;
    P[2].n = c.n_back - n_counted;
    if (n_counted || tok) P[2].counter = d_count.as<int32_t>();
    for (int kv = 0; kv < 2; ++kv) {
      (kv ? P[0].v : P[0].k).data = base + f16_at(sq, kv, 0);
      (kv ? P[2].v : P[2].k).data = base + f16_at(sq, kv, c.n_front + (all16 ? c.n_packed : 0));
      if (all16) {
        (kv ? P[1].v : P[1].k).data = base + f16_at(sq, kv, c.n_front);
        continue;
      }
      cuda::KvSide& s = kv ? P[1].v : P[1].k;
      s.fmt = kv && blocked ? cuda::kChannelT : cuda::kChannel;
      s.bits = c.bits;
      s.chan_stride = c.chan_stride;
      s.data = d_codes.as<uint8_t>() + code_at(sq, kv);
      s.scale = d_scale.as<__half>() + range_at(sq, kv);
      s.zero = d_zero.as<__half>() + range_at(sq, kv);
    }
    P[1].n = c.n_packed;
    P[1].visual = all16 ? 0 : 1;
  }
  const int N = c.n_front + c.n_packed + c.n_back;
  const int splits = c.splits            ? c.splits
                     : c.gqa ? cuda::gqa_splits(c.B, c.NKV, N, 132)
                             : cuda::decode_splits(c.B, c.NH, N, 132);
  const int64_t heads = static_cast<int64_t>(c.B) * c.NH;
  Dev d_parts(parts), d_np(std::vector<int32_t>(static_cast<size_t>(seqs), 3));
  Dev po(heads * splits * D * 4), pm(heads * splits * 2 * 4), vr(heads * splits * 2 * 4);
  Dev sem(std::vector<int32_t>(static_cast<size_t>(heads), 0));
  Dev claim(std::vector<int32_t>(static_cast<size_t>(heads), c.claim_start));
  Dev out(std::vector<float>(static_cast<size_t>(heads) * D, std::numeric_limits<float>::quiet_NaN()));
  const int64_t vis_stride = c.calibrate && c.keep_scores ? N + cuda::kDecodeScorePad : 0;
  Dev vs(std::vector<float>(static_cast<size_t>(heads * vis_stride), std::numeric_limits<float>::quiet_NaN()));
  cuda::DecodeParams p;
  p.B = c.B;
  p.NH = c.NH;
  p.NKV = c.NKV;
  p.D = D;
  p.scale = 1.0f / std::sqrt(static_cast<float>(D));
  p.q = c.appended ? d_qkv.as<float>() : d_q.as<float>();
  p.q_stride = static_cast<int64_t>(c.NH) * D;
  p.parts = d_parts.as<cuda::PartDesc>();
  p.n_parts = d_np.as<int32_t>();
  p.max_parts = 3;
  p.splits = splits;
  p.part_o = po.as<float>();
  p.part_md = pm.as<float>();
  p.out = out.p;
  p.odt = Dt::F32;
  p.out_stride = static_cast<int64_t>(c.NH) * D;
  p.sem = sem.as<int>();
  p.lut_bits = c.bits <= 4 ? c.bits : 0;
  p.all_f16 = all16 ? 1 : 0;
  p.all_mma = c.mma_only ? 1 : 0;
  p.b1 = blocked ? 1 : 0;
  p.b1_pair = blocked && c.b1_pair ? 1 : 0;
  p.f16_bulk = c.bulk ? 1 : 0;
  p.bulk_fine = c.bulk && c.fine ? 1 : 0;
  p.f16_gqa = c.gqa ? 1 : 0;
  if (c.claim) p.claim = claim.as<int>();
  const int n_tail0 = c.n_front + c.n_packed;  // the back part's first row, per (sequence, kv head)
  if (c.fresh) {
    // The back part is the tail: rows of kv head h at tail + h·cap·D, cap = 2·nf (the test's K
    // and V rows of one kv head interleave, so K rows step over V's).
    p.fresh_k = d_fk.as<float>();
    p.fresh_v = d_fv.as<float>();
    p.fresh_pos = d_fpos.as<int32_t>();
    p.inv_freq = d_inv.as<float>();
    p.tail_k = d_f16.as<__half>() + f16_at(0, 0, n_tail0);
    p.tail_v = d_f16.as<__half>() + f16_at(0, 1, n_tail0);
    p.tail_cap = 2 * nf;
    p.tail_pos = d_tpos.as<int32_t>();
    p.tail_counter = d_count.as<int32_t>();
    p.tail_done = d_done.as<int32_t>();
  }
  if (c.calibrate) {
    p.calibrate = 1;
    p.tau1 = c.tau1;
    p.tau2 = c.tau2;
    p.vis_range = vr.as<float>();
    p.vis_scores = vis_stride ? vs.as<float>() : nullptr;
    p.vis_stride = vis_stride;
  }
  // A stream of its own (programmatic dependent launch needs one), ordered after the uploads
  // above, which ran on the legacy stream.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  if (c.appended)
    cuda::rope_append(d_qkv.as<float>(), 0, c.NH, static_cast<int64_t>(c.NH) * D, static_cast<int64_t>(c.NH + c.NKV) * D,
                      c.NKV, D, d_fpos.as<int32_t>(), d_inv.as<float>(), d_f16.as<__half>() + f16_at(0, 0, n_tail0),
                      d_f16.as<__half>() + f16_at(0, 1, n_tail0), d_tpos.as<int32_t>(), 2 * nf, d_count.as<int32_t>(),
                      d_done.as<int32_t>(), stream);
  cuda::decode_attention(p, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  std::vector<float> got(static_cast<size_t>(heads) * D);
  ASSERT_EQ(cudaMemcpy(got.data(), out.p, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (Dev* counter : {&sem, &claim}) {
    std::vector<int32_t> left(static_cast<size_t>(heads));
    ASSERT_EQ(cudaMemcpy(left.data(), counter->p, left.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < left.size(); ++i)
      ASSERT_EQ(left[i], 0) << (counter == &sem ? "merge" : "row claim") << " counter of head " << i << " left set";
  }

  // The fused token as the cache stores it: RoPE at fresh_pos (angles as fp32 products, as the
  // kernels and kernels/cpu compute them), K and V rounded to fp16; q rotated the same way.
  std::vector<double> qd(q.begin(), q.end());
  std::vector<float> tok_k(fresh_k.size()), tok_v(fresh_v.size());
  std::vector<double> tok_k_mag(fresh_k.size());  // |x_i| + |x_j| of the pair each K channel rotates
  if (tok) {
    auto rotate = [&](const float* x, double* y) {
      for (int i = 0; i < D / 2; ++i) {
        const double a = std::cos(static_cast<double>(static_cast<float>(fresh_pos) * inv_freq[i]));
        const double b = std::sin(static_cast<double>(static_cast<float>(fresh_pos) * inv_freq[i]));
        y[i] = x[i] * a - x[i + D / 2] * b;
        y[i + D / 2] = x[i + D / 2] * a + x[i] * b;
      }
    };
    std::vector<double> t(static_cast<size_t>(D));
    for (int h = 0; h < c.NH; ++h) rotate(q.data() + static_cast<size_t>(h) * D, qd.data() + static_cast<size_t>(h) * D);
    for (int h = 0; h < c.NKV; ++h) {
      const float* x = fresh_k.data() + static_cast<size_t>(h) * D;
      rotate(x, t.data());
      for (int e = 0; e < D; ++e) {
        const size_t i = static_cast<size_t>(h) * D + e;
        tok_k[i] = quant::from_half(quant::to_half(static_cast<float>(t[e])));
        tok_k_mag[i] = std::abs(x[e % (D / 2)]) + std::abs(x[e % (D / 2) + D / 2]);
        tok_v[i] = quant::from_half(quant::to_half(fresh_v[i]));
      }
    }
  }
  const int NR = N + (tok ? 1 : 0);  // rows attended
  if (tok) {
    // The row written to the tail, at row n_back of each kv head's tail, with its position; the
    // counter advanced by one and the block counter back to zero. The kernel rotates in fp32
    // (sincosf within 2 ulps, two products and a sum each rounded, or fused): its K is within
    // e32 = (|x_i| + |x_j|)·2^-21 of the exact rotation, which cancellation can leave far below
    // the inputs; both sides then round to fp16, one step apart at most (2^-10 of the value,
    // 2^-24 among subnormals). V is only rounded (e32 = 0).
    std::vector<uint16_t> all(static_cast<size_t>(seqs) * nf * D * 2);
    ASSERT_EQ(cudaMemcpy(all.data(), d_f16.p, all.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<int32_t> tpos(static_cast<size_t>(c.NKV) * 2 * nf), cnt(1), done(1);
    ASSERT_EQ(cudaMemcpy(tpos.data(), d_tpos.p, tpos.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(cnt.data(), d_count.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(done.data(), d_done.p, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cnt[0], c.n_back + 1);
    EXPECT_EQ(done[0], 0);
    for (int h = 0; h < c.NKV; ++h) {
      EXPECT_EQ(tpos[static_cast<size_t>(h) * 2 * nf + c.n_back], fresh_pos) << "kv head " << h;
      for (int kv = 0; kv < 2; ++kv)
        for (int e = 0; e < D; ++e) {
          const size_t i = static_cast<size_t>(h) * D + e;
          float& want = (kv ? tok_v : tok_k)[i];
          const float dev = quant::from_half(all[f16_at(h, kv, n_tail0 + c.n_back) + e]);
          const double e32 = kv ? 0.0 : std::ldexp(tok_k_mag[i], -21);
          ASSERT_LE(std::abs(dev - want), e32 + std::ldexp(std::abs(want) + e32, -10) + std::ldexp(1.0, -24))
              << (kv ? "V" : "K") << " of the fused token, kv head " << h << " channel " << e;
          want = dev;  // the attention reference uses the row as stored
        }
    }
  }

  // fp64 reference over the dequantized rows. claim_start > 0: also one without the chunks the
  // claiming kernel skips, the first claim_start past the kDecodeBulkStages · splits taken unclaimed.
  const int chunk_rows = c.fine ? cuda::kDecodeBulkFineChunkRows : cuda::kDecodeBulkChunkRows;
  const int stages = c.fine ? cuda::kDecodeBulkFineStages : cuda::kDecodeBulkStages;
  const int skip_lo = c.claim_start > 0 ? stages * splits * chunk_rows : N;
  const int skip_hi = std::min(N, skip_lo + c.claim_start * chunk_rows);
  std::vector<float> ref(got.size()), ref_skip(got.size());
  std::vector<double> bound(got.size());
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.NH; ++h) {
      const int sq = b * c.NKV + h / G;
      std::vector<double> K(static_cast<size_t>(NR) * D), V(K.size());
      std::vector<bool> vis(NR, false);
      for (int j = 0; j < NR; ++j)
        for (int kv = 0; kv < 2; ++kv) {
          std::vector<double>& X = kv ? V : K;
          for (int e = 0; e < D; ++e) {
            double x;
            if (j == N) {
              x = (kv ? tok_v : tok_k)[static_cast<size_t>(h / G) * D + e];
            } else if (all16) {
              x = f16[f16_at(sq, kv, j) + e];
            } else if (j < c.n_front || j >= c.n_front + c.n_packed) {
              x = f16[f16_at(sq, kv, j < c.n_front ? j : j - c.n_packed) + e];
            } else {
              const int r = j - c.n_front;
              vis[j] = true;
              const uint32_t code = quant::unpack_one(codes.data() + code_at(sq, kv), static_cast<int64_t>(r) * D + e, c.bits);
              const size_t ri = range_at(sq, kv) + (c.chan_stride ? e : 0);
              x = static_cast<double>(code) * scale[ri] + zero[ri];
            }
            X[static_cast<size_t>(j) * D + e] = x;
          }
        }
      const double* qh = qd.data() + (static_cast<size_t>(b) * c.NH + h) * D;
      std::vector<double> s(NR);
      double smag = 0, vmag = 0, lo = INFINITY, hi = -INFINITY;
      for (int j = 0; j < NR; ++j) {
        double dot = 0, m = 0;
        for (int e = 0; e < D; ++e) {
          dot += qh[e] * K[static_cast<size_t>(j) * D + e];
          m += std::abs(qh[e] * K[static_cast<size_t>(j) * D + e]);
        }
        s[j] = dot * p.scale;
        smag = std::max(smag, m * p.scale);
        for (int e = 0; e < D; ++e) vmag = std::max(vmag, std::abs(V[static_cast<size_t>(j) * D + e]));
        if (vis[j]) lo = std::min(lo, s[j]), hi = std::max(hi, s[j]);
      }
      double amp = 1.0;
      if (c.calibrate && hi > lo) {
        const double t = (hi - lo + c.tau1 - c.tau2) / (hi - lo);
        for (int j = 0; j < N; ++j)
          if (vis[j]) s[j] = t * (s[j] - lo) + lo - c.tau1;
        amp = 2 + 2 * std::abs(t) + 2 * std::abs(c.tau2 - c.tau1) / (hi - lo);
      }
      // Score error of fp32 dot products regrouped by post-scaling (×4), as in test_decode_ops;
      // the GQA kernel's tensor cores take q rounded to fp16 (each product within 2^-11 more).
      const double ds = amp * 4 * dot_rel(D) * smag + (c.gqa ? unit(Dt::F16) * smag : 0.0);
      // ... and p rounded to fp16 for P·V (normal: 2^-11 relative; subnormal below 2^-14: 2^-25
      // absolute a row), while the sum of p stays fp32.
      const double dp = c.gqa ? 2 * unit(Dt::F16) + NR * std::ldexp(1.0, -25) : 0.0;
      double mx = -INFINITY, z = 0;
      for (double x : s) mx = std::max(mx, x);
      for (double& x : s) z += (x = std::exp(x - mx));
      double z_skip = z;
      for (int j = skip_lo; j < skip_hi; ++j) z_skip -= s[j];
      for (int e = 0; e < D; ++e) {
        double o = 0, o_skip = 0;
        for (int j = 0; j < NR; ++j) {
          const double sv = s[j] * V[static_cast<size_t>(j) * D + e];
          o += sv;
          if (j < skip_lo || j >= skip_hi) o_skip += sv;
        }
        const size_t i = (static_cast<size_t>(b) * c.NH + h) * D + e;
        ref[i] = static_cast<float>(o / z);
        ref_skip[i] = static_cast<float>(o_skip / z_skip);
        bound[i] = (2.5 * ds + 2 * dot_rel(NR) + dp) * vmag + 4 * unit(Dt::F32) * vmag;
      }
    }
  if (c.claim_start > 0) {
    // The case tells the two apart only where skipping the chunks moves an output past its bound.
    size_t apart = 0;
    for (size_t i = 0; i < got.size(); ++i) apart += std::abs(static_cast<double>(ref_skip[i]) - ref[i]) > bound[i] ? 1 : 0;
    ASSERT_GT(apart, 0u) << what << ": skipping rows " << skip_lo << ".." << skip_hi
                         << " moves no output past its bound; the case cannot tell claimed rows from fixed ranges";
    expect_within(got, ref_skip, bound,
                  "decode attention " + what + " without rows " + std::to_string(skip_lo) + ".." + std::to_string(skip_hi) +
                      " (counters started at " + std::to_string(c.claim_start) + ")");
    return;
  }
  expect_within(got, ref, bound, "decode attention " + what);
}

}  // namespace kvlens::testing
