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
#include <functional>
#include <memory>
#include <mutex>
#include <random>

#include "core/compress/quant_methods.h"
#include "core/parallel.h"

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

void Codec::encode_row(const float* x, quant::QuantBlock& out, float* xhat) const {
  double nn = 0;
  for (int j = 0; j < d; ++j) nn = std::fma(static_cast<double>(x[j]), x[j], nn);
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
    rr = std::fma(static_cast<double>(r[j]), r[j], rr);
  }
  const uint16_t gamma_h = quant::to_half(static_cast<float>(std::sqrt(rr)));
  out.scales.push_back(gamma_h);
  std::vector<uint32_t> sgn(d);
  for (int i = 0; i < d; ++i) {
    double s = 0;
    for (int j = 0; j < d; ++j) s = std::fma(static_cast<double>(S[static_cast<size_t>(i) * d + j]), r[j], s);
    sgn[i] = s >= 0 ? 1u : 0u;
  }
  quant::pack(sgn.data(), d, 1, out.codes);
  const double c = std::sqrt(M_PI / 2.0) * quant::from_half(gamma_h) / d;
  for (int j = 0; j < d; ++j) {
    double acc = 0;
    for (int i = 0; i < d; ++i) {
      const double sij = S[static_cast<size_t>(i) * d + j];
      acc += sgn[i] ? sij : -sij;
    }
    xhat[j] = static_cast<float>(std::fma(c, acc, static_cast<double>(xmse[j])));
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
  // Each generated row coded as it arrives (scope "all"), stated as data: a device codes it
  // where it is appended (StepQuant::coded).
  StepQuant step_quant(int head_dim) const override {
    if (!acts_on_decode()) return {};
    std::shared_ptr<const turboquant::Codec> k, v;
    codecs(head_dim, k, v);
    return StepQuant::coded(k, v, bits_, storage_);
  }

  // The prompt: every layer's segments in scope coded together — where their rows are: on the
  // device by its backend when the host store holds the layout alone (every layer's codes left
  // there, deferred in their payloads, where the backend can: Backend::code_rows_later), else on
  // the host on threads of their own.
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) override {
    std::vector<KVSegment*> on_host;
    std::vector<quant::PendingPayload> coded;
    Backend* be = layers.empty() ? nullptr : layers.front().backend;
    const bool later = be && be->queues_reductions();
    auto queue = [&] {
      for (const PrefillContext& c : layers) code_layer(c, store.layer(c.layer), later, on_host, coded);
    };
    auto keep = [&] { install(coded); };
    // (the segments coded before an error take their payloads: the device keeps their rows by
    // payload until the layer's next sync)
    if (later) be->queue_then_keep(queue, keep);
    else then_anyway(queue, keep);
    if (!on_host.empty()) code_segments(on_host, layers.front().head_dim);
  }
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    std::vector<KVSegment*> on_host;
    std::vector<quant::PendingPayload> coded;
    then_anyway([&] { code_layer(ctx, layer, false, on_host, coded); }, [&] { install(coded); });
    if (!on_host.empty()) code_segments(on_host, ctx.head_dim);
  }
  bool reads_rows() const override { return false; }

 private:
  // The codecs for head size D, made once a size (one rotation and one S for every layer and head).
  void codecs(int D, std::shared_ptr<const turboquant::Codec>& k, std::shared_ptr<const turboquant::Codec>& v) const {
    const std::lock_guard<std::mutex> lock(mu_);
    if (!kc_ || kc_->d != D) {
      kc_ = std::make_shared<const turboquant::Codec>(turboquant::make_codec(D, qjl_ ? bits_ - 1 : bits_, qjl_, seed_));
      vc_ = std::make_shared<const turboquant::Codec>(turboquant::make_codec(D, bits_, false, seed_));
    }
    k = kc_;
    v = vc_;
  }
  void quantize_segment(KVSegment& s, int D) override { code_segments({&s}, D); }

  // The layer's segments in scope whose rows only the device holds, coded there (later: their
  // codes left there, deferred in the payload), each with its payload added to
  // `coded`; the others are added to `on_host`.
  void code_layer(const PrefillContext& c, LayerKV& layer, bool later, std::vector<KVSegment*>& on_host,
                  std::vector<quant::PendingPayload>& coded) const {
    for (KVSegment& s : layer.segments) {
      if (!in_scope(s)) continue;
      if (!s.layout_only) {
        on_host.push_back(&s);
        continue;
      }
      std::shared_ptr<const turboquant::Codec> kc, vc;
      codecs(c.head_dim, kc, vc);
      auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(s.heads.size()));
      if (!c.backend || !c.device ||
          !(later ? c.backend->code_rows_later(*c.device, c.layer, s, *kc, *vc, *p)
                  : c.backend->code_rows(*c.device, c.layer, s, *kc, *vc, *p)))
        throw InternalError("turboquant: layer " + std::to_string(c.layer) +
                            "'s rows are in the device cache alone, and its backend cannot code them there");
      coded.push_back({&s, std::move(p)});
    }
  }
  // Each coded segment takes its payload once its codes are in (the list empties). Row bits are
  // the keys': b codebook bits, or with qjl b − 1 codebook bits + the 1-bit sketch.
  void install(std::vector<quant::PendingPayload>& coded) const {
    for (const quant::PendingPayload& q : coded) quant::set_quantized(*q.s, q.p, storage_, bits_);
    coded.clear();
  }
  // Each KV head of each segment coded on its own (up to 8 at once where there are enough rows to
  // pay for the threads — a prompt, not a decode step's row a head: every row is coded alone, so
  // the codes do not depend on the threads); each row replaced by its dequantization.
  void code_segments(const std::vector<KVSegment*>& segs, int D) {
    std::shared_ptr<const turboquant::Codec> kc, vc;
    codecs(D, kc, vc);
    std::vector<std::shared_ptr<quant::QuantPayload>> pay;
    std::vector<std::pair<size_t, size_t>> jobs;  // (segment, head)
    int64_t rows = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      pay.push_back(std::make_shared<quant::QuantPayload>(static_cast<int>(segs[i]->heads.size())));
      for (size_t h = 0; h < segs[i]->heads.size(); ++h) {
        jobs.emplace_back(i, h);
        rows += segs[i]->heads[h].n();
      }
    }
    parallel_for(static_cast<int>(jobs.size()), rows >= kThreadedRows ? 8 : 1, [&](int j) {
      const auto [i, h] = jobs[static_cast<size_t>(j)];
      HeadRows& r = segs[i]->heads[h];
      quant::QuantPayload& p = *pay[i];
      std::vector<float> xhat(static_cast<size_t>(D));
      for (int t = 0; t < r.n(); ++t) {
        float* k = r.k.data() + static_cast<size_t>(t) * D;
        kc->encode_row(k, p.k[h], xhat.data());
        std::copy(xhat.begin(), xhat.end(), k);
        float* v = r.v.data() + static_cast<size_t>(t) * D;
        vc->encode_row(v, p.v[h], xhat.data());
        std::copy(xhat.begin(), xhat.end(), v);
      }
    });
    for (size_t i = 0; i < segs.size(); ++i) quant::set_quantized(*segs[i], pay[i], storage_, bits_);
  }

  static constexpr int64_t kThreadedRows = 256;
  int bits_;
  bool qjl_;
  uint64_t seed_;
  std::string storage_;
  mutable std::mutex mu_;
  mutable std::shared_ptr<const turboquant::Codec> kc_, vc_;
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
