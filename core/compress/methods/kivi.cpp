// `kivi` (KIVI): keys quantized per channel within groups of G consecutive tokens, values per
// token, both with b bits; the R most recent tokens stay dense (the cache's row storage, fp16
// by default).
//
// Layout in the store, per KV head: the first n_q = floor((n − R)/G)·G rows of the layer are
// quantized at prefill and the rest (R ≤ rest < R + G) stay dense. During decode new tokens stay
// dense until the dense tail holds R + G rows; then its oldest G rows are quantized (streaming),
// so the last R tokens are never quantized. Groups never cross a segment boundary (a segment has
// one token kind): where the quantized span crosses one, the group is cut there and the piece
// gets its own per-channel range. Each group is packed on its own (byte-aligned); V rows are
// packed row by row.
#include <algorithm>

#include "core/compress/quant_methods.h"

namespace kvlens {

namespace {

class KiviPolicy : public KVPolicy {
 public:
  KiviPolicy(int bits, int group, int residual) : bits_(bits), G_(group), R_(residual) {}
  std::string name() const override { return "kivi"; }
  // The decode steps' action as data (StepQuant::group): with R >= 1 a step's quantized rows are
  // never its own, so a device may quantize them before it appends the row.
  StepQuant step_quant(int) const override {
    if (R_ < 1) return {};
    return {bits_, bits_, 0, label(), G_, R_};
  }

  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    if (layer.segments.empty()) return;
    const int H = static_cast<int>(layer.segments.front().heads.size());
    std::vector<int> take(H);
    for (int h = 0; h < H; ++h) take[h] = quantizable(quant::rows_in_head(layer, h));
    quantize_prefix(layer, 0, take, ctx.head_dim);
  }

  // Before the new row: the trailing dense rows of a head, plus that row, are on_decode_step's
  // tail; it acts where some head's tail leaves more than R rows in whole groups.
  bool acts_at_step(const DecodeContext& ctx, const LayerKV& layer) const override {
    const size_t H = layer.segments.empty() ? 0 : layer.segments.front().heads.size();
    for (size_t h = 0; h < H; ++h) {
      int tail = 1;
      for (size_t i = layer.segments.size(); i > 0 && layer.segments[i - 1].dense(); --i)
        tail += layer.segments[i - 1].heads[h].n();
      if (quantizable(tail) > 0) return true;
    }
    return false;
  }

  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    if (layer.segments.empty()) return;
    size_t from = layer.segments.size();
    while (from > 0 && layer.segments[from - 1].dense()) --from;
    if (from == layer.segments.size()) return;
    const int H = static_cast<int>(layer.segments.front().heads.size());
    std::vector<int> take(H, 0);
    bool any = false;
    for (int h = 0; h < H; ++h) {
      int tail = 0;
      for (size_t i = from; i < layer.segments.size(); ++i) tail += layer.segments[i].heads[h].n();
      take[h] = quantizable(tail);
      any = any || take[h] > 0;
    }
    if (any) quantize_prefix(layer, from, take, ctx.head_dim);
  }

 private:
  // Rows of n that leave at least R dense rows, in whole groups.
  int quantizable(int n) const { return n > R_ ? (n - R_) / G_ * G_ : 0; }

  // Quantizes the first take[h] dense rows of each head, walking segments from `from`.
  void quantize_prefix(LayerKV& layer, size_t from, std::vector<int> take, int D) const {
    for (size_t i = from; i < layer.segments.size(); ++i) {
      if (!layer.segments[i].dense()) continue;
      const size_t H = layer.segments[i].heads.size();
      std::vector<int> cut(H);
      bool any = false, partial = false;
      for (size_t h = 0; h < H; ++h) {
        const int n = layer.segments[i].heads[h].n();
        cut[h] = std::min(take[h], n);
        any = any || cut[h] > 0;
        partial = partial || cut[h] < n;
      }
      if (!any) {
        bool more = false;
        for (int t : take) more = more || t > 0;
        if (!more) return;
        continue;
      }
      if (partial) quant::split_segment(layer, i, cut, D);
      quantize_piece(layer.segments[i], D);
      for (size_t h = 0; h < H; ++h) take[h] -= cut[h];
    }
  }

  void quantize_piece(KVSegment& s, int D) const {
    auto p = std::make_shared<quant::QuantPayload>(static_cast<int>(s.heads.size()));
    for (size_t h = 0; h < s.heads.size(); ++h) {
      HeadRows& r = s.heads[h];
      for (int g = 0; g < r.n(); g += G_)
        quant::quantize_block(r.k.data() + static_cast<size_t>(g) * D, std::min(G_, r.n() - g), D,
                              {bits_, quant::Axis::PerChannel}, p->k[h]);
      quant::quantize_block(r.v.data(), r.n(), D, {bits_, quant::Axis::PerToken}, p->v[h]);
    }
    p->layout.kind = quant::CodeLayout::Kind::Blocks;
    p->layout.k_bits = p->layout.v_bits = bits_;
    p->layout.k_axis = quant::Axis::PerChannel;
    p->layout.k_group = G_;
    p->layout.v_axis = quant::Axis::PerToken;
    quant::set_quantized(s, p, label(), bits_);
  }

  std::string label() const { return "kivi q" + std::to_string(bits_); }

  int bits_, G_, R_;
};

}  // namespace

MethodSpec kivi_method() {
  MethodSpec m;
  m.name = "kivi";
  m.family = "quantization";
  m.summary = "KIVI: K per-channel in groups of G tokens, V per-token, last R tokens unquantized";
  m.params = {
      param::choice("bits", {"2", "4"}, "2",
                    "bits b: x_dis = round((x−α)(2^b−1)/(β−α)); K ranges per channel and group, V per token"),
      param::integer("group", 1, 4096, "32",
                     "G: tokens per key group; each group has its own per-channel [α, β]"),
      param::integer("residual", 0, 4096, "32",
                     "R: the most recent R tokens stay unquantized (row storage); quantized = floor((n−R)/G)·G oldest"),
  };
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<KiviPolicy>(p.integer("bits"), p.integer("group"), p.integer("residual"));
  };
  return m;
}

}  // namespace kvlens
