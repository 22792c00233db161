// A method wrapped to count its decode hook's calls, and to claim that hook acts at every step
// (so the decode loop keeps the host rows in step and calls it each layer and step) when
// `force_host` is set: the ways a method can decode, side by side.
#pragma once

#include <memory>

#include "core/compress/policy.h"

namespace kvlens::testing {

class PolicyProbe : public KVPolicy {
 public:
  PolicyProbe(std::unique_ptr<KVPolicy> inner, bool force_host) : in_(std::move(inner)), force_(force_host) {}
  std::string name() const override { return in_->name(); }
  bool needs_prefill_attention() const override { return in_->needs_prefill_attention(); }
  std::optional<RowStorage> row_storage() const override { return in_->row_storage(); }
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) override { in_->on_prefill(layers, store); }
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override { in_->on_prefill_layer(ctx, layer); }
  void on_decode_step(const DecodeContext& ctx, LayerKV& layer) override {
    ++decode_calls;
    in_->on_decode_step(ctx, layer);
  }
  bool acts_on_decode() const override { return force_ || in_->acts_on_decode(); }
  bool acts_at_step(const DecodeContext& ctx, const LayerKV& layer) const override {
    return force_ || in_->acts_at_step(ctx, layer);
  }
  // Forced to the host, the decode-time action has only the hook's form.
  StepQuant step_quant(int head_dim) const override { return force_ ? StepQuant{} : in_->step_quant(head_dim); }
  bool has_score_transform() const override { return in_->has_score_transform(); }
  void transform_scores(int layer, int head, float* scores, const SegmentKind* kinds, int n_k) const override {
    in_->transform_scores(layer, head, scores, kinds, n_k);
  }
  ScoreTransform score_transform() const override { return in_->score_transform(); }

  int decode_calls = 0;

 private:
  std::unique_ptr<KVPolicy> in_;
  bool force_;
};

}  // namespace kvlens::testing
