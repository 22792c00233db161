// TurboQuant's codec (core/compress/methods/turboquant.cpp) against direct computations: the
// rotation is orthonormal and the error falls with bits, the prompt's rows are coded as the codec
// codes each row alone whatever the threads, and QJL keys give unbiased inner products.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/compress/method.h"
#include "core/compress/quant_methods.h"
#include "core/compress/quantize.h"
#include "tests/quant_fixture.h"

using namespace kvlens;
using namespace kvlens::testing;

namespace {

TEST(TurboQuant, RotationIsOrthonormalAndErrorFallsWithBits) {
  std::mt19937_64 rng(120);
  for (int d : {64, 80}) {  // 80 pads to 128
    const turboquant::Codec c = turboquant::make_codec(d, 2, false, 9);
    std::vector<float> x(d), y(c.dp), back(d);
    for (float& t : x) t = std::normal_distribution<float>(0, 3)(rng);
    c.rotate(x.data(), y.data());
    const double nx = std::inner_product(x.begin(), x.end(), x.begin(), 0.0);
    EXPECT_NEAR(std::inner_product(y.begin(), y.end(), y.begin(), 0.0), nx, 1e-5 * nx);  // norm kept
    c.unrotate(y.data(), back.data());
    for (int j = 0; j < d; ++j) EXPECT_NEAR(back[j], x[j], 1e-5 * std::sqrt(nx));
  }
  const auto l1 = quant::lloyd_max_normal(1);  // ±E|X| for X ~ N(0, 1)
  ASSERT_EQ(l1.size(), 2u);
  EXPECT_TRUE(std::fabs(l1[1] - std::sqrt(2 / M_PI)) < 1e-6 && std::fabs(l1[0] + l1[1]) < 1e-6) << l1[0] << " " << l1[1];
  double prev = INFINITY;
  for (int bits = 1; bits <= 4; ++bits) {
    Fixture f(0, 64, 0, 64, 130);
    f.prefill(*make_policy("turboquant:bits=" + std::to_string(bits))), expect_accounting(f.store);
    double err = 0, tot = 0;
    const KVSegment& s = f.store.layer(0).segments[0];
    for (int kh = 0; kh < f.KH; ++kh)
      for (int t = 0; t < 64; ++t)
        for (int c = 0; c < f.D; ++c)
          err += std::pow(s.heads[kh].k[t * f.D + c] - f.key(t, kh)[c], 2), tot += std::pow(f.key(t, kh)[c], 2);
    EXPECT_LT(err / tot, prev) << bits;
    EXPECT_EQ(s.bytes.codes, 2LL * f.KH * 64 * ((64 * bits + 7) / 8));  // K and V codes per row
    prev = err / tot;
  }
}

// The prompt's segments, coded together with their KV heads on threads, hold each row as the
// codec codes it alone (codes, norms, dequantized rows: bit for bit); a store that holds the
// layout alone is coded by the device that holds the rows, and without one it is refused.
TEST(TurboQuant, PromptRowsCodedOneByOne) {
  for (const char* spec : {"turboquant:bits=3", "turboquant:bits=2,qjl=on,seed=4"}) {
    SCOPED_TRACE(spec);
    Fixture f(2, 40, 6, 32, 150, 4);
    const bool qjl = std::string(spec).find("qjl") != std::string::npos;
    const int bits = qjl ? 2 : 3;
    const turboquant::Codec kc = turboquant::make_codec(f.D, qjl ? bits - 1 : bits, qjl, qjl ? 4 : 0);
    const turboquant::Codec vc = turboquant::make_codec(f.D, bits, false, qjl ? 4 : 0);
    f.prefill(*make_policy(spec)), expect_accounting(f.store);
    int rows = 0;
    for (const KVSegment& s : f.store.layer(0).segments) {
      const auto* p = dynamic_cast<const quant::QuantPayload*>(s.payload.get());
      ASSERT_NE(p, nullptr);
      for (int kh = 0; kh < f.KH; ++kh) {
        quant::QuantBlock want_k, want_v;
        std::vector<float> xk, xv, xh(f.D);
        for (int i = 0; i < s.heads[kh].n(); ++i, ++rows) {
          const int t = s.heads[kh].pos[i];
          kc.encode_row(f.key(t, kh), want_k, xh.data());
          xk.insert(xk.end(), xh.begin(), xh.end());
          vc.encode_row(f.val(t, kh), want_v, xh.data());
          xv.insert(xv.end(), xh.begin(), xh.end());
        }
        EXPECT_TRUE(p->k[kh].codes == want_k.codes && p->k[kh].scales == want_k.scales) << "head " << kh;
        EXPECT_TRUE(p->v[kh].codes == want_v.codes && p->v[kh].scales == want_v.scales) << "head " << kh;
        EXPECT_EQ(s.heads[kh].k, xk) << "head " << kh;
        EXPECT_EQ(s.heads[kh].v, xv) << "head " << kh;
      }
    }
    EXPECT_EQ(rows, f.T * f.KH);
    Fixture g(2, 40, 6, 32, 150, 4);
    KVStore layout = g.store.without_rows();
    const auto policy = make_policy(spec);
    EXPECT_FALSE(policy->reads_rows());
    EXPECT_THROW(policy->on_prefill({g.ctx()}, layout), InternalError);
  }
}

TEST(TurboQuant, QjlKeysGiveUnbiasedInnerProducts) {
  // E over the random rotation and S (seeds) of q·k̂ equals q·k with the QJL residual; the
  // 1-bit MSE codebook alone shrinks the product (biased).
  std::mt19937_64 rng(140);
  const int d = 32, N = 400;
  std::vector<float> x(d), qv(d), xh(d);
  for (float& t : x) t = std::normal_distribution<float>(0, 1)(rng);
  for (int j = 0; j < d; ++j) qv[j] = x[j] + 0.5f * std::normal_distribution<float>(0, 1)(rng);
  const double exact = std::inner_product(qv.begin(), qv.end(), x.begin(), 0.0);
  for (bool qjl : {true, false}) {
    double mean = 0, sq = 0;
    for (int seed = 0; seed < N; ++seed) {
      const turboquant::Codec c = turboquant::make_codec(d, 1, qjl, seed);
      quant::QuantBlock blk;
      c.encode_row(x.data(), blk, xh.data());
      EXPECT_EQ(blk.codes.size(), static_cast<size_t>(c.row_code_bytes()));
      const double e = std::inner_product(qv.begin(), qv.end(), xh.begin(), 0.0) - exact;
      mean += e / N, sq += e * e / N;
    }
    const double se = std::sqrt(std::max(sq - mean * mean, 0.0) / N);
    if (qjl) EXPECT_LT(std::fabs(mean), 4 * se) << "mean error " << mean;
    else EXPECT_GT(std::fabs(mean), 4 * se) << "mean error " << mean;
  }
}

}  // namespace
