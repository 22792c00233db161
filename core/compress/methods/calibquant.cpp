// `calibquant` (CalibQuant): visual tokens only (system, text and generated tokens stay dense,
// in the cache's row storage: fp16 by default).
// K and V are both quantized channel-wise: α_i, β_i = min/max over the visual tokens of one
// segment, KV head and channel (Eq. 5), b bits (Eq. 3/4). Attention reads the dequantized rows;
// post_scaled_scores/values compute the same products from the codes (Eq. 6).
//
// Calibration (Eq. 7/8): for each query head and query, γ and δ are the min and max of its
// pre-softmax scores over the visual keys; g maps them from [γ, δ] onto [γ − τ1, δ − τ2]
// before the softmax. `calibrate=auto` applies it when b ≤ 2 (as the authors' code does),
// `force` always, `off` never. The slope (δ−γ+τ1−τ2)/(δ−γ) is applied as Eq. 7 defines it:
// τ1 > τ2 widens the visual range (order kept); a query whose visual range δ−γ is narrower
// than τ2−τ1 gets a negative slope, which reverses the order of its visual scores (the
// Calibration view draws g as a transfer curve, so this is visible).
//
// Range shrinking (the authors' code, 1 bit: K 0.5, V 0.3): before quantizing, each channel's
// bounds are multiplied by the factor s (shrink_about=zero: [s·α, s·β], what the code does) or
// pulled towards the range centre c = (α+β)/2 (shrink_about=centre: [c − s(c−α), c + s(β−c)]);
// values outside clamp to the ends. s = 1 (the paper's setting) leaves the range as is.
#include <algorithm>
#include <cmath>

#include "core/compress/quant_methods.h"

namespace kvlens {

namespace calibquant {

float calibrate(float x, float gamma, float delta, float tau1, float tau2) {
  if (!(delta > gamma)) return gamma - tau1;
  return (delta - gamma + tau1 - tau2) / (delta - gamma) * (x - gamma) + gamma - tau1;
}

void calibrate_visual(float* scores, const SegmentKind* kinds, int n, float tau1, float tau2) {
  float gamma = INFINITY, delta = -INFINITY;
  for (int j = 0; j < n; ++j)
    if (kinds[j] == SegmentKind::Visual && std::isfinite(scores[j])) {
      gamma = std::min(gamma, scores[j]);
      delta = std::max(delta, scores[j]);
    }
  if (!(gamma <= delta)) return;  // no visual key
  for (int j = 0; j < n; ++j)
    if (kinds[j] == SegmentKind::Visual && std::isfinite(scores[j]))
      scores[j] = calibrate(scores[j], gamma, delta, tau1, tau2);
}

void post_scaled_scores(const float* q, int d, const uint8_t* codes, int n, int bits,
                        const uint16_t* scale, const uint16_t* alpha, float* out) {
  std::vector<float> qs(d);
  double qa = 0;  // q·α, the same for every row
  for (int c = 0; c < d; ++c) {
    qs[c] = q[c] * quant::from_half(scale[c]);
    qa += static_cast<double>(q[c]) * quant::from_half(alpha[c]);
  }
  for (int j = 0; j < n; ++j) {
    double acc = 0;
    for (int c = 0; c < d; ++c)
      acc += static_cast<double>(qs[c]) * quant::unpack_one(codes, static_cast<int64_t>(j) * d + c, bits);
    out[j] = static_cast<float>(acc + qa);
  }
}

void post_scaled_values(const float* w, int n, const uint8_t* codes, int d, int bits,
                        const uint16_t* scale, const uint16_t* alpha, float* out) {
  std::vector<double> acc(d, 0.0);
  double wsum = 0;
  for (int j = 0; j < n; ++j) {
    wsum += w[j];
    for (int c = 0; c < d; ++c)
      acc[c] += static_cast<double>(w[j]) * quant::unpack_one(codes, static_cast<int64_t>(j) * d + c, bits);
  }
  for (int c = 0; c < d; ++c)
    out[c] = static_cast<float>(quant::from_half(scale[c]) * acc[c] + quant::from_half(alpha[c]) * wsum);
}

}  // namespace calibquant

namespace {

// On a device the visual rows are quantized where they are (quant::PrefillQuantPolicy): every
// layer's before one wait on a backend that queues, else layer by layer.
class CalibQuantPolicy : public quant::PrefillQuantPolicy {
 public:
  CalibQuantPolicy(int bits, float tau1, float tau2, const std::string& calibrate, float k_shrink,
                   float v_shrink, bool about_zero)
      : bits_(bits), tau1_(tau1), tau2_(tau2), k_shrink_(k_shrink), v_shrink_(v_shrink),
        about_zero_(about_zero) {
    calibrate_ = calibrate == "force" || (calibrate == "auto" && bits <= 2);
  }
  std::string name() const override { return "calibquant"; }
  bool acts_on_decode() const override { return false; }  // visual rows only, at prefill

 private:
  // The layer's visual segments quantized into payloads (on the device where the rows are there
  // alone; `later`: their codes stay there, deferred in the payloads), not yet stored.
  void quantize_layer(const PrefillContext& ctx, LayerKV& layer, bool later,
                      std::vector<quant::PendingPayload>& done) const override {
    const quant::UniformSpec ks{bits_, quant::Axis::PerChannel, k_shrink_, about_zero_};
    const quant::UniformSpec vs{bits_, quant::Axis::PerChannel, v_shrink_, about_zero_};
    for (KVSegment& s : layer.segments)
      if (s.kind == SegmentKind::Visual && s.dense()) done.push_back(quant::quantize_rows_of(ctx, s, ks, vs, later, "calibquant"));
  }
  // Each quantized segment takes its payload (its codes made, on the host or deferred); the list
  // empties.
  void store(std::vector<quant::PendingPayload>& done) const override {
    quant::CodeLayout l;
    l.kind = quant::CodeLayout::Kind::Blocks;
    l.k_bits = l.v_bits = bits_;
    l.k_axis = l.v_axis = quant::Axis::PerChannel;
    install(done, l, "q" + std::to_string(bits_) + "-channel", bits_);
  }

 public:
  bool has_score_transform() const override { return calibrate_; }
  // The calibration of the visual scores is one a device applies inside its attention kernel.
  ScoreTransform score_transform() const override {
    ScoreTransform t = KVPolicy::score_transform();
    if (!calibrate_) return t;
    t.kind = ScoreTransform::Kind::Calibrate;
    t.tau1 = tau1_;
    t.tau2 = tau2_;
    return t;
  }
  void transform_scores(int layer, int head, float* scores, const SegmentKind* kinds,
                        int n_k) const override {
    if (calibrate_) calibquant::calibrate_visual(scores, kinds, n_k, tau1_, tau2_);
  }

 private:
  int bits_;
  float tau1_, tau2_, k_shrink_, v_shrink_;
  bool about_zero_, calibrate_ = false;
};

}  // namespace

MethodSpec calibquant_method() {
  MethodSpec m;
  m.name = "calibquant";
  m.family = "quantization";
  m.summary = "CalibQuant: channel-wise b-bit visual K/V with post-quantization score calibration";
  m.params = {
      param::choice("bits", {"1", "2", "4", "8"}, "1",
                    "bits b for visual K and V, channel-wise: α_i, β_i = min/max over visual tokens (Eq. 5)"),
      param::real("tau1", 0, 8, "0",
                  "τ1: calibration lowers the visual score minimum γ to γ−τ1 (Eq. 7); τ1 > τ2 widens the range, order kept"),
      param::real("tau2", 0, 8, "3",
                  "τ2: calibration lowers the visual score maximum δ to δ−τ2 (Eq. 7); where τ2−τ1 > δ−γ the slope is negative and that query's visual scores reverse order, as Eq. 7 defines"),
      param::choice("calibrate", {"auto", "force", "off"}, "auto",
                    "apply g(x) = (δ−γ+τ1−τ2)/(δ−γ)·(x−γ)+γ−τ1 (Eq. 7/8): auto = when bits ≤ 2 (the authors' code), force, off"),
      param::real("k_shrink", 0.01, 1, "1",
                  "K range factor s: [α, β] → [c+s(α−c), c+s(β−c)] before quantizing (1 = none; code: 0.5)"),
      param::real("v_shrink", 0.01, 1, "1",
                  "V range factor s: [α, β] → [c+s(α−c), c+s(β−c)] before quantizing (1 = none; code: 0.3)"),
      param::choice("shrink_about", {"zero", "centre"}, "zero",
                    "shrink centre c: zero ([s·α, s·β], the authors' code) or centre ((α+β)/2)"),
  };
  m.presets = {
      {"paper", {{"bits", "1"}, {"tau1", "0"}, {"tau2", "3"}, {"k_shrink", "1"}, {"v_shrink", "1"}}},
      {"official",
       {{"bits", "1"}, {"tau1", "0"}, {"tau2", "3"}, {"k_shrink", "0.5"}, {"v_shrink", "0.3"},
        {"shrink_about", "zero"}}},
  };
  m.calibration_stage = [](const Params& p) -> std::optional<Params> { return p; };
  m.calibrates = [](const Params& p) {
    const std::string mode = p.str("calibrate");
    return mode == "force" || (mode == "auto" && p.integer("bits") <= 2);
  };
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<CalibQuantPolicy>(
        p.integer("bits"), static_cast<float>(p.num("tau1")), static_cast<float>(p.num("tau2")),
        p.str("calibrate"), static_cast<float>(p.num("k_shrink")), static_cast<float>(p.num("v_shrink")),
        p.str("shrink_about") == "zero");
  };
  return m;
}

}  // namespace kvlens
