// Shared pieces of the quantization policies: the uniform affine quantizer of the papers
// (CalibQuant Eq. 3/4, also KIVI's and ZipCache's), min/max along tokens or channels, the
// Hadamard transform, the Lloyd-Max codebook of a standard normal. The packed payload itself
// (codes, fp16 scales, layouts) is the bottom floor's core/kv_format.h, which kernels read too.
//
// Conventions every quantizing policy follows:
// - HeadRows.k/v of a quantized segment hold the dequantized rows as floats (what attention reads);
//   they equal, bit for bit, what decoding the payload gives.
// - Scales, zero points (α), norms and per-channel factors are stored as fp16 and the policy
//   quantizes with the fp16-rounded values, so the rows are exactly what the payload encodes.
// - segment.bytes = payload->allocated() (vector capacities, after shrink_to_fit) plus the
//   int32 positions (indices = 4 bytes per row).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/half.h"
#include "core/kv_format.h"
#include "core/kv_store.h"
#include "core/compress/policy.h"

namespace kvlens::quant {

// ---- uniform affine quantization (Eq. 3/4) ---------------------------------------------------
// x_dis = round((x − α)(2^b − 1)/(β − α)), clamped to [0, 2^b − 1]; 0 when β = α.
uint32_t quantize(float x, float alpha, float beta, int bits);
// x̂ = x_dis (β − α)/(2^b − 1) + α.
float dequantize(uint32_t code, float alpha, float beta, int bits);

// A range as stored: scale = (β − α)/(2^b − 1) and zero point α, both rounded to fp16.
struct Affine {
  float scale = 0, alpha = 0;
};
Affine make_affine(float alpha, float beta, int bits);
// round((x − α)/scale) clamped to [0, 2^b − 1]; 0 when scale = 0.
uint32_t encode(float x, const Affine& a, int bits);
inline float decode(uint32_t code, const Affine& a) { return static_cast<float>(code) * a.scale + a.alpha; }

// ---- ranges ---------------------------------------------------------------------------------
// Min and max of x[n][d]: one pair (Global), one per row (PerToken) or one per column
// (PerChannel).
void min_max(const float* x, int n, int d, Axis axis, std::vector<float>& lo,
             std::vector<float>& hi);

// Range shrinking (CalibQuant's official 1-bit setting): the bounds move towards a centre c by
// the factor s ∈ (0, 1]: lo ← c + s(lo − c), hi ← c + s(hi − c); c = 0 (about_zero, what the
// authors' code does: x_min·s, x_max·s) or c = (lo + hi)/2. s = 1 leaves the range as is.
void shrink_range(float& lo, float& hi, float s, bool about_zero);

// Uniform quantization of x[n][d] in place (x becomes its dequantization). Appends the packed
// codes and the fp16 scale/zero of each range to `out`. Global and PerChannel pack the block
// as one stream; PerToken packs each row on its own (row-aligned, so per-token blocks can be
// concatenated as tokens arrive). Ranges are shrunk by `shrink` (see shrink_range) first;
// values outside a shrunk range clamp to its ends.
// (UniformSpec: core/kv_format.h.)
void quantize_block(float* x, int n, int d, const UniformSpec& spec, QuantBlock& out);
// Bytes quantize_block appends for a block of n×d (codes; scale and zero count per range).
int64_t block_code_bytes(int n, int d, int bits, Axis axis);
int64_t block_ranges(int n, int d, Axis axis);

// ---- rotations --------------------------------------------------------------------------------
bool is_pow2(int n);
int next_pow2(int n);
// (quant::hadamard, the orthonormal Walsh–Hadamard transform: core/kv_format.h)
// Lloyd-Max scalar codebook of 2^bits levels for N(0, 1) (bits = 0 gives {0}), ascending;
// computed by Lloyd iterations from quantile initial levels until they move by < 1e-7.
std::vector<float> lloyd_max_normal(int bits);
// Index of the level nearest to x in an ascending codebook.
uint32_t nearest_level(const std::vector<float>& levels, float x);

// ---- per-row annotations (HeadRows::bits / merged) -----------------------------------------
// Every quantizing policy writes, for each row of a segment it quantizes, the bits its keys are
// stored with (32 fp32, 16 fp16, b for b-bit codes); dense segments a policy leaves alone stay
// unannotated (they read as their storage: fp32 32, fp16 16). `merged` is written by merging
// eviction (LOOK-M) and is only carried along here. An annotation is either empty or has one entry per row: the helpers below
// keep it so when they split, merge or quantize segments.
//
// The bits of row i: r.bits[i] when set (0 reads as 32), else `fallback` (the segment's).
inline int row_bits(const HeadRows& r, int i, int fallback) {
  if (i < 0 || static_cast<size_t>(i) >= r.bits.size()) return fallback;
  return r.bits[static_cast<size_t>(i)] ? r.bits[static_cast<size_t>(i)] : 32;
}
inline int row_merged(const HeadRows& r, int i) {
  return i >= 0 && static_cast<size_t>(i) < r.merged.size() ? r.merged[static_cast<size_t>(i)] : 0;
}
// Brings an annotation that is set but shorter than r.n() (rows appended since it was written)
// to r.n() entries: new rows get `bits` and 0 merged. Empty annotations stay empty.
void pad_annotations(HeadRows& r, int bits);

// ---- segments ---------------------------------------------------------------------------------
// Installs a payload: shrinks it, sets storage and bytes (payload + int32 positions) and the
// rows' bits: bits > 0 stores every row of every head with `bits`; bits = 0 means the caller
// wrote r.bits itself (one entry per row, else InternalError). `merged` is kept (padded with 0).
void set_quantized(KVSegment& s, std::shared_ptr<QuantPayload> p, const std::string& storage,
                   int bits);
// Splits layer.segments[i] (dense: fp32 or fp16) after cut[h] rows of each head h: rows
// [0, cut[h]) stay at i, the rest go to a new dense segment of the same kind and storage at
// i + 1. Row annotations are split with the rows.
void split_segment(LayerKV& layer, size_t i, const std::vector<int>& cut, int head_dim);
// Moves the last segment's rows, row annotations and payload onto the segment before it when
// both have the same kind and storage and both payloads are QuantPayload with row-aligned
// blocks (per-token formats); returns whether it merged. The previous segment's payload is
// cloned before it grows, so copies of the store that share it never see the change.
bool merge_last_into_previous(LayerKV& layer);
// Number of rows KV head h holds over all segments of `layer`.
int rows_in_head(const LayerKV& layer, int h);

// ---- quantizing a prompt's segments where their rows are -----------------------------------
// A segment quantized into a payload that the segment takes (set_quantized) once the codes are
// made (on the host, or deferred where they were made: QuantPayload::defer).
struct PendingPayload {
  KVSegment* s = nullptr;
  std::shared_ptr<QuantPayload> p;
};
// Segment s of ctx's layer quantized with ks / vs (quantize_block's codes and ranges): where its
// rows are when the segment is layout_only — on ctx's device, through Backend::quantize_rows
// (later: quantize_rows_later, the codes left there, deferred in the payload) —
// else on the host store's rows, heads in parallel. `method` names the policy in the error a
// backend that cannot quantize there gives.
PendingPayload quantize_rows_of(const PrefillContext& ctx, KVSegment& s, const UniformSpec& ks, const UniformSpec& vs,
                                bool later, const std::string& method);
// A prompt's layers quantized by quantize(ctx, layer, later), each segment's payload stored by
// store() once its codes are made: on a backend that queues its reductions every layer
// before one wait (later = true; the layers quantized before an error keep their payloads), else
// layer by layer (later = false, store() after each).
void quantize_prefill(const std::vector<PrefillContext>& layers, KVStore& kv,
                      const std::function<void(const PrefillContext&, LayerKV&, bool later)>& quantize,
                      const std::function<void()>& store);

// A policy that quantizes a prompt's segments where their rows are (quantize_rows_of): on a
// device the host store keeps the layout alone and every layer's segments are packed before one
// wait (quantize_prefill). A method writes which segments and how (quantize_layer, appending a
// pending payload for each) and how a payload is installed (store, which empties the list;
// install does it for one layout and label).
class PrefillQuantPolicy : public KVPolicy {
 public:
  bool reads_rows() const override { return false; }
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    std::vector<PendingPayload> done;
    quantize_layer(ctx, layer, false, done);
    store(done);
  }
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& kv) override {
    std::vector<PendingPayload> done;
    quantize_prefill(
        layers, kv, [&](const PrefillContext& c, LayerKV& l, bool later) { quantize_layer(c, l, later, done); },
        [&] { store(done); });
  }

 protected:
  virtual void quantize_layer(const PrefillContext& ctx, LayerKV& layer, bool later,
                              std::vector<PendingPayload>& done) const = 0;
  virtual void store(std::vector<PendingPayload>& done) const = 0;

 public:
  // Every pending segment takes its payload with `layout` (the payloads quantize_rows_of makes
  // carry none of their own) and `storage`, each row stored with `bits` (set_quantized); the list
  // empties.
  static void install(std::vector<PendingPayload>& done, const CodeLayout& layout, const std::string& storage, int bits) {
    for (const PendingPayload& q : done) {
      q.p->layout = layout;
      set_quantized(*q.s, q.p, storage, bits);
    }
    done.clear();
  }
};

// A policy that quantizes every dense segment in scope (all kinds, or visual only) at prefill,
// and each generated token as it arrives (scope "all"), appending it to the previous generated
// segment. Methods only write quantize_segment.
class SegmentQuantPolicy : public KVPolicy {
 public:
  explicit SegmentQuantPolicy(bool visual_only) : visual_only_(visual_only) {}
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    for (KVSegment& s : layer.segments)
      if (in_scope(s)) quantize_segment(s, ctx.head_dim);
  }
  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    if (visual_only_ || layer.segments.empty() || !in_scope(layer.segments.back())) return;
    quantize_segment(layer.segments.back(), ctx.head_dim);
    merge_last_into_previous(layer);
  }
  bool acts_on_decode() const override { return !visual_only_; }

 protected:
  virtual void quantize_segment(KVSegment& s, int head_dim) = 0;
  bool in_scope(const KVSegment& s) const {
    return s.dense() && (!visual_only_ || s.kind == SegmentKind::Visual);
  }
  bool visual_only_;
};

}  // namespace kvlens::quant
