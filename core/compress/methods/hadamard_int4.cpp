// `hadamard_int4` (the slides' SAW-INT4): keys are rotated by a normalized block-diagonal
// Hadamard transform (blocks of `block` channels) and quantized to INT4 per token and KV head,
// asymmetric: scale = (max − min)/15, zero point = min, code = round((x − min)/scale) clamped to
// [0, 15] (the slides' scale = max(max − min, 1e-8)/15, zero = −min/scale is the same map).
// Values are quantized per token to INT4 too (quantize_v), optionally rotated first (rotate_v).
//
// The slides rotate the query to match the rotated keys: q·k = (Hq)·(Hk) since the normalized H
// is orthogonal. kvlens does the equivalent on the key side: the store keeps H·k̂_rot (H is its
// own inverse), so attention with the plain query gives q·(H k̂_rot) = (Hq)·k̂_rot, exactly the
// rotated-query product, and the model code needs no change. Rotated values are rotated back
// the same way (the slides rotate the attention output back instead; the result is the same).
#include <cstring>

#include "core/errors.h"
#include "core/compress/quant_methods.h"

namespace kvlens {

namespace {

class HadamardInt4Policy : public quant::SegmentQuantPolicy {
 public:
  HadamardInt4Policy(int block, bool quantize_v, bool rotate_v, bool visual_only)
      : SegmentQuantPolicy(visual_only), block_(block), quantize_v_(quantize_v), rotate_v_(rotate_v) {}
  std::string name() const override { return "hadamard_int4"; }
  // INT4 keys of the rotated row and INT4 values, a range per row: what a device does to each
  // new row inside its step (rotating the query once per step), when the values are quantized
  // unrotated and every token is in scope.
  StepQuant step_quant(int head_dim) const override {
    if (!quantize_v_ || rotate_v_ || visual_only_) return {};
    return StepQuant::rows(4, 4, quant::hadamard_block(block_, head_dim), "hadamard-int4");
  }
  // That layout (INT4 keys of rotated rows, INT4 values unrotated) is made where the rows are at
  // prefill (quant::quantize_rows_of with UniformSpec::rotation): no host rows are read, unless
  // the device will not rotate the query (rotated_keys).
  bool reads_rows() const override { return !device_layout(); }
  int rotated_keys(int head_dim) const override { return device_layout() ? block_of(head_dim) : 0; }
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    if (!device_layout()) return SegmentQuantPolicy::on_prefill_layer(ctx, layer);
    std::vector<quant::PendingPayload> done;
    quantize_layer(ctx, layer, false, done);
    store(done, ctx.head_dim);
  }
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& kv) override {
    if (!device_layout() || layers.empty()) return SegmentQuantPolicy::on_prefill(layers, kv);
    std::vector<quant::PendingPayload> done;
    quant::quantize_prefill(
        layers, kv, [&](const PrefillContext& c, LayerKV& l, bool later) { quantize_layer(c, l, later, done); },
        [&] { store(done, layers.front().head_dim); });
  }

 private:
  bool device_layout() const { return quantize_v_ && !rotate_v_ && !visual_only_; }
  // INT4 keys, a range per row of the row rotated by blocks of b channels (quantize_block rotates
  // back what it leaves in the rows).
  quant::UniformSpec key_spec(int b) const { return {4, quant::Axis::PerToken, 1.0f, true, 0, b}; }
  quant::UniformSpec key_spec() const { return key_spec(block_); }
  int block_of(int D) const {
    const int b = quant::hadamard_block(block_, D);  // auto: the slides' order 16, halved until it divides head_dim
    if (D % b != 0)
      throw InputError("hadamard_int4: block must divide head_dim " + std::to_string(D) + ", got " + std::to_string(b));
    return b;
  }
  void quantize_layer(const PrefillContext& ctx, LayerKV& layer, bool later, std::vector<quant::PendingPayload>& done) const {
    const int b = block_of(ctx.head_dim);
    for (KVSegment& s : layer.segments)
      if (in_scope(s))
        done.push_back(quant::quantize_rows_of(ctx, s, key_spec(b), {4, quant::Axis::PerToken}, later, "hadamard_int4"));
  }
  void store(std::vector<quant::PendingPayload>& done, int D) const {
    quant::PrefillQuantPolicy::install(done, int4_layout(block_of(D)), "hadamard-int4", 4);
  }
  // Per-token INT4 codes of keys rotated by blocks of b channels and of unrotated values: what a
  // device whose query is rotated reads directly.
  static quant::CodeLayout int4_layout(int b) {
    quant::CodeLayout l;
    l.kind = quant::CodeLayout::Kind::Blocks;
    l.k_bits = l.v_bits = 4;
    l.k_axis = l.v_axis = quant::Axis::PerToken;
    l.k_rotation = b;
    return l;
  }

  void quantize_segment(KVSegment& s, int D) override {
    block_ = block_of(D);
    const bool v_half = s.storage == "fp16";  // how unquantized values stay stored
    auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(s.heads.size()));
    for (size_t h = 0; h < s.heads.size(); ++h) {
      HeadRows& r = s.heads[h];
      const int n = r.n();
      quant::quantize_block(r.k.data(), n, D, key_spec(), p->k[h]);
      if (!quantize_v_) {
        // Values kept as the segment stored them: their halves (fp16) or floats (fp32) as codes.
        if (v_half) {
          p->v[h].codes.reserve(r.v.size() * 2);
          for (float x : r.v) {
            const uint16_t b = quant::to_half(x);
            p->v[h].codes.push_back(static_cast<uint8_t>(b & 0xffu));
            p->v[h].codes.push_back(static_cast<uint8_t>(b >> 8));
          }
        } else {
          p->v[h].codes.resize(r.v.size() * sizeof(float));
          std::memcpy(p->v[h].codes.data(), r.v.data(), p->v[h].codes.size());
        }
        continue;
      }
      quant::quantize_block(r.v.data(), n, D, {4, quant::Axis::PerToken, 1.0f, true, 0, rotate_v_ ? block_ : 0}, p->v[h]);
    }
    if (quantize_v_ && !rotate_v_) p->layout = int4_layout(block_);
    quant::set_quantized(s, p, quantize_v_ ? "hadamard-int4" : v_half ? "hadamard-int4 k, fp16 v" : "hadamard-int4 k, fp32 v", 4);
  }

  int block_;
  bool quantize_v_, rotate_v_;
};

}  // namespace

MethodSpec hadamard_int4_method() {
  MethodSpec m;
  m.name = "hadamard_int4";
  m.family = "quantization";
  m.summary = "Block-diagonal Hadamard rotation of keys, then per-token asymmetric INT4 K and V";
  m.params = {
      param::choice("block", {"auto", "8", "16", "32", "64", "128", "256"}, "auto",
                    "Hadamard block size B (divides head_dim; auto = 16 halved until it divides): k_rot = blockdiag(H_B/√B)·k"),
      param::flag("quantize_v", "on", "quantize V per token to INT4 too (off: V stays in the row storage, fp16 or fp32)"),
      param::flag("rotate_v", "off", "rotate V blocks before quantizing as well (rotated back after)"),
      param::choice("scope", {"all", "visual"}, "all", "which tokens to quantize: every kind, or visual only"),
  };
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    const int block = p.str("block") == "auto" ? 0 : std::stoi(p.str("block"));
    return std::make_unique<HadamardInt4Policy>(block, p.flag("quantize_v"),
                                                p.flag("rotate_v"), p.str("scope") == "visual");
  };
  return m;
}

}  // namespace kvlens
