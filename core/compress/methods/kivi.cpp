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
// packed row by row. Rows are quantized where they are (on the device when the store holds
// only their layout, quant::quantize_rows_of).
#include <algorithm>

#include "core/compress/quant_methods.h"

namespace kvlens {

namespace {

class KiviPolicy : public quant::PrefillQuantPolicy {
 public:
  KiviPolicy(int bits, int group, int residual) : bits_(bits), G_(group), R_(residual) {}
  std::string name() const override { return "kivi"; }
  // The decode steps' action as data (StepQuant::group): with R >= 1 a step's quantized rows are
  // never its own, so a device may quantize them before it appends the row.
  StepQuant step_quant(int) const override {
    if (R_ < 1) return {};
    StepQuant q = StepQuant::rows(bits_, bits_, 0, label());
    q.group = G_;
    q.residual = R_;
    return q;
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
    for (int h = 0; h < H; ++h) {
      int tail = 0;
      for (size_t i = from; i < layer.segments.size(); ++i) tail += layer.segments[i].heads[h].n();
      take[h] = quantizable(tail);
    }
    PrefillContext c;  // (the rows are on the host while the hook runs)
    c.layer = ctx.layer;
    c.head_dim = ctx.head_dim;
    std::vector<quant::PendingPayload> done;
    quantize_prefix(c, layer, from, take, false, done);
    store(done);
  }

 private:
  // Rows of n that leave at least R dense rows, in whole groups.
  int quantizable(int n) const { return n > R_ ? (n - R_) / G_ * G_ : 0; }

  void quantize_layer(const PrefillContext& ctx, LayerKV& layer, bool later,
                      std::vector<quant::PendingPayload>& done) const override {
    if (layer.segments.empty()) return;
    const int H = static_cast<int>(layer.segments.front().heads.size());
    std::vector<int> take(H);
    for (int h = 0; h < H; ++h) take[h] = quantizable(quant::rows_in_head(layer, h));
    quantize_prefix(ctx, layer, 0, take, later, done);
  }
  void store(std::vector<quant::PendingPayload>& done) const override {
    quant::CodeLayout l;
    l.kind = quant::CodeLayout::Kind::Blocks;
    l.k_bits = l.v_bits = bits_;
    l.k_axis = quant::Axis::PerChannel;
    l.k_group = G_;
    l.v_axis = quant::Axis::PerToken;
    install(done, l, label(), bits_);
  }

  // The first take[h] dense rows of each head, walking segments from `from`, each segment's
  // share a piece of its own (split off where a head keeps rows of it), quantized where the rows
  // are: first every cut (segments are inserted), then the pieces.
  void quantize_prefix(const PrefillContext& ctx, LayerKV& layer, size_t from, std::vector<int> take, bool later,
                       std::vector<quant::PendingPayload>& done) const {
    std::vector<size_t> pieces;
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
        if (std::all_of(take.begin(), take.end(), [](int t) { return t <= 0; })) break;
        continue;
      }
      if (partial) quant::split_segment(layer, i, cut, ctx.head_dim);
      pieces.push_back(i);
      for (size_t h = 0; h < H; ++h) take[h] -= cut[h];
    }
    for (size_t i : pieces)
      done.push_back(quant::quantize_rows_of(ctx, layer.segments[i], {bits_, quant::Axis::PerChannel, 1.0f, true, G_},
                                             {bits_, quant::Axis::PerToken}, later, "kivi"));
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
