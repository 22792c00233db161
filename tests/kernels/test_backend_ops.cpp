// One harness, every dense op on every backend (see tests/op_harness.h; the CPU reference ops
// themselves are checked against fp64 formulas in tests/kernels/test_ops.cpp): each case draws fresh
// inputs at sizes that are not multiples of any tile, poisons the outputs, and checks both
// backends against an fp64 reference with a bound derived from the dtype and the reduction
// length — so the CPU backend's passing shows the bound is not vacuous.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>

#include "core/errors.h"
#include "tests/attention_ref.h"
#include "tests/op_harness.h"

#ifdef KVLENS_HAVE_CUDA
#include "kernels/cuda/kernels.h"
#endif

using namespace kvlens;
using namespace kvlens::testing;

namespace {

// One CUDA backend per matrix dtype (a backend keeps all its matrices in one dtype).
std::shared_ptr<Backend> gpu_for(Dt dt) {
  static auto* m = new std::map<Dt, std::shared_ptr<Backend>>;  // kept for the whole process
  if (!op_backends().gpu) return nullptr;
  auto& b = (*m)[dt];
  if (!b) b = make_backend({"cuda"});
  return b;
}

// Checkpoint bytes of `v` (already representable) in dtype dt.
struct Raw {
  std::vector<uint16_t> h;
  std::vector<float> f;
  HostTensor t;
};
Raw raw(const std::string& name, Dt dt, std::vector<int64_t> shape, const std::vector<float>& v) {
  Raw r;
  r.t.name = name;
  r.t.dt = dt;
  r.t.shape = std::move(shape);
  if (dt == Dt::F32) {
    r.f = v;
    r.t.data = r.f.data();
  } else {
    for (float x : v) {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      r.h.push_back(dt == Dt::F16 ? quant::to_half(x) : static_cast<uint16_t>(b >> 16));
    }
    r.t.data = r.h.data();
  }
  return r;
}

struct Backends2 {
  Backend* be[2] = {nullptr, nullptr};
  const char* name[2] = {"cpu", "cuda"};
};
Backends2 both(Dt mdt) {
  Backends2 b;
  b.be[0] = op_backends().cpu.get();
  b.be[1] = gpu_for(mdt).get();
  return b;
}

void linear_case(Dt dt, int M, int K, int N, bool bias, bool acc) {
  const auto x = rounded(dt, randn(static_cast<size_t>(M) * K));
  const auto w = rounded(dt, randn(static_cast<size_t>(N) * K, 1.0f / std::sqrt(static_cast<float>(K))));
  const auto b = randn(N), y0 = randn(static_cast<size_t>(M) * N);
  std::vector<float> ref(y0.size());
  std::vector<double> bound(y0.size());
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = 0, mag = 0;
      for (int k = 0; k < K; ++k) {
        const double t = static_cast<double>(x[static_cast<size_t>(m) * K + k]) * w[static_cast<size_t>(n) * K + k];
        s += t;
        mag += std::abs(t);
      }
      double extra = 0;
      if (bias) s += b[n], extra += std::abs(b[n]);
      if (acc) s += y0[static_cast<size_t>(m) * N + n], extra += std::abs(y0[static_cast<size_t>(m) * N + n]);
      ref[static_cast<size_t>(m) * N + n] = static_cast<float>(s);
      bound[static_cast<size_t>(m) * N + n] = dot_rel(K + 2) * (mag + extra) + 2 * unit(Dt::F32) * std::abs(s);
    }
  const Backends2 B = both(dt);
  for (int i = 0; i < 2; ++i) {
    Backend* be = B.be[i];
    if (!be) continue;  // no CUDA backend here
    const Dt mdt = i == 0 ? Dt::F32 : dt;
    const Raw rw = raw("w", dt, {N, K}, w);
    Buffer W = be->matrix("w", {rw.t});
    ASSERT_EQ(W.dt, mdt);
    Buffer X = make(*be, "x", {M, K}, mdt, x);
    Buffer bb = make(*be, "b", {N}, Dt::F32, b);
    Buffer Y = acc ? make(*be, "y", {M, N}, Dt::F32, y0) : poisoned(*be, "y", {M, N}, Dt::F32);
    be->linear(X, W, bias ? &bb : nullptr, Y, acc);
    expect_within(read(*be, Y), ref, bound,
                  std::string(B.name[i]) + " linear " + dt_name(dt) + " " + std::to_string(M) + "x" + std::to_string(K) +
                      "x" + std::to_string(N));
  }
}

TEST(Ops, Linear) {
  // The gemv path: one row a warp up to K = 8192, two above (an odd N leaves the last warp one
  // row past the end); K/8 chunk counts that fill no stage of 8 (or 4) chunks a lane; K up to
  // kGemvMaxK, x past the 48 KiB a block has without asking.
  linear_case(Dt::F16, 1, 264, 333, true, false);
  linear_case(Dt::F16, 1, 1032, 4101, false, true);  // accumulate (the residual)
  linear_case(Dt::BF16, 1, 520, 77, true, true);
  linear_case(Dt::BF16, 1, 136, 6007, true, false);
  linear_case(Dt::F16, 1, 8200, 333, true, true);    // two rows a warp
  linear_case(Dt::BF16, 1, 8264, 77, false, false);
  linear_case(Dt::F16, 1, 18944, 61, true, true);    // x in 37 KiB of shared memory (Qwen2's MLP width)
  linear_case(Dt::BF16, 1, 32768, 29, false, false); // the most the gemv path stages: 64 KiB
  linear_case(Dt::F16, 37, 200, 129, true, false);   // cuBLAS
  linear_case(Dt::BF16, 45, 96, 250, false, true);
  linear_case(Dt::F32, 3, 77, 61, true, true);       // fp32 checkpoint: cuBLAS fp32
  linear_case(Dt::F16, 1, 27, 19, false, false);     // K not a multiple of 8: cuBLAS
  KVLENS_GPU_HALF_SKIPPED();
}

// The decode step's fused norm + projection against fp64 on the same inputs: x = g·h/rms(h)
// rounded to the matrix dtype (as rms_norm stores it), then x·Wᵀ + bias.
void norm_linear_case(Dt dt, int K, int N) {
  const auto h = randn(K, 2.0f), g = randn(K), b = randn(N);
  const auto w = rounded(dt, randn(static_cast<size_t>(N) * K, 1.0f / std::sqrt(static_cast<float>(K))));
  double ss = 0;
  for (float v : h) ss += static_cast<double>(v) * v;
  const double inv = 1.0 / std::sqrt(ss / K + 1e-5);
  const Backends2 B = both(dt);
  for (int i = 0; i < 2; ++i) {
    Backend* be = B.be[i];
    if (!be) continue;
    const Dt xdt = i == 0 ? Dt::F32 : dt;  // the CPU keeps x in fp32
    std::vector<float> ref(N);
    std::vector<double> bound(N);
    for (int n = 0; n < N; ++n) {
      double s = b[n], mag = std::abs(b[n]);
      for (int k = 0; k < K; ++k) {
        const double x = round_to(xdt, static_cast<float>(g[k] * (h[k] * inv)));
        s += x * w[static_cast<size_t>(n) * K + k];
        mag += std::abs(x * w[static_cast<size_t>(n) * K + k]);
      }
      ref[n] = static_cast<float>(s);
      // fp32 accumulation, the fp32 norm and one rounding step of x either way
      bound[n] = (dot_rel(K + 1) + 2 * dot_rel(K) + 2 * unit(xdt)) * mag;
    }
    const Raw rw = raw("w", dt, {N, K}, w);
    Buffer W = be->matrix("w", {rw.t});
    Buffer H = make(*be, "h", {1, K}, Dt::F32, h), G = make(*be, "g", {K}, Dt::F32, g), Bv = make(*be, "b", {N}, Dt::F32, b);
    Buffer X = be->alloc("x", {1, K}, W.dt);
    Buffer Y = poisoned(*be, "y", {1, N}, Dt::F32);
    be->norm_linear(H, G, 1e-5f, X, W, &Bv, Y);
    expect_within(read(*be, Y), ref, bound, std::string(B.name[i]) + " norm_linear " + dt_name(dt));
  }
}

// norm_linear with a check of h: a planted NaN / Inf is reported under the check's name, with
// the first bad index and its value, as check_finite reports it (the CPU at once, a device at
// finish_checks); a finite h passes.
void norm_linear_check_case(Dt dt, int K, int N, int bad, float value) {
  const auto g = randn(K), w = rounded(dt, randn(static_cast<size_t>(N) * K, 0.05f));
  auto h = randn(K, 2.0f);
  if (bad >= 0) {
    h[bad] = value;
    if (bad + 7 < K) h[bad + 7] = std::numeric_limits<float>::quiet_NaN();  // a later one is not named
  }
  const Backends2 B = both(dt);
  for (int i = 0; i < 2; ++i) {
    Backend* be = B.be[i];
    if (!be) continue;
    SCOPED_TRACE(std::string(B.name[i]) + " K=" + std::to_string(K) + " bad=" + std::to_string(bad));
    const Raw rw = raw("w", dt, {N, K}, w);
    Buffer W = be->matrix("w", {rw.t});
    Buffer H = make(*be, "h", {1, K}, Dt::F32, h), G = make(*be, "g", {K}, Dt::F32, g);
    Buffer X = be->alloc("x", {1, K}, W.dt);
    Buffer Y = poisoned(*be, "y", {1, N}, Dt::F32);
    const std::string name = "layer 7 output";
    std::string msg;
    try {
      be->norm_linear(H, G, 1e-5f, X, W, nullptr, Y, &name);
      be->finish_checks();
    } catch (const NonFiniteError& e) {
      msg = e.what();
    }
    if (bad < 0) {
      EXPECT_EQ(msg, "");
      continue;
    }
    EXPECT_NE(msg.find(name + " is not finite"), std::string::npos) << msg;
    EXPECT_NE(msg.find("at index " + std::to_string(bad) + ")"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf"), std::string::npos) << msg;
  }
}

TEST(Ops, NormLinearChecksItsInput) {
  norm_linear_check_case(Dt::F16, 4104, 301, 2051, std::numeric_limits<float>::infinity());  // the 8-wide loop
  norm_linear_check_case(Dt::BF16, 1000, 77, 999, -std::numeric_limits<float>::infinity());   // the tail loop
  norm_linear_check_case(Dt::F16, 264, 33, 5, std::numeric_limits<float>::quiet_NaN());
  norm_linear_check_case(Dt::F16, 264, 33, -1, 0.0f);
  KVLENS_GPU_HALF_SKIPPED();
}

TEST(Ops, NormLinear) {
  norm_linear_case(Dt::F16, 1032, 4103);
  norm_linear_case(Dt::BF16, 264, 77);
  norm_linear_case(Dt::F16, 520, 9001);
  norm_linear_case(Dt::BF16, 4104, 2049);
  norm_linear_case(Dt::F16, 8200, 301);  // two rows a warp
  KVLENS_GPU_HALF_SKIPPED();
}

double act_ref(Act act, double v) {
  switch (act) {
    case Act::Gelu: return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
    case Act::GeluTanh: return 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
    case Act::QuickGelu: return v / (1 + std::exp(-1.702 * v));
    case Act::Silu: return v / (1 + std::exp(-v));
    case Act::Relu: return v > 0 ? v : 0;
  }
  return v;
}

// The MLP's gate and up products with the gate applied (norm_gate_up): out = act(gate)·up
// rounded to the matrix dtype, with [gate | up] = (g·h/rms(h) in the matrix dtype)·Wᵀ, against
// fp64 on the same inputs. M = 1 is a device's paired one-token product, M > 1 the two-op
// default. A planted Inf in h is reported under the check's name, with its index and value.
void norm_gate_up_case(Dt dt, Act act, int M, int K, int I) {
  const auto h = randn(static_cast<size_t>(M) * K, 2.0f), g = randn(K);
  const auto w = rounded(dt, randn(static_cast<size_t>(2) * I * K, 1.0f / std::sqrt(static_cast<float>(K))));
  const Backends2 B = both(dt);
  for (int i = 0; i < 2; ++i) {
    Backend* be = B.be[i];
    if (!be) continue;
    const std::string what = std::string(B.name[i]) + " norm_gate_up " + dt_name(dt) + " M=" + std::to_string(M) +
                             " K=" + std::to_string(K) + " I=" + std::to_string(I);
    const Raw rw = raw("w", dt, {2 * I, K}, w);
    Buffer W = be->matrix("w", {rw.t});
    const Dt xdt = W.dt;  // the CPU keeps its matrices, and so x and out, in fp32
    std::vector<float> ref(static_cast<size_t>(M) * I);
    std::vector<double> bound(ref.size());
    for (int m = 0; m < M; ++m) {
      const float* hm = h.data() + static_cast<size_t>(m) * K;
      double ss = 0;
      for (int k = 0; k < K; ++k) ss += static_cast<double>(hm[k]) * hm[k];
      const double inv = 1.0 / std::sqrt(ss / K + 1e-5);
      std::vector<double> x(K);
      for (int k = 0; k < K; ++k) x[k] = round_to(xdt, static_cast<float>(g[k] * (hm[k] * inv)));
      for (int n = 0; n < I; ++n) {
        double gs = 0, us = 0, gm = 0, um = 0;
        for (int k = 0; k < K; ++k) {
          const double a = x[k] * w[static_cast<size_t>(n) * K + k], b = x[k] * w[static_cast<size_t>(I + n) * K + k];
          gs += a, us += b, gm += std::abs(a), um += std::abs(b);
        }
        const double rel = dot_rel(K + 1) + 2 * dot_rel(K) + 2 * unit(xdt);  // as norm_linear_case
        const double eg = rel * gm, eu = rel * um, a = act_ref(act, gs), o = a * us;
        const size_t at = static_cast<size_t>(m) * I + n;
        ref[at] = static_cast<float>(o);
        // |act'| ≤ 1.2 for the activations tested; fp32 evaluation of act (as gated_act evaluates it);
        // one rounding of out
        bound[at] = 1.2 * eg * (std::abs(us) + eu) + (std::abs(a) + 1.2 * eg) * eu +
                    16 * unit(Dt::F32) * (std::abs(gs) + 1) * (std::abs(a) + 1) * std::abs(us) +
                    unit(xdt) * std::abs(o) + tiny(xdt);
      }
    }
    Buffer H = make(*be, "h", {M, K}, Dt::F32, h), G = make(*be, "g", {K}, Dt::F32, g);
    Buffer X = be->alloc("x", {M, K}, W.dt), GU = poisoned(*be, "gu", {M, 2 * I}, Dt::F32);
    Buffer O = poisoned(*be, "out", {M, I}, W.dt);
    be->norm_gate_up(H, G, 1e-5f, X, W, act, GU, O);
    expect_within(read(*be, O), ref, bound, what);
    // The check of h rides along.
    auto bad = h;
    bad[static_cast<size_t>(K / 3)] = std::numeric_limits<float>::infinity();
    bad[static_cast<size_t>(K / 3 + 5)] = std::numeric_limits<float>::quiet_NaN();  // a later one is not named
    Buffer HB = make(*be, "h bad", {M, K}, Dt::F32, bad);
    const std::string name = "layer 3 output";
    std::string msg;
    try {
      be->norm_gate_up(HB, G, 1e-5f, X, W, act, GU, O, &name);
      be->finish_checks();
    } catch (const NonFiniteError& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(name + " is not finite"), std::string::npos) << what << ": " << msg;
    EXPECT_NE(msg.find("at index " + std::to_string(K / 3) + ")"), std::string::npos) << what << ": " << msg;
    EXPECT_NE(msg.find("(value inf at"), std::string::npos) << what << ": " << msg;
  }
}

TEST(Ops, NormGateUp) {
  norm_gate_up_case(Dt::F16, Act::Silu, 1, 264, 1003);   // K/8 = 33 chunks; I not a multiple of 8 warps
  norm_gate_up_case(Dt::BF16, Act::Silu, 1, 4104, 1003);  // the 8-wide loop of the norm, 3 stages
  norm_gate_up_case(Dt::BF16, Act::Gelu, 1, 264, 1003);
  norm_gate_up_case(Dt::F16, Act::Gelu, 1, 4104, 77);
  norm_gate_up_case(Dt::F16, Act::Silu, 1, 8200, 33);     // K past one row's two stages
  norm_gate_up_case(Dt::F16, Act::Silu, 3, 264, 1003);    // M > 1: the two ops
  norm_gate_up_case(Dt::BF16, Act::Gelu, 3, 4104, 1003);
  norm_gate_up_case(Dt::BF16, Act::GeluTanh, 1, 36, 19);  // K not a multiple of 8: the two ops
  KVLENS_GPU_HALF_SKIPPED();
}

// On a device, the paired one-token product (norm_gate_up, M = 1) against the two ops it
// replaces on the same backend, norm_linear then gated_act: bit for bit, for every activation —
// the same sums in the same order, the same fp32 formula, the same rounding. Both outputs are
// poisoned first and must be finite, so an unwritten output cannot pass as equal.
TEST(Ops, NormGateUpIsNormLinearThenGatedActBitwise) {
  KVLENS_NEED_GPU();
  for (Dt dt : {Dt::F16, Dt::BF16})
    for (auto [K, I] : {std::pair{264, 1003}, {4104, 1003}, {8200, 33}}) {
      const auto h = randn(K, 2.0f), g = randn(K);
      const auto w = rounded(dt, randn(static_cast<size_t>(2) * I * K, 1.0f / std::sqrt(static_cast<float>(K))));
      Backend& be = *gpu_for(dt);
      const Raw rw = raw("w", dt, {2 * I, K}, w);
      Buffer W = be.matrix("w", {rw.t});
      ASSERT_EQ(W.dt, dt);
      Buffer H = make(be, "h", {1, K}, Dt::F32, h), G = make(be, "g", {K}, Dt::F32, g);
      Buffer X = be.alloc("x", {1, K}, dt), GU = poisoned(be, "gu", {1, 2 * I}, Dt::F32);
      for (Act act : {Act::Gelu, Act::GeluTanh, Act::QuickGelu, Act::Silu, Act::Relu}) {
        const std::string what = std::string("norm_gate_up ") + dt_name(dt) + " K=" + std::to_string(K) +
                                 " I=" + std::to_string(I) + " act " + std::to_string(static_cast<int>(act));
        Buffer O = poisoned(be, "out", {1, I}, dt), O2 = poisoned(be, "out2", {1, I}, dt);
        be.norm_gate_up(H, G, 1e-5f, X, W, act, GU, O);
        be.norm_linear(H, G, 1e-5f, X, W, nullptr, GU);
        be.gated_act(GU, act, O2);
        const auto one = read(be, O), two = read(be, O2);
        size_t diff = 0, bad = 0, first = one.size();
        for (size_t k = 0; k < one.size(); ++k) {
          bad += !std::isfinite(one[k]) || !std::isfinite(two[k]);
          if (std::memcmp(&one[k], &two[k], 4) != 0 && diff++ == 0) first = k;
        }
        EXPECT_EQ(bad, 0u) << what << ": outputs not finite (unwritten)";
        EXPECT_EQ(diff, 0u) << what << ": " << diff << " of " << I << " differ, first at " << first << ": "
                            << (first < one.size() ? one[first] : 0.0f) << " against "
                            << (first < one.size() ? two[first] : 0.0f);
      }
    }
}

// The one-token product's launcher refuses parameters that do not make one of its modes, before
// anything reaches the device (so this runs wherever the CUDA code is built, GPU or not).
TEST(Ops, GemvRefusesInconsistentParams) {
#ifndef KVLENS_HAVE_CUDA
  GTEST_SKIP() << "the CUDA backend is not built here";
#else
  alignas(16) static float host[64];  // addresses only: nothing is read or written
  cuda::GemvParams base;
  base.W = host, base.dt = Dt::F16, base.N = 5, base.K = 64;
  auto refused = [&](const char* what, cuda::GemvParams p, const std::string& says) {
    std::string msg;
    try {
      cuda::gemv(p, nullptr);
    } catch (const InternalError& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find(says), std::string::npos) << what << ": got \"" << msg << "\"";
  };
  cuda::GemvParams p = base;
  p.y = host;
  refused("no input", p, "one input needed");
  p.x = host, p.h = host, p.g = host;
  refused("x and h", p, "one input needed");
  p = base, p.y = host, p.h = host;
  refused("h without g", p, "needs its weight g");
  p = base, p.y = host, p.x = host, p.check = reinterpret_cast<unsigned long long*>(host);
  refused("a check on a plain input", p, "norm input (h) only");
  p = base, p.x = host;
  refused("no output", p, "no output (y)");
  p = base, p.x = host, p.out = host;
  refused("paired without the norm input", p, "needs the norm input");
  cuda::GemvParams pair = base;
  pair.h = host, pair.g = host, pair.out = host, pair.act = static_cast<int>(Act::Silu);
  p = pair, p.y = host;
  refused("paired with y", p, "act(gate)·up only");
  p = pair, p.bias = host;
  refused("paired with a bias", p, "act(gate)·up only");
  p = pair, p.accumulate = true;
  refused("paired, accumulating", p, "act(gate)·up only");
  p = pair, p.rows_per_warp = 1;
  refused("paired, one row a warp", p, "rows_per_warp 0 or 2");
  p = pair, p.act = 9;
  refused("paired, no activation", p, "is no Act");
  p = base, p.x = host, p.y = host, p.rows_per_warp = 3;
  refused("three rows a warp", p, "rows_per_warp must be 0, 1, 2, 4 or 8");
  p = base, p.x = host, p.y = host, p.K = 36;
  refused("K not a multiple of 8", p, "K a multiple of 8");
  p = base, p.x = host, p.y = host, p.dt = Dt::F32;
  refused("fp32 weights", p, "needs f16/bf16");
  p = base, p.x = host, p.y = host, p.W = nullptr;
  refused("no weights", p, "no weights");
  p = base, p.x = host, p.y = host, p.max_blocks = -2;
  refused("a negative block count", p, "max_blocks must be");
#endif
}

// The one-token product on a grid held to fewer blocks (each warp taking several row groups, its
// loads running on from one into the next) gives the same bytes as one group a warp, at every
// rows-a-warp choice and in every mode, and the plain products match fp64 within the bound of
// Ops.Linear; a last group only part inside N is among them (N odd).
TEST(Ops, GemvGridsGiveTheSameSums) {
  KVLENS_NEED_GPU();
#ifdef KVLENS_HAVE_CUDA
  for (Dt dt : {Dt::F16, Dt::BF16}) {
    Backend& be = *gpu_for(dt);
    for (auto [K, N] : {std::pair{4104, 333}, std::pair{1032, 77}, std::pair{26000, 45}}) {  // 26000: x past 48 KiB
      const auto w = rounded(dt, randn(static_cast<size_t>(2 * N) * K, 1.0f / std::sqrt(static_cast<float>(K))));
      const auto x = rounded(dt, randn(K)), h = randn(K, 2.0f), g = randn(K), b = randn(N), y0 = randn(N);
      Buffer W = make(be, "w", {2 * N, K}, dt, w), X = make(be, "x", {K}, dt, x), H = make(be, "h", {K}, Dt::F32, h),
             G = make(be, "g", {K}, Dt::F32, g), Bb = make(be, "b", {N}, Dt::F32, b);
      std::vector<float> ref(N);
      std::vector<double> bound(N);
      for (int n = 0; n < N; ++n) {
        double sum = b[n] + y0[n], mag = std::abs(b[n]) + std::abs(y0[n]);
        for (int k = 0; k < K; ++k) {
          const double t = static_cast<double>(x[k]) * w[static_cast<size_t>(n) * K + k];
          sum += t, mag += std::abs(t);
        }
        ref[n] = static_cast<float>(sum);
        bound[n] = dot_rel(K + 2) * mag + 2 * unit(Dt::F32) * std::abs(sum);
      }
      for (int mode = 0; mode < 3; ++mode) {  // plain x with bias and accumulate; norm input; paired
        for (int R : {1, 2, 4, 8}) {
          if (mode == 2 && R != 2) continue;
          std::vector<float> first;
          for (int blocks : {0, cuda::kGemvResident, 1, 5}) {
            const std::string what = std::string(dt_name(dt)) + " K=" + std::to_string(K) + " N=" + std::to_string(N) +
                                     " mode " + std::to_string(mode) + " rows " + std::to_string(R) + " blocks " +
                                     std::to_string(blocks);
            Buffer Y = mode == 0 ? make(be, "y", {N}, Dt::F32, y0) : poisoned(be, "y", {N}, Dt::F32);
            Buffer O = poisoned(be, "out", {N}, dt);
            cuda::GemvParams p;
            p.W = W.data, p.dt = dt, p.N = N, p.K = K, p.rows_per_warp = R, p.max_blocks = blocks;
            if (mode == 0) p.x = X.data, p.bias = Bb.as<float>(), p.accumulate = true;
            else p.h = H.as<float>(), p.g = G.as<float>(), p.eps = 1e-5f;
            if (mode == 2) p.out = O.data, p.act = static_cast<int>(Act::Silu);
            else p.y = Y.as<float>();
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
            cuda::gemv(p, nullptr);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
            const auto got = read(be, mode == 2 ? O : Y);
            if (mode == 0) expect_within(got, ref, bound, what);
            if (blocks == 0) {
              first = got;
              size_t bad = 0;
              for (float v : got) bad += !std::isfinite(v);
              EXPECT_EQ(bad, 0u) << what << ": outputs not finite (unwritten)";
            } else {
              EXPECT_EQ(std::memcmp(got.data(), first.data(), got.size() * 4), 0) << what << ": not the bytes of one group a warp";
            }
          }
        }
      }
    }
  }
#endif
}

TEST(Ops, NormsActivations) {
  for (Dt odt : {Dt::F32, Dt::F16, Dt::BF16}) {
    const int M = 13, D = 517;
    const auto x = randn(static_cast<size_t>(M) * D, 3.0f);
    const auto g = randn(D), bvec = randn(D);
    std::vector<float> rms(x.size()), ln(x.size());
    std::vector<double> brms(x.size()), bln(x.size());
    for (int m = 0; m < M; ++m) {
      const float* r = x.data() + static_cast<size_t>(m) * D;
      double ss = 0, mean = 0, mx = 0;
      for (int i = 0; i < D; ++i) ss += static_cast<double>(r[i]) * r[i], mean += r[i], mx = std::max(mx, std::abs(double(r[i])));
      mean /= D;
      double var = 0;
      for (int i = 0; i < D; ++i) var += (r[i] - mean) * (r[i] - mean);
      var /= D;
      const double inv_r = 1.0 / std::sqrt(ss / D + 1e-6), inv_l = 1.0 / std::sqrt(var + 1e-5);
      for (int i = 0; i < D; ++i) {
        const size_t at = static_cast<size_t>(m) * D + i;
        rms[at] = static_cast<float>(g[i] * r[i] * inv_r);
        ln[at] = static_cast<float>((r[i] - mean) * inv_l * g[i] + bvec[i]);
        brms[at] = (dot_rel(D) + 8 * unit(Dt::F32) + unit(odt)) * std::abs(rms[at]) + tiny(odt);
        bln[at] = (2 * dot_rel(D) + 8 * unit(Dt::F32) + unit(odt)) * std::abs(ln[at]) + tiny(odt) +
                  4 * dot_rel(D) * (mx * inv_l) * std::abs(g[i]) + 2 * unit(Dt::F32) * std::abs(bvec[i]);
      }
    }
    const Backends2 B = both(Dt::F16);
    for (int i = 0; i < 2; ++i) {
      Backend* be = B.be[i];
      if (!be) continue;
      const Dt o = i == 0 ? Dt::F32 : odt;
      Buffer X = make(*be, "x", {M, D}, Dt::F32, x), G = make(*be, "g", {D}, Dt::F32, g),
             Bb = make(*be, "b", {D}, Dt::F32, bvec);
      Buffer Y = poisoned(*be, "y", {M, D}, o);
      be->rms_norm(X, G, 1e-6f, Y);
      auto br = brms;
      if (i == 0) for (size_t k = 0; k < br.size(); ++k) br[k] = (dot_rel(D) + 8 * unit(Dt::F32)) * std::abs(rms[k]);
      expect_within(read(*be, Y), rms, br, std::string(B.name[i]) + " rms_norm → " + dt_name(o));
      Buffer Z = poisoned(*be, "z", {M, D}, o);
      be->layer_norm(X, G, &Bb, 1e-5f, Z);
      expect_within(read(*be, Z), ln, bln, std::string(B.name[i]) + " layer_norm → " + dt_name(o));
      be->layer_norm(X, G, &Bb, 1e-5f, X);  // in place (the vision tower's pre-LN)
      auto bl32 = bln;
      expect_within(read(*be, X), ln, bl32, std::string(B.name[i]) + " layer_norm in place");
    }
  }
  // Activations, bias and the SiLU gate.
  for (Act act : {Act::Gelu, Act::GeluTanh, Act::QuickGelu, Act::Silu, Act::Relu}) {
    const int M = 7, N = 301;
    const auto y = randn(static_cast<size_t>(M) * N, 3.0f), bias = randn(N), gu = randn(static_cast<size_t>(M) * 2 * N, 3.0f);
    auto f = [&](double v) { return act_ref(act, v); };
    std::vector<float> r1(y.size()), r2(static_cast<size_t>(M) * N);
    std::vector<double> b1(y.size()), b2(r2.size());
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) {
        const size_t at = static_cast<size_t>(m) * N + n;
        const double v = static_cast<double>(y[at]) + bias[n];
        r1[at] = static_cast<float>(f(v));
        // float evaluation of the formula: a few ulps of |v|-sized intermediates.
        b1[at] = 16 * unit(Dt::F32) * (std::abs(v) + 1) * (std::abs(r1[at]) + 1) + unit(Dt::F16) * std::abs(r1[at]) +
                 tiny(Dt::F16);
        const double g = gu[static_cast<size_t>(m) * 2 * N + n], u = gu[static_cast<size_t>(m) * 2 * N + N + n];
        r2[at] = static_cast<float>(f(g) * u);
        b2[at] = 16 * unit(Dt::F32) * (std::abs(g) + 1) * (std::abs(f(g)) + 1) * std::abs(u) +
                 unit(Dt::F16) * std::abs(r2[at]) + tiny(Dt::F16);
      }
    const Backends2 B = both(Dt::F16);
    for (int i = 0; i < 2; ++i) {
      Backend* be = B.be[i];
      if (!be) continue;
      const Dt o = i == 0 ? Dt::F32 : Dt::F16;
      Buffer Y = make(*be, "y", {M, N}, Dt::F32, y), Bv = make(*be, "b", {N}, Dt::F32, bias);
      Buffer O = poisoned(*be, "o", {M, N}, o);
      be->bias_act(Y, &Bv, act, true, O);
      expect_within(read(*be, O), r1, b1, std::string(B.name[i]) + " bias_act " + std::to_string(int(act)));
      Buffer GU = make(*be, "gu", {M, 2 * N}, Dt::F32, gu);
      Buffer G = poisoned(*be, "g", {M, N}, o);
      be->gated_act(GU, act, G);
      expect_within(read(*be, G), r2, b2, std::string(B.name[i]) + " gated_act " + std::to_string(int(act)));
    }
  }
  KVLENS_GPU_HALF_SKIPPED();
}

TEST(Ops, AddRopeEmbedCopy) {
  const Backends2 B = both(Dt::F16);
  // add
  {
    const auto x = randn(1003), y = randn(1003);
    std::vector<float> r(x.size());
    for (size_t i = 0; i < x.size(); ++i) r[i] = x[i] + y[i];
    for (int i = 0; i < 2; ++i) {
      if (!B.be[i]) continue;
      Buffer X = make(*B.be[i], "x", {1003}, Dt::F32, x), Y = make(*B.be[i], "y", {1003}, Dt::F32, y);
      B.be[i]->add(X, Y);
      expect_within(read(*B.be[i], X), r, bound_rel(r, 0, unit(Dt::F32)), std::string(B.name[i]) + " add");
    }
  }
  // RoPE on q and k heads inside a projection row (GQA, odd token count, large positions): one
  // row of positions; then sectioned (M-RoPE: each run of frequencies its own row of positions,
  // negative ones included), and the axial table of Qwen2-VL's vision tower.
  Rope sectioned(10000.0f), axial(10000.0f);
  sectioned.sections = {3, 4, 5};
  axial.type = "axial";
  axial.sections = {6, 6};
  for (const Rope& rope : {Rope(10000.0f), sectioned, axial}) {
    const int T = 11, NH = 6, NKV = 2, D = 24, R = rope.rows();
    const int64_t stride = (NH + 2 * NKV) * D + 5;
    const auto x = randn(static_cast<size_t>(T) * stride);
    std::vector<int32_t> pos(static_cast<size_t>(R) * T);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) pos[static_cast<size_t>(r * T + t)] = 3 + 97 * t - 150 * r * (t % 3);
    AttnLayout l;
    l.T = T; l.n_heads = NH; l.n_kv_heads = NKV; l.head_dim = D; l.row_stride = stride;
    l.q_col = 0; l.k_col = NH * D; l.v_col = (NH + NKV) * D;
    // Frequency i's row and inverse frequency, from the formulas (not Rope's own tables).
    auto row_of = [&](int i) {
      int r = 0, end = rope.sections.empty() ? D / 2 : rope.sections[0];
      while (i >= end) end += rope.sections[static_cast<size_t>(++r)];
      return r;
    };
    auto inv_of = [&](int i) {
      if (rope.type == "axial") return 1.0f / std::pow(rope.theta, static_cast<float>(2 * (i % (D / 4))) / static_cast<float>(D / 2));
      return 1.0f / std::pow(rope.theta, static_cast<float>(2 * i) / static_cast<float>(D));
    };
    std::vector<float> r = x;
    std::vector<double> bd(x.size(), 0.0);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < NH + NKV; ++h) {
        const int64_t c0 = h < NH ? h * D : l.k_col + (h - NH) * D;
        for (int i = 0; i < D / 2; ++i) {
          const int32_t p = pos[static_cast<size_t>(row_of(i) * T + t)];
          const double ang = static_cast<double>(static_cast<float>(p) * inv_of(i));
          const size_t a = static_cast<size_t>(t * stride + c0 + i), b = a + D / 2;
          r[a] = static_cast<float>(x[a] * std::cos(ang) - x[b] * std::sin(ang));
          r[b] = static_cast<float>(x[b] * std::cos(ang) + x[a] * std::sin(ang));
          // sin/cos of an fp32 angle to a few ulps, times the inputs
          bd[a] = bd[b] = 8 * unit(Dt::F32) * (std::abs(x[a]) + std::abs(x[b]));
        }
      }
    for (int i = 0; i < 2; ++i) {
      if (!B.be[i]) continue;
      Buffer X = make(*B.be[i], "qkv", {T, stride}, Dt::F32, x);
      Buffer P = make_ids(*B.be[i], "pos", pos);
      B.be[i]->rope(X, l, P, rope);
      expect_within(read(*B.be[i], X), r, bd, std::string(B.name[i]) + " rope " + rope.key());
    }
  }
  // Embedding gather from an f16 table (exact), and a block copy.
  {
    const int V = 97, H = 40;
    const auto table = rounded(Dt::F16, randn(static_cast<size_t>(V) * H));
    const std::vector<int32_t> ids{5, 96, 0, 5, 33};
    std::vector<float> r;
    for (int id : ids) r.insert(r.end(), table.begin() + id * H, table.begin() + (id + 1) * H);
    for (int i = 0; i < 2; ++i) {
      if (!B.be[i]) continue;
      const Raw rt = raw("table", Dt::F16, {V, H}, table);
      Buffer T = B.be[i]->matrix("table", {rt.t});
      Buffer I = make_ids(*B.be[i], "ids", ids);
      Buffer O = poisoned(*B.be[i], "o", {static_cast<int64_t>(ids.size()), H}, Dt::F32);
      B.be[i]->embed(T, I, O);
      expect_within(read(*B.be[i], O), r, std::vector<double>(r.size(), 0.0), std::string(B.name[i]) + " embed");
      // copy rows 1..3, columns 7..29 of O into a poisoned buffer at (2, 4)
      Buffer C = poisoned(*B.be[i], "c", {6, 30}, Dt::F32);
      B.be[i]->copy_block(O, 1, 7, C, 2, 4, 3, 23);
      const auto got = read(*B.be[i], C);
      for (int a = 0; a < 3; ++a)
        for (int c = 0; c < 23; ++c)
          EXPECT_EQ(got[static_cast<size_t>(2 + a) * 30 + 4 + c], r[static_cast<size_t>(1 + a) * H + 7 + c]) << B.name[i];
      // ... and of the table as the backend keeps it (f16 on a device, f32 on the CPU): copied as
      // it is, in its own dtype
      Buffer C16 = poisoned(*B.be[i], "c16", {5, 17}, T.dt);
      B.be[i]->copy_block(T, 90, 3, C16, 1, 2, 4, 15);
      const auto got16 = read(*B.be[i], C16);
      for (int a = 0; a < 5; ++a)
        for (int c = 0; c < 17; ++c) {
          const float v = got16[static_cast<size_t>(a) * 17 + c];
          if (a >= 1 && c >= 2 && c < 17)
            EXPECT_EQ(v, table[static_cast<size_t>(89 + a) * H + 1 + c]) << B.name[i] << " f16 " << a << "," << c;
          else
            EXPECT_TRUE(std::isnan(v)) << B.name[i] << " f16 outside the block " << a << "," << c;
        }
      Buffer other = B.be[i]->alloc("other", {5, 17}, T.dt == Dt::F32 ? Dt::I32 : Dt::F32);
      EXPECT_THROW(B.be[i]->copy_block(T, 0, 0, other, 0, 0, 1, 1), InternalError) << "dtypes differ";
    }
  }
  KVLENS_GPU_HALF_SKIPPED();
}

void attention_case(int T, int NH, int NKV, int D, bool causal, Dt odt) {
  AttnLayout l;
  l.T = T; l.n_heads = NH; l.n_kv_heads = NKV; l.head_dim = D;
  l.row_stride = static_cast<int64_t>(NH + 2 * NKV) * D;
  l.q_col = 0; l.k_col = static_cast<int64_t>(NH) * D; l.v_col = static_cast<int64_t>(NH + NKV) * D;
  l.causal = causal;
  l.scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto qkv = randn(static_cast<size_t>(T) * l.row_stride, 1.5f);
  std::vector<float> ref, naive16, naive32;
  std::vector<double> err32, score_mag;
  attention_refs(qkv, l, Dt::F16, ref, naive16);
  attention_refs(qkv, l, Dt::F32, ref, naive32, &err32, &score_mag);
  // Error allowed: twice the naive implementation's at the kernel's precision (f16 tiles for
  // head_dim up to 128, sizes other than 32/64/128 widened with zeros; fp32 otherwise), against
  // fp64, at least the fp32 bound, plus the output's rounding.
  const bool tiles = D <= 128 && odt != Dt::F32;
  const std::vector<double> bound = attention_bound(ref, tiles ? naive16 : naive32, odt, &err32);
  const Backends2 B = both(Dt::F16);
  const std::string what = "attention T=" + std::to_string(T) + " D=" + std::to_string(D) + (causal ? " causal" : "");
  for (int i = 0; i < 2; ++i) {
    Backend* be = B.be[i];
    if (!be) continue;
    const Dt o = i == 0 ? Dt::F32 : odt;
    Buffer X = make(*be, "qkv", {T, l.row_stride}, Dt::F32, qkv);
    Buffer O = poisoned(*be, "o", {T, static_cast<int64_t>(NH) * D}, o);
    std::vector<float> sc(static_cast<size_t>(NH) * T * T), pr(sc.size());
    be->attention(X, l, O, sc.data(), pr.data());
    expect_within(read(*be, O), ref, bound, std::string(B.name[i]) + " " + what);
    // The captured scores and probabilities against the CPU backend's.
    if (i == 1) {
      std::vector<float> sc0(sc.size()), pr0(sc.size());
      Buffer X0 = make(*B.be[0], "qkv", {T, l.row_stride}, Dt::F32, qkv);
      Buffer O0 = poisoned(*B.be[0], "o", {T, static_cast<int64_t>(NH) * D}, Dt::F32);
      B.be[0]->attention(X0, l, O0, sc0.data(), pr0.data());
      for (size_t k = 0; k < sc.size(); ++k) {
        if (std::isinf(sc0[k])) {
          EXPECT_TRUE(std::isinf(sc[k]) && sc[k] < 0) << what << " mask at " << k;
          EXPECT_EQ(pr[k], 0.0f);
          sc[k] = sc0[k] = 0;
        }
      }
      // Each backend's score is within dot_rel(D) of scale·Σ|q_d·k_d| of the exact one (summands
      // that can cancel far below the score itself), so the two within twice that (and the
      // scale's rounding). A probability moves by its own share of the largest score error of
      // its row twice over (its score and the row's log-sum).
      std::vector<double> bs(sc.size()), bp(sc.size());
      for (size_t at = 0; at < sc.size(); at += T) {  // one query row of one head
        double row_max = 0;
        for (int j = 0; j < T; ++j) row_max = std::max(row_max, bs[at + j] = 1e-6 + 4 * dot_rel(D) * score_mag[at + j]);
        for (int j = 0; j < T; ++j) bp[at + j] = 1e-6 + std::abs(pr0[at + j]) * (4 * row_max + 32 * dot_rel(D));
      }
      expect_within(sc, sc0, bs, "cuda " + what + " captured scores");
      expect_within(pr, pr0, bp, "cuda " + what + " captured probs");
    }
  }
}

TEST(Ops, PrefillAttention) {
  // Tensor-core tiles (64 query rows a block, 64-key tiles); tests/kernels/test_prefill_kernel.cpp
  // also forces each key split.
  attention_case(77, 4, 4, 64, false, Dt::F16);    // vision: no mask
  attention_case(131, 4, 2, 128, true, Dt::F16);   // text: causal, GQA, two partial tiles
  attention_case(70, 3, 3, 32, true, Dt::BF16);
  attention_case(200, 3, 1, 128, true, Dt::BF16);  // 4 key tiles, diagonal tiles, GQA 3:1, last block 8 rows
  attention_case(261, 2, 2, 64, false, Dt::F16);   // T = 4·64 + 5: 5 key tiles, the last of 5 keys
  attention_case(13, 2, 1, 32, true, Dt::F16);     // T < 16: one partial row group
  attention_case(150, 2, 2, 32, false, Dt::BF16);
  attention_case(45, 4, 2, 24, true, Dt::F32);     // head_dim 24: the simple kernel
  attention_case(50, 2, 2, 64, true, Dt::F32);     // an fp32 model: the simple kernel too
  attention_case(33, 2, 1, 8, false, Dt::F16);     // head sizes the tiles lack: widened with zeros (8 → 32,
  attention_case(150, 3, 3, 80, false, Dt::F16);   // 80 → 128: Qwen2-VL's vision tower, 48 → 64)
  attention_case(97, 4, 2, 48, true, Dt::BF16);
  KVLENS_GPU_HALF_SKIPPED();
}

TEST(Ops, OutOfMemoryNamesWhatAndHowMuch) {
  KVLENS_NEED_GPU();
  try {
    op_backends().gpu->alloc("test.huge_buffer", {int64_t{1} << 45}, Dt::F32);
    FAIL() << "a 128 TiB allocation succeeded";
  } catch (const OutOfMemory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("test.huge_buffer"), std::string::npos) << m;
    EXPECT_NE(m.find("free"), std::string::npos) << m;
    EXPECT_NE(m.find("MiB"), std::string::npos) << m;
  }
  // The backend still works afterwards.
  Buffer b = make(*op_backends().gpu, "after", {3}, Dt::F32, {1, 2, 3});
  EXPECT_EQ(read(*op_backends().gpu, b), (std::vector<float>{1, 2, 3}));
}

TEST(Ops, EveryOpIsSupported) {
  // The op table: the CPU backend has every op but the packed cache; CUDA has all.
  for (int o = 0; o < static_cast<int>(Op::Count); ++o) {
    const Op op = static_cast<Op>(o);
    EXPECT_EQ(op_backends().cpu->supports(op), op != Op::PackedKV) << op_name(op);
    if (op_backends().gpu) {
      EXPECT_TRUE(op_backends().gpu->supports(op)) << op_name(op);
    }
  }
}

}  // namespace
