// The prefill attention kernel called directly (kernels/cuda/kernels.h), with each key split
// forced — the backend picks one from the device's SM count, so the op test reaches only one
// of them at small sizes. Sizes reach the tiles' edges: several 64-key tiles and 128-key
// stages, causal diagonal tiles, a stage whose second half is short or empty, T not a
// multiple of 64 or 16 (and below 16), GQA, head sizes 32/64/128, f16 and bf16 output, and
// q/k/v at unusual column offsets of a padded row. Outputs (and 8 rows past them) are poisoned
// first; the rows past the end must stay untouched. Reference and bound: tests/attention_ref.h.
#include <gtest/gtest.h>

#include <cstring>

#include "tests/attention_ref.h"
#include "tests/op_harness.h"

#ifdef KVLENS_HAVE_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "tests/device_buffer.h"
#endif

using namespace kvlens;
using namespace kvlens::testing;

namespace {

#ifdef KVLENS_HAVE_CUDA

float from_bits(Dt dt, uint16_t b) {
  if (dt == Dt::F16) return quant::from_half(b);
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct PrefillCase {
  int T, NH, NKV, D;
  bool causal;
  Dt odt;
  bool shuffled = false;  // k, v, q in that order in a row with padding columns
};

void prefill_case(const PrefillCase& c) {
  const std::string what = "T=" + std::to_string(c.T) + " heads " + std::to_string(c.NH) + "/" +
                           std::to_string(c.NKV) + " D=" + std::to_string(c.D) + (c.causal ? " causal" : "") + " " +
                           dt_name(c.odt) + (c.shuffled ? " shuffled columns" : "");
  SCOPED_TRACE(what);
  AttnLayout l;
  l.T = c.T;
  l.n_heads = c.NH;
  l.n_kv_heads = c.NKV;
  l.head_dim = c.D;
  l.causal = c.causal;
  l.scale = 1.0f / std::sqrt(static_cast<float>(c.D));
  const int64_t qd = static_cast<int64_t>(c.NH) * c.D, kd = static_cast<int64_t>(c.NKV) * c.D;
  if (c.shuffled) {
    l.k_col = 4;
    l.v_col = 4 + kd + 8;
    l.q_col = l.v_col + kd + 12;
    l.row_stride = l.q_col + qd + 4;
  } else {
    l.q_col = 0;
    l.k_col = qd;
    l.v_col = qd + kd;
    l.row_stride = qd + 2 * kd;
  }
  const auto qkv = randn(static_cast<size_t>(c.T) * l.row_stride, 1.5f);
  std::vector<float> ref, naive;
  attention_refs(qkv, l, Dt::F16, ref, naive);
  const auto bound = attention_bound(ref, naive, c.odt);

  for (int key_split : {1, 2}) {
    SCOPED_TRACE("key split " + std::to_string(key_split));
    const int guard_rows = 8;
    const size_t n_out = static_cast<size_t>(c.T) * qd, n_all = n_out + static_cast<size_t>(guard_rows) * qd;
    Dev d_qkv(qkv.size() * 4), d_out(n_all * 2);
    ASSERT_EQ(cudaMemcpy(d_qkv.p, qkv.data(), qkv.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_out.p, 0xff, n_all * 2), cudaSuccess);  // NaN in f16 and bf16
    cuda::attention_prefill(static_cast<const float*>(d_qkv.p), l, d_out.p, c.odt, nullptr, key_split);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> bits(n_all);
    ASSERT_EQ(cudaMemcpy(bits.data(), d_out.p, n_all * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    std::vector<float> got(n_out);
    for (size_t i = 0; i < n_out; ++i) got[i] = from_bits(c.odt, bits[i]);
    expect_within(got, ref, bound, "prefill attention " + what + " key split " + std::to_string(key_split));
    size_t touched = 0;
    for (size_t i = n_out; i < n_all; ++i) touched += bits[i] != 0xffff;
    EXPECT_EQ(touched, 0u) << "values written past row T - 1";
  }
}
#endif

TEST(PrefillKernel, EachKeySplitAtTileEdges) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "built without the CUDA backend";
#else
  KVLENS_NEED_GPU();
  const PrefillCase cases[] = {
      {200, 3, 1, 128, true, Dt::F16},        // 4 query blocks (the last 8 rows), 4 key tiles, GQA 3:1
      {200, 3, 1, 128, false, Dt::BF16},
      {131, 2, 2, 64, true, Dt::BF16},        // second 128-key stage: 3 keys, its second half empty
      {261, 2, 1, 64, false, Dt::F16},        // 4·64 + 5: last stage 5 keys
      {190, 4, 2, 32, true, Dt::F16},         // last stage's second half past the diagonal
      {128, 2, 2, 128, true, Dt::F16},        // whole stages
      {64, 1, 1, 64, false, Dt::BF16},        // one tile exactly
      {17, 2, 2, 64, false, Dt::BF16},        // one row in the second row group
      {9, 2, 1, 32, true, Dt::F16},           // fewer rows than one row group
      {577, 2, 2, 64, false, Dt::F16},        // the vision tower's length
      {97, 4, 2, 64, true, Dt::F16, true},    // q/k/v at shuffled, padded columns
      {70, 2, 2, 128, false, Dt::BF16, true},
  };
  for (const PrefillCase& c : cases) prefill_case(c);
#endif
}

}  // namespace
