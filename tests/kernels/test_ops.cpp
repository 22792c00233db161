// The CPU reference ops (kernels/cpu) against plain formulas evaluated in fp64 here, on fresh
// seeded inputs at sizes that are multiples of no tile, outputs poisoned (NaN) first. The CUDA
// twins are tested against these ops, so their numbers must be right. Tolerances are derived
// from fp32 rounding (u = 2^-24) of what each op computes:
//   dot products of length K:  |err| ≤ (K + 2)·u·Σ|x_i·w_i|        (any summation order)
//   one libm call (exp, erf, tanh, sin, cos): ≤ 2 ulp of its value
// and each test states its bound next to the check.
#include <gtest/gtest.h>

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/parallel.h"
#include "core/team.h"
#include "kernels/cpu/ops.h"

using namespace kvlens;

namespace {

constexpr double u = 1.0 / (1 << 24);
const float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> randn(size_t n, uint64_t seed, float scale = 1.0f, float shift = 0.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = g(rng) * scale + shift;
  return v;
}

}  // namespace

// y = x·Wᵀ (+ b). OpenBLAS may block and fuse the sum any way: bound (K + 2)·u·Σ|x w| + u|b|.
// The last size spans 3 × 3 of cpu::linear's 128 × 128 tiles, the last row and column partial.
TEST(CpuOps, LinearAgainstFp64) {
  struct Size { int M, K, N; };
  for (const Size s : {Size{1, 1, 1}, Size{7, 33, 19}, Size{1, 129, 65}, Size{37, 250, 3}, Size{5, 1031, 17},
                       Size{300, 70, 260}})
    for (int with_bias = 0; with_bias < 2; ++with_bias) {
      SCOPED_TRACE(std::to_string(s.M) + "x" + std::to_string(s.K) + "x" + std::to_string(s.N) + (with_bias ? " bias" : ""));
      const auto x = randn(static_cast<size_t>(s.M) * s.K, 1 + s.K), W = randn(static_cast<size_t>(s.N) * s.K, 2 + s.N);
      const auto b = randn(s.N, 3, 4.0f);
      std::vector<float> y(static_cast<size_t>(s.M) * s.N, kNaN);
      cpu::linear(x.data(), s.M, s.K, W.data(), s.N, with_bias ? b.data() : nullptr, y.data());
      for (int m = 0; m < s.M; ++m)
        for (int n = 0; n < s.N; ++n) {
          double ref = with_bias ? b[n] : 0.0, mag = 0;
          for (int k = 0; k < s.K; ++k) {
            const double t = static_cast<double>(x[m * s.K + k]) * W[n * s.K + k];
            ref += t, mag += std::fabs(t);
          }
          const double tol = (s.K + 2) * u * mag + (with_bias ? u * std::fabs(b[n]) : 0.0);
          ASSERT_LE(std::fabs(y[m * s.N + n] - ref), tol) << m << "," << n;
        }
    }
}

// A product spread over threads (tiles of 128 rows by 128 columns on up to product_threads()) is bit for bit
// the product on one thread, whatever the count, and OpenBLAS runs on one thread whatever
// OPENBLAS_NUM_THREADS said (with both libraries threading, OpenMP's spinning workers and
// OpenBLAS's threads fought for the cores). Sizes past one tile and one thread's share, with
// partial last tiles, and a prompt's narrow product (256 columns: two column blocks) on more than
// two threads; within a piece of parallel_for a product takes one thread, and a one-row
// product (a decode step's) at most two.
TEST(CpuOps, LinearIsTheSameOnAnyThreadCount) {
  struct Size { int M, K, N; };
  const int was = product_threads();
  for (const Size s : {Size{197, 192, 576}, Size{1, 8192, 1100}, Size{64, 1333, 130}, Size{620, 768, 256}}) {
    SCOPED_TRACE(std::to_string(s.M) + "x" + std::to_string(s.K) + "x" + std::to_string(s.N));
    const auto x = randn(static_cast<size_t>(s.M) * s.K, 5 + s.K), W = randn(static_cast<size_t>(s.N) * s.K, 6 + s.N);
    const auto b = randn(s.N, 7);
    std::vector<float> one(static_cast<size_t>(s.M) * s.N, kNaN);
    set_product_threads(1);
    cpu::linear(x.data(), s.M, s.K, W.data(), s.N, b.data(), one.data());
    for (int t : {2, 3, 8}) {
      set_product_threads(t);
      if (machine_threads() > 1) {
        EXPECT_GT(cpu::linear_threads(s.M, s.N, s.K), 1) << t << " threads: the product was not spread";
      }
      if (s.M == 1) {
        EXPECT_LE(cpu::linear_threads(s.M, s.N, s.K), 2) << t << " threads: one row takes at most two";
      }
      if (s.M == 620 && machine_cores() >= t) {
        EXPECT_EQ(cpu::linear_threads(s.M, s.N, s.K), t) << "a prompt's 256-wide product takes every thread";
      }
      std::vector<float> y(one.size(), kNaN);
      cpu::linear(x.data(), s.M, s.K, W.data(), s.N, b.data(), y.data());
      EXPECT_EQ(std::memcmp(y.data(), one.data(), y.size() * sizeof(float)), 0) << t << " threads";
    }
    EXPECT_EQ(openblas_get_num_threads(), 1);
  }
  set_product_threads(8);
  std::vector<int> seen(4, 0);
  parallel_for(4, 4, [&](int i) { seen[static_cast<size_t>(i)] = product_threads(); });
  if (machine_threads() > 1) {
    EXPECT_EQ(seen, std::vector<int>(4, 1));
  }
  EXPECT_EQ(product_threads(), std::min(8, machine_threads()));
  // Inside a job of kvlens's team (core/team.h) a product and a loop take one thread: the chunks
  // are the parallelism.
  std::vector<int> in_job(4, 0), loop_in_job(4, 0);
  const ScopedOmpThreads four(4);  // (the calling thread runs chunks too)
  team_each(4, 4, [&](int64_t i) {
    in_job[static_cast<size_t>(i)] = cpu::linear_threads(620, 256, 768);
    loop_in_job[static_cast<size_t>(i)] = cpu::loop_threads(1 << 20, int64_t{1} << 30, 1);
  });
  EXPECT_EQ(in_job, std::vector<int>(4, 1));
  EXPECT_EQ(loop_in_job, std::vector<int>(4, 1));
  set_product_threads(was);
}

// LayerNorm(x)·g + b with the biased variance (torch.nn.LayerNorm). Mean and variance are taken
// in fp64 by the op; what remains is the fp32 product chain (x − μ)·inv·g + b: ≤ 6u on the
// normalised term and u on b, plus u for rounding inv. Inputs with a large mean make a
// one-pass variance (E[x²] − μ²) fail.
TEST(CpuOps, LayerNormAgainstFp64) {
  for (const int D : {1, 3, 63, 257, 1031})
    for (int with_b = 0; with_b < 2; ++with_b) {
      const int M = 5;
      const auto x = randn(static_cast<size_t>(M) * D, 10 + D, 3.0f, 100.0f);
      const auto g = randn(D, 11, 1.0f, 1.0f), b = randn(D, 12);
      std::vector<float> y(x.size(), kNaN);
      const float eps = 1e-5f;
      cpu::layer_norm(x.data(), y.data(), M, D, g.data(), with_b ? b.data() : nullptr, eps);
      for (int m = 0; m < M; ++m) {
        double mu = 0, var = 0;
        for (int i = 0; i < D; ++i) mu += x[m * D + i];
        mu /= D;
        for (int i = 0; i < D; ++i) var += (x[m * D + i] - mu) * (x[m * D + i] - mu);
        var /= D;
        const double inv = 1.0 / std::sqrt(var + eps);
        for (int i = 0; i < D; ++i) {
          const double t = (x[m * D + i] - mu) * inv * g[i];
          const double ref = t + (with_b ? b[i] : 0.0);
          // (x − μ) in fp32 with μ rounded to fp32: error ≤ u·(|x| + |μ|) before scaling.
          const double tol = 7 * u * std::fabs(t) + u * std::fabs(with_b ? b[i] : 0.0) +
                             2 * u * (std::fabs(x[m * D + i]) + std::fabs(mu)) * inv * std::fabs(g[i]);
          ASSERT_LE(std::fabs(y[m * D + i] - ref), tol) << "D=" << D << " m=" << m << " i=" << i;
        }
      }
    }
}

// x / sqrt(mean(x²) + eps) · g (Llama RMSNorm): the sum of squares is fp64; inv rounds once,
// x·inv and g·(…) once each: ≤ 4u relative.
TEST(CpuOps, RmsNormAgainstFp64) {
  for (const int D : {1, 5, 64, 255, 1031}) {
    const int M = 3;
    const auto x = randn(static_cast<size_t>(M) * D, 20 + D, 2.0f), g = randn(D, 21, 0.5f, 1.0f);
    std::vector<float> y(x.size(), kNaN);
    cpu::rms_norm(x.data(), y.data(), M, D, g.data(), 1e-6f);
    for (int m = 0; m < M; ++m) {
      double ss = 0;
      for (int i = 0; i < D; ++i) ss += static_cast<double>(x[m * D + i]) * x[m * D + i];
      const double inv = 1.0 / std::sqrt(ss / D + 1e-6);
      for (int i = 0; i < D; ++i) {
        const double ref = g[i] * (x[m * D + i] * inv);
        ASSERT_LE(std::fabs(y[m * D + i] - ref), 4 * u * std::fabs(ref)) << "D=" << D << " i=" << i;
      }
    }
  }
}

// Activations on values spanning the tails. Each is one libm call (≤ 2 ulp) on an argument
// with a few roundings: with f = v·s(a), the argument's error δa ≤ 5u|a| moves f by
// |v|·|s'(a)|·|a|·5u ≤ 3u|v| (|a|·s'(a) ≤ 0.45 for the erf, tanh and sigmoid forms), the libm
// error moves it by ≤ 2u·|v| (s ≤ 1), the last products by 2u|f|: bound 8u·(|v| + |f|).
TEST(CpuOps, ActivationsAgainstFp64) {
  std::vector<float> v = randn(4099, 30, 4.0f);
  for (float t : {-30.0f, -10.0f, -1e-3f, 0.0f, 1e-3f, 10.0f, 30.0f}) v.push_back(t);
  auto ref = [](Act a, double x) {
    switch (a) {
      case Act::Gelu: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
      case Act::GeluTanh: return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
      case Act::QuickGelu: return x / (1 + std::exp(-1.702 * x));
      case Act::Silu: return x / (1 + std::exp(-x));
      case Act::Relu: return x > 0 ? x : 0.0;
    }
    return 0.0;
  };
  for (Act a : {Act::Gelu, Act::GeluTanh, Act::QuickGelu, Act::Silu, Act::Relu}) {
    std::vector<float> y = v;
    cpu::activate(y.data(), static_cast<int64_t>(y.size()), a);
    for (size_t i = 0; i < v.size(); ++i) {
      const double r = ref(a, v[i]);
      ASSERT_LE(std::fabs(y[i] - r), 8 * u * (std::fabs(v[i]) + std::fabs(r))) << "act " << static_cast<int>(a) << " x=" << v[i];
    }
  }
  // The variants differ where they should (a swapped case would pass the bound above only by
  // accident): at x = 1, erf-GELU 0.841345, tanh-GELU 0.841192, QuickGELU 0.845796, SiLU 0.731059.
  float g[4] = {1, 1, 1, 1};
  cpu::activate(g + 0, 1, Act::Gelu);
  cpu::activate(g + 1, 1, Act::GeluTanh);
  cpu::activate(g + 2, 1, Act::QuickGelu);
  cpu::activate(g + 3, 1, Act::Silu);
  EXPECT_NEAR(g[0], 0.841345, 1e-6);
  EXPECT_NEAR(g[1], 0.841192, 1e-6);
  EXPECT_NEAR(g[2], 0.845796, 1e-6);
  EXPECT_NEAR(g[3], 0.731059, 1e-6);
}

TEST(CpuOps, MulAndAddAreExactElementwise) {
  const int n = 40009;  // above the op's parallel threshold
  const auto a = randn(n, 40), b = randn(n, 41);
  std::vector<float> m = a, s = a;
  cpu::mul(m.data(), b.data(), n);
  cpu::add(s.data(), b.data(), n);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(m[i], a[i] * b[i]);
    ASSERT_EQ(s[i], a[i] + b[i]);
  }
}

// Rotary embedding, "rotate half" layout: for i < D/2, (x_i, x_{i+D/2}) is rotated by the angle
// pos·θ^(−2i/D). As in HF, the inverse frequency and the angle are fp32: the exponent 2i/D is
// rounded (relative u, which θ^e turns into ln θ·e·u ≤ ln θ·u), pow and the reciprocal are
// good to 1 ulp each, the product rounds once: the angle's error δ ≤ (3 + ln θ)·u·|angle|. With
// sin/cos to 1 ulp and two rounded products and a sum, |err| ≤ (|a| + |b|)·(δ + 4u).
TEST(CpuOps, RopeAgainstFp64) {
  for (const int D : {2, 6, 64, 130}) {
    const int T = 7, H = 3;
    const float theta = D == 130 ? 500000.0f : 10000.0f;
    const std::vector<int32_t> pos = {0, 1, 2, 17, 255, 4095, 3001};
    const auto x0 = randn(static_cast<size_t>(T) * H * D, 50 + D);
    std::vector<float> x = x0;
    cpu::rope(x.data(), T, H, D, pos.data(), theta);
    const int half = D / 2;
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < half; ++i) {
          const double ang = pos[t] * std::pow(static_cast<double>(theta), -2.0 * i / D);
          const size_t r = (static_cast<size_t>(t) * H + h) * D;
          const double a = x0[r + i], b = x0[r + i + half];
          const double ra = a * std::cos(ang) - b * std::sin(ang), rb = b * std::cos(ang) + a * std::sin(ang);
          const double tol = (std::fabs(a) + std::fabs(b)) * ((3 + std::log(theta)) * u * ang + 4 * u) + 1e-30;
          ASSERT_LE(std::fabs(x[r + i] - ra), tol) << "D=" << D << " pos=" << pos[t] << " i=" << i;
          ASSERT_LE(std::fabs(x[r + i + half] - rb), tol) << "D=" << D << " pos=" << pos[t] << " i=" << i;
        }
  }
}

TEST(CpuOps, SoftmaxAtIsSoftmaxRowsBitForBit) {
  for (const int n : {1, 2, 31, 1000, 32064}) {
    std::vector<float> x = randn(static_cast<size_t>(n), 90 + n, 4.0f);
    if (n > 3) x[1] = -INFINITY, x[2] = 60.0f;
    std::vector<float> p = x;
    cpu::softmax_rows(p.data(), 1, n);
    for (int j = 0; j < n; j += std::max(1, n / 97)) EXPECT_EQ(cpu::softmax_at(x.data(), n, j), p[j]) << "n=" << n << " j=" << j;
  }
  const std::vector<float> masked(5, -INFINITY);
  EXPECT_EQ(cpu::softmax_at(masked.data(), 5, 2), 0.0f);
}

// softmax of rows with −inf entries (masked: probability 0) and a fully masked row (all 0).
// x_j − max rounds once (u·|x_j − max|), exp ≤ 2 ulp, the fp64 sum and the scale once more:
// |err_j| ≤ p_j·(|x_j − max|·u + 5u), plus one ulp of the smallest subnormal (2^-149) where p_j
// underflows to a subnormal float.
TEST(CpuOps, SoftmaxRowsAgainstFp64) {
  for (const int n : {1, 2, 31, 257, 1000}) {
    const int rows = 4;
    std::vector<float> x = randn(static_cast<size_t>(rows) * n, 60 + n, 5.0f);
    for (int j = 0; j < n; j += 3) x[j] = -INFINITY;                       // row 0: masked entries
    for (int j = 0; j < n; ++j) x[3 * n + j] = -INFINITY;                  // row 3: fully masked
    if (n > 1) x[n] = 80.0f, x[n + 1] = 79.0f;                             // row 1: large logits
    std::vector<float> p = x;
    cpu::softmax_rows(p.data(), rows, n);
    for (int r = 0; r < rows; ++r) {
      double mx = -INFINITY, z = 0;
      for (int j = 0; j < n; ++j) mx = std::max<double>(mx, x[r * n + j]);
      for (int j = 0; j < n; ++j) z += std::isinf(x[r * n + j]) ? 0.0 : std::exp(x[r * n + j] - mx);
      for (int j = 0; j < n; ++j) {
        const float xj = x[r * n + j];
        if (std::isinf(xj) || !std::isfinite(mx)) {
          ASSERT_EQ(p[r * n + j], 0.0f) << "masked entry of row " << r;
          continue;
        }
        const double ref = std::exp(xj - mx) / z;
        ASSERT_LE(std::fabs(p[r * n + j] - ref), ref * (std::fabs(xj - mx) * u + 5 * u) + std::ldexp(1.0, -149))
            << "n=" << n << " row " << r;
      }
    }
  }
}

// One attention head against the formula: S = scale·Q·Kᵀ with keys after the query masked,
// P = softmax(S), O = P·V; strided q/k/v/out rows; scores and probs written when asked; the
// output written (not accumulated) over a poisoned buffer. Bounds: a score's error
// δs ≤ (D + 2)·u·scale·Σ|q k|; a probability then moves by p·(2·max δs + (|s − m| + 5)u); the
// output by Σ_j p_j|v_j|·(2·max δs + (|s_j − m| + Tk + 6)u).
TEST(CpuOps, AttentionHeadAgainstFp64) {
  struct Size { int Tq, Tk, D; bool masked, keep; };
  for (const Size s : {Size{1, 1, 1, false, true}, Size{1, 77, 36, true, false}, Size{5, 23, 13, true, true},
                       Size{9, 9, 64, true, true}, Size{3, 130, 7, false, true}}) {
    SCOPED_TRACE(std::to_string(s.Tq) + "x" + std::to_string(s.Tk) + "x" + std::to_string(s.D));
    const int qs = s.D + 3, kvs = s.D + 5, os = s.D + 2;  // row strides wider than D
    const auto q = randn(static_cast<size_t>(s.Tq) * qs, 70 + s.D, 1.5f), k = randn(static_cast<size_t>(s.Tk) * kvs, 71 + s.D);
    const auto v = randn(static_cast<size_t>(s.Tk) * kvs, 72 + s.D);
    std::vector<int32_t> qpos(s.Tq), kpos(s.Tk);
    for (int i = 0; i < s.Tq; ++i) qpos[i] = s.Tk - s.Tq + i;
    for (int j = 0; j < s.Tk; ++j) kpos[j] = (j * 7) % s.Tk;  // positions not in key order
    std::vector<float> out(static_cast<size_t>(s.Tq) * os, kNaN), S(static_cast<size_t>(s.Tq) * s.Tk, kNaN), P(S.size(), kNaN);
    cpu::AttnHeadArgs a{q.data(), qs, k.data(), v.data(), kvs, out.data(), os, s.Tq, s.Tk, s.D,
                        static_cast<float>(1.0 / std::sqrt(s.D))};
    if (s.masked) a.query_pos = qpos.data(), a.key_pos = kpos.data();
    if (s.keep) a.scores = S.data(), a.probs = P.data();
    cpu::attention_head(a);
    for (int i = 0; i < s.Tq; ++i) {
      std::vector<double> sc(s.Tk), mag(s.Tk);
      double mx = -INFINITY, ds = 0;
      for (int j = 0; j < s.Tk; ++j) {
        if (s.masked && kpos[j] > qpos[i]) {
          sc[j] = -INFINITY;
          continue;
        }
        double d = 0, m = 0;
        for (int c = 0; c < s.D; ++c) {
          d += static_cast<double>(q[i * qs + c]) * k[j * kvs + c];
          m += std::fabs(static_cast<double>(q[i * qs + c]) * k[j * kvs + c]);
        }
        sc[j] = d * a.scale, mag[j] = m * a.scale;
        mx = std::max(mx, sc[j]);
        ds = std::max(ds, (s.D + 2) * u * mag[j]);
      }
      double z = 0;
      for (int j = 0; j < s.Tk; ++j) z += std::isinf(sc[j]) ? 0.0 : std::exp(sc[j] - mx);
      std::vector<double> o(s.D, 0.0), ob(s.D, 0.0);
      for (int j = 0; j < s.Tk; ++j) {
        const double p = std::isinf(sc[j]) ? 0.0 : std::exp(sc[j] - mx) / z;
        if (s.keep) {
          if (std::isinf(sc[j])) {
            ASSERT_TRUE(std::isinf(S[i * s.Tk + j]) && S[i * s.Tk + j] < 0) << "masked score " << j;
            ASSERT_EQ(P[i * s.Tk + j], 0.0f);
          } else {
            ASSERT_LE(std::fabs(S[i * s.Tk + j] - sc[j]), (s.D + 2) * u * mag[j] + u * std::fabs(sc[j]));
            ASSERT_LE(std::fabs(P[i * s.Tk + j] - p), p * (2 * ds + (std::fabs(sc[j] - mx) + 5) * u));
          }
        }
        if (p == 0.0) continue;
        for (int c = 0; c < s.D; ++c) {
          o[c] += p * v[j * kvs + c];
          ob[c] += p * std::fabs(v[j * kvs + c]) * (2 * ds + (std::fabs(sc[j] - mx) + s.Tk + 6) * u);
        }
      }
      for (int c = 0; c < s.D; ++c) ASSERT_LE(std::fabs(out[i * os + c] - o[c]), ob[c] + 1e-30) << "query " << i << " ch " << c;
      for (int c = s.D; c < os; ++c) ASSERT_TRUE(std::isnan(out[i * os + c])) << "wrote past D into the stride gap";
    }
  }
}
