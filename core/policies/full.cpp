// `full`: the reference every diagnostic compares against. fp32 leaves the store untouched (the
// model output is bit-identical to running without a policy); fp16 rounds every row to half
// precision (round to nearest even) and stores the 2-byte halves.
#include "core/policies/quant_methods.h"

namespace kvlens {

namespace {

// Rounds a segment's rows to fp16 and keeps the halves as its payload (2 bytes per value).
void round_segment_to_fp16(KVSegment& s) {
  auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(s.heads.size()));
  for (size_t h = 0; h < s.heads.size(); ++h)
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<float>& x = kv ? s.heads[h].v : s.heads[h].k;
      std::vector<uint8_t>& out = kv ? p->v[h].codes : p->k[h].codes;
      out.reserve(x.size() * 2);
      for (float& f : x) {
        const uint16_t b = quant::to_half(f);
        f = quant::from_half(b);
        out.push_back(static_cast<uint8_t>(b & 0xffu));
        out.push_back(static_cast<uint8_t>(b >> 8));
      }
    }
  p->layout.kind = quant::CodeLayout::Kind::Fp16;
  quant::set_quantized(s, p, "fp16", 16);
}

class FullPolicy : public KVPolicy {
 public:
  explicit FullPolicy(bool fp16) : fp16_(fp16) {}
  std::string name() const override { return "full"; }
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    if (!fp16_) return;
    for (KVSegment& s : layer.segments)
      if (s.storage == "fp32") round_segment_to_fp16(s);
  }
  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    if (!fp16_ || layer.segments.empty() || layer.segments.back().storage != "fp32") return;
    round_segment_to_fp16(layer.segments.back());
    quant::merge_last_into_previous(layer);
  }

 private:
  bool fp16_;
};

}  // namespace

MethodSpec full_method() {
  MethodSpec m;
  m.name = "full";
  m.family = "reference";
  m.summary = "No compression: the reference every diagnostic compares against";
  m.params = {param::choice("storage", {"fp32", "fp16"}, "fp32",
                            "row storage: fp32 = untouched (4 B/value), fp16 = x̂ = half(x) (2 B/value)")};
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<FullPolicy>(p.str("storage") == "fp16");
  };
  return m;
}

}  // namespace kvlens
