// `turboquant` (TurboQuant, as the slides describe it): each K/V row x is rotated by a seeded
// randomized Hadamard transform y = H·D·x (D random ±1 signs, H the orthonormal Walsh–Hadamard
// matrix; rows are zero-padded to the next power of two dp). After rotation a coordinate of
// x/‖x‖ is close to N(0, 1/dp), so y_j·√dp/‖x‖ is quantized with the Lloyd-Max codebook of a
// standard normal at b bits (computed at start-up by Lloyd iterations) and the row norm is
// stored (fp16). Dequantization: ŷ_j = level·‖x‖/√dp, x̂ = first d of D·H·ŷ.
//
// With qjl=on, keys use the inner-product variant (TurboQuant_prod): b − 1 bits of codebook
// (0 bits: no MSE stage, x_mse = 0) plus a 1-bit QJL sketch of the residual r = x − x_mse:
// sign(S·r) with S a seeded d×d standard Gaussian matrix and γ = ‖r‖ (fp16); the key is
// rebuilt as x_mse + √(π/2)·γ/d · Sᵀ·sign(S·r), which keeps q·k̂ unbiased. Values always use
// the b-bit MSE variant.
//
// One rotation and one S serve every layer and head (both from `seed`). Rows are quantized on
// their own, so decode tokens are quantized as they arrive (scope=all).
#include <algorithm>
#include <cmath>
#include <random>

#include "core/compress/quant_methods.h"

namespace kvlens {

namespace turboquant {

void Codec::rotate(const float* x, float* y) const {
  for (int j = 0; j < dp; ++j) y[j] = j < d ? x[j] * signs[j] : 0.0f;
  quant::hadamard(y, dp);
}

void Codec::unrotate(const float* y, float* x) const {
  std::vector<float> t(y, y + dp);
  quant::hadamard(t.data(), dp);
  for (int j = 0; j < d; ++j) x[j] = t[j] * signs[j];
}

int64_t Codec::row_code_bytes() const {
  return (mse_bits > 0 ? quant::packed_size(dp, mse_bits) : 0) + (qjl ? quant::packed_size(d, 1) : 0);
}

void Codec::encode_row(const float* x, quant::QuantBlock& out, float* xhat) const {
  double nn = 0;
  for (int j = 0; j < d; ++j) nn += static_cast<double>(x[j]) * x[j];
  const uint16_t norm_h = quant::to_half(static_cast<float>(std::sqrt(nn)));
  const float norm = quant::from_half(norm_h);
  out.scales.push_back(norm_h);
  std::vector<float> xmse(d, 0.0f);
  if (mse_bits > 0) {
    std::vector<float> y(dp), yhat(dp);
    std::vector<uint32_t> codes(dp);
    rotate(x, y.data());
    const float sq = std::sqrt(static_cast<float>(dp));
    const float to_unit = norm > 0 ? sq / norm : 0.0f, from_unit = norm / sq;
    for (int j = 0; j < dp; ++j) {
      codes[j] = quant::nearest_level(levels, y[j] * to_unit);
      yhat[j] = levels[codes[j]] * from_unit;
    }
    quant::pack(codes.data(), dp, mse_bits, out.codes);
    unrotate(yhat.data(), xmse.data());
  }
  for (int j = 0; j < d; ++j) xhat[j] = xmse[j];
  if (!qjl) return;
  std::vector<float> r(d);
  double rr = 0;
  for (int j = 0; j < d; ++j) {
    r[j] = x[j] - xmse[j];
    rr += static_cast<double>(r[j]) * r[j];
  }
  const uint16_t gamma_h = quant::to_half(static_cast<float>(std::sqrt(rr)));
  out.scales.push_back(gamma_h);
  std::vector<uint32_t> sgn(d);
  for (int i = 0; i < d; ++i) {
    double s = 0;
    for (int j = 0; j < d; ++j) s += static_cast<double>(S[static_cast<size_t>(i) * d + j]) * r[j];
    sgn[i] = s >= 0 ? 1u : 0u;
  }
  quant::pack(sgn.data(), d, 1, out.codes);
  const double c = std::sqrt(M_PI / 2.0) * quant::from_half(gamma_h) / d;
  for (int j = 0; j < d; ++j) {
    double acc = 0;
    for (int i = 0; i < d; ++i) acc += (sgn[i] ? 1.0 : -1.0) * S[static_cast<size_t>(i) * d + j];
    xhat[j] = static_cast<float>(xmse[j] + c * acc);
  }
}

Codec make_codec(int d, int mse_bits, bool qjl, uint64_t seed) {
  Codec c;
  c.d = d;
  c.dp = quant::next_pow2(d);
  c.mse_bits = mse_bits;
  c.qjl = qjl;
  std::mt19937_64 rng(seed);
  c.signs.resize(c.dp);
  for (float& s : c.signs) s = (rng() >> 63) ? -1.0f : 1.0f;
  c.levels = quant::lloyd_max_normal(mse_bits);
  if (qjl) {
    // Box–Muller on mt19937_64 (specified by the standard), so S is the same everywhere.
    std::mt19937_64 g(seed ^ 0x5DEECE66Dull);
    c.S.resize(static_cast<size_t>(d) * d);
    for (size_t i = 0; i < c.S.size(); i += 2) {
      const double u1 = (static_cast<double>(g() >> 11) + 1.0) / 9007199254740993.0;  // (0, 1]
      const double u2 = static_cast<double>(g() >> 11) / 9007199254740992.0;
      const double rad = std::sqrt(-2.0 * std::log(u1));
      c.S[i] = static_cast<float>(rad * std::cos(2 * M_PI * u2));
      if (i + 1 < c.S.size()) c.S[i + 1] = static_cast<float>(rad * std::sin(2 * M_PI * u2));
    }
  }
  return c;
}

}  // namespace turboquant

namespace {

class TurboQuantPolicy : public quant::SegmentQuantPolicy {
 public:
  TurboQuantPolicy(int bits, bool qjl, uint64_t seed, bool visual_only)
      : SegmentQuantPolicy(visual_only), bits_(bits), qjl_(qjl), seed_(seed) {
    storage_ = "turboquant k:q" + std::to_string(qjl ? bits - 1 : bits) + (qjl ? "+qjl" : "") +
               " v:q" + std::to_string(bits);
  }
  std::string name() const override { return "turboquant"; }

 private:
  void quantize_segment(KVSegment& s, int D) override {
    if (kc_.d != D) {
      kc_ = turboquant::make_codec(D, qjl_ ? bits_ - 1 : bits_, qjl_, seed_);
      vc_ = turboquant::make_codec(D, bits_, false, seed_);
    }
    auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(s.heads.size()));
    std::vector<float> xhat(D);
    for (size_t h = 0; h < s.heads.size(); ++h) {
      HeadRows& r = s.heads[h];
      for (int j = 0; j < r.n(); ++j) {
        float* k = r.k.data() + static_cast<size_t>(j) * D;
        kc_.encode_row(k, p->k[h], xhat.data());
        std::copy(xhat.begin(), xhat.end(), k);
        float* v = r.v.data() + static_cast<size_t>(j) * D;
        vc_.encode_row(v, p->v[h], xhat.data());
        std::copy(xhat.begin(), xhat.end(), v);
      }
    }
    // Row bits are the keys': b codebook bits, or with qjl b − 1 codebook bits + the 1-bit sketch.
    quant::set_quantized(s, p, storage_, bits_);
  }

  int bits_;
  bool qjl_;
  uint64_t seed_;
  std::string storage_;
  turboquant::Codec kc_, vc_;
};

}  // namespace

MethodSpec turboquant_method() {
  MethodSpec m;
  m.name = "turboquant";
  m.family = "quantization";
  m.summary = "TurboQuant: randomized Hadamard rotation + Lloyd-Max codebook (+ 1-bit QJL residual for K)";
  m.params = {
      param::integer("bits", 1, 4, "3",
                     "b bits per rotated coordinate: y = H·D·x, code = nearest Lloyd-Max level of y_j·√d/‖x‖"),
      param::flag("qjl", "off",
                  "keys: b−1 codebook bits + sign(S·r), ‖r‖ for r = x − x_mse; k̂ = x_mse + √(π/2)‖r‖/d·Sᵀsign(S·r)"),
      param::integer("seed", 0, 2147483647, "0", "seed of the random signs D and of the Gaussian S"),
      param::choice("scope", {"all", "visual"}, "all", "which tokens to quantize: every kind, or visual only"),
  };
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<TurboQuantPolicy>(p.integer("bits"), p.flag("qjl"),
                                              static_cast<uint64_t>(p.integer("seed")),
                                              p.str("scope") == "visual");
  };
  return m;
}

}  // namespace kvlens
