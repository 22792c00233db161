// `uniform`: plain uniform b-bit quantization (CalibQuant Eq. 3/4) with one range for the
// whole segment of a KV head (global), one per token or one per channel, chosen for K and V
// separately. Scope `visual` quantizes visual segments only.
//
// Ranges are taken per segment and KV head (a segment is one run of tokens of one kind).
// Decode-time tokens are quantized as they arrive when both K and V are per-token (a new row
// needs no statistics over other rows) and the scope is `all`; otherwise they stay dense (the
// cache's row storage). That step is also stated as data (step_quant), so a device backend
// quantizes each row inside its own decode step.
#include "core/compress/quant_methods.h"

namespace kvlens {

namespace {

// On a device the prompt's rows are quantized where they are (quant::PrefillQuantPolicy).
class UniformPolicy : public quant::PrefillQuantPolicy {
 public:
  UniformPolicy(int bits, quant::Axis k_axis, quant::Axis v_axis, bool visual_only)
      : bits_(bits), k_axis_(k_axis), v_axis_(v_axis), visual_only_(visual_only) {
    storage_ = "q" + std::to_string(bits) + " k:" + quant::axis_name(k_axis) +
               " v:" + quant::axis_name(v_axis);
  }
  std::string name() const override { return "uniform"; }

  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    if (visual_only_ || k_axis_ != quant::Axis::PerToken || v_axis_ != quant::Axis::PerToken) return;
    if (layer.segments.empty() || !in_scope(layer.segments.back())) return;
    quantize_segment(layer.segments.back(), ctx.head_dim);
    quant::merge_last_into_previous(layer);
  }
  bool acts_on_decode() const override {
    return !visual_only_ && k_axis_ == quant::Axis::PerToken && v_axis_ == quant::Axis::PerToken;
  }
  // Each new row's own range is all a step needs: a device quantizes it where it is appended.
  StepQuant step_quant(int) const override { return acts_on_decode() ? StepQuant::rows(bits_, bits_, 0, storage_) : StepQuant{}; }

 private:
  bool in_scope(const KVSegment& s) const {
    return s.dense() && (!visual_only_ || s.kind == SegmentKind::Visual);
  }
  void quantize_layer(const PrefillContext& ctx, LayerKV& layer, bool later,
                      std::vector<quant::PendingPayload>& done) const override {
    for (KVSegment& s : layer.segments)
      if (in_scope(s)) done.push_back(quant::quantize_rows_of(ctx, s, {bits_, k_axis_}, {bits_, v_axis_}, later, "uniform"));
  }
  // Each quantized segment takes its payload (its codes made, on the host or deferred); the list
  // empties.
  void store(std::vector<quant::PendingPayload>& done) const override {
    quant::CodeLayout l;
    l.kind = quant::CodeLayout::Kind::Blocks;
    l.k_bits = l.v_bits = bits_;
    l.k_axis = k_axis_;
    l.v_axis = v_axis_;
    install(done, l, storage_, bits_);
  }
  // A decode step's new row, on the host store's rows.
  void quantize_segment(KVSegment& s, int D) const {
    auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(s.heads.size()));
    for (size_t h = 0; h < s.heads.size(); ++h) {
      HeadRows& r = s.heads[h];
      quant::quantize_block(r.k.data(), r.n(), D, {bits_, k_axis_}, p->k[h]);
      quant::quantize_block(r.v.data(), r.n(), D, {bits_, v_axis_}, p->v[h]);
    }
    std::vector<quant::PendingPayload> done{{&s, std::move(p)}};
    store(done);
  }

  int bits_;
  quant::Axis k_axis_, v_axis_;
  bool visual_only_;
  std::string storage_;
};

}  // namespace

MethodSpec uniform_method() {
  const std::vector<std::string> axes = {"global", "per-token", "per-channel"};
  MethodSpec m;
  m.name = "uniform";
  m.family = "quantization";
  m.summary = "Uniform b-bit quantization with global, per-token or per-channel ranges";
  m.params = {
      param::choice("bits", {"1", "2", "3", "4", "8"}, "4",
                    "bits b per value: x_dis = round((x−α)(2^b−1)/(β−α)), x̂ = x_dis(β−α)/(2^b−1)+α"),
      param::choice("k_granularity", axes, "per-token",
                    "K range [α, β]: min/max over the segment (global), each token, or each channel"),
      param::choice("v_granularity", axes, "per-token",
                    "V range [α, β]: min/max over the segment (global), each token, or each channel"),
      param::choice("scope", {"all", "visual"}, "all",
                    "which segments to quantize: every kind, or visual tokens only"),
  };
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<UniformPolicy>(p.integer("bits"), quant::parse_axis(p.str("k_granularity")),
                                           quant::parse_axis(p.str("v_granularity")),
                                           p.str("scope") == "visual");
  };
  return m;
}

}  // namespace kvlens
