// The shared op harness: every backend op runs on the CPU backend (the reference) and on the
// CUDA backend on the same fresh random inputs, outputs poisoned with NaN first, compared with
// tolerances derived from the dtype and the reduction length. Where no CUDA device is usable
// the GPU side skips, saying why.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/compress/quantize.h"
#include "kernels/backends.h"

namespace kvlens::testing {

struct OpBackends {
  std::shared_ptr<Backend> cpu, gpu;
  std::string why;  // why there is no gpu backend
};

// Kept for the whole process (never destroyed: no GPU teardown after the runtime's own).
inline OpBackends& op_backends() {
  static OpBackends* b = [] {
    auto* r = new OpBackends;
    r->cpu = make_backend({"cpu"});
    r->why = cuda_unavailable_reason();
    if (r->why.empty()) r->gpu = make_backend({"cuda"});
    return r;
  }();
  return *b;
}

#define KVLENS_NEED_GPU()                                                                  \
  if (!::kvlens::testing::op_backends().gpu) GTEST_SKIP() << "CUDA backend not available: " \
                                                          << ::kvlens::testing::op_backends().why
// For cases whose CPU half runs everywhere: after it passed, say that the CUDA half did not run.
#define KVLENS_GPU_HALF_SKIPPED()                                                                     \
  if (!::kvlens::testing::op_backends().gpu)                                                          \
  GTEST_SKIP() << "CPU half checked against fp64; CUDA half not run: " << ::kvlens::testing::op_backends().why

// Fresh inputs every run; the seed is printed so a failure can be replayed.
inline std::mt19937_64& rng() {
  static std::mt19937_64 r = [] {
    const uint64_t seed = std::random_device{}();
    std::printf("[ops] random seed %llu\n", static_cast<unsigned long long>(seed));
    return std::mt19937_64(seed);
  }();
  return r;
}

inline std::vector<float> randn(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng());
  return v;
}

// Unit roundoff of a dtype.
inline double unit(Dt d) {
  switch (d) {
    case Dt::F16: return std::ldexp(1.0, -11);
    case Dt::BF16: return std::ldexp(1.0, -8);
    default: return std::ldexp(1.0, -24);
  }
}

// Absolute rounding error of a value near zero stored in dtype d: half the smallest subnormal
// step (fp16 subnormals are 2^-24 apart; bf16 and fp32 reach far smaller values first).
inline double tiny(Dt d) { return d == Dt::F16 ? std::ldexp(1.0, -25) : 0.0; }

inline float round_to(Dt d, float x) {
  if (d == Dt::F16) return quant::round_half(x);
  if (d == Dt::BF16) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    b += 0x7fffu + ((b >> 16) & 1u);
    b &= 0xffff0000u;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  return x;
}
inline std::vector<float> rounded(Dt d, std::vector<float> v) {
  for (float& x : v) x = round_to(d, x);
  return v;
}

// A buffer of `be` filled with host values.
inline Buffer make(Backend& be, const std::string& name, std::vector<int64_t> shape, Dt dt, const std::vector<float>& v) {
  Buffer b = be.alloc(name, std::move(shape), dt);
  be.upload(v.data(), b);
  return b;
}
inline Buffer make_ids(Backend& be, const std::string& name, const std::vector<int32_t>& v) {
  Buffer b = be.alloc(name, {static_cast<int64_t>(v.size())}, Dt::I32);
  be.upload(v.data(), b);
  return b;
}
// An output buffer poisoned with NaN, so an unwritten element fails the comparison.
inline Buffer poisoned(Backend& be, const std::string& name, std::vector<int64_t> shape, Dt dt) {
  Buffer b = be.alloc(name, std::move(shape), dt);
  std::vector<float> nan(static_cast<size_t>(b.numel()), std::numeric_limits<float>::quiet_NaN());
  be.upload(nan.data(), b);
  return b;
}
inline std::vector<float> read(Backend& be, const Buffer& b) {
  std::vector<float> v(static_cast<size_t>(b.numel()));
  be.download(b, v.data());
  return v;
}

// Every element finite and |got − ref| ≤ bound[i]; reports the worst element.
inline void expect_within(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<double>& bound,
                          const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(static_cast<double>(got[i]) - ref[i]);
    const bool ok = std::isfinite(got[i]) && e <= bound[i];
    if (!ok) ++bad;
    const double r = std::isfinite(got[i]) ? e / std::max(bound[i], 1e-30) : INFINITY;
    if (r > worst_ratio) {
      worst_ratio = r;
      worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements outside the bound; worst at " << worst
                     << ": got " << got[worst] << ", ref " << ref[worst] << ", bound " << bound[worst];
}
// Bound atol + rtol·|ref| for every element.
inline std::vector<double> bound_rel(const std::vector<float>& ref, double atol, double rtol) {
  std::vector<double> b(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) b[i] = atol + rtol * std::abs(ref[i]);
  return b;
}

// Error bound of a length-K dot product accumulated in fp32 (in any order) on inputs that are
// exact in both backends, relative to Σ|a_i·b_i|: 2·γ_K with γ_K = K·u/(1 − K·u), plus the
// output's own rounding.
inline double dot_rel(int64_t K) {
  const double u = std::ldexp(1.0, -24);
  return 2.0 * K * u / (1.0 - K * u);
}

}  // namespace kvlens::testing
