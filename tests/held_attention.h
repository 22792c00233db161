// A PrefillAttention over probabilities a test holds itself ([n_heads][T][T] per layer), for
// policy and diagnostic tests that build their contexts by hand. It reads the test's arrays as
// they are when asked (a test may change a row after making its contexts).
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "core/prefill_attention.h"

namespace kvlens::testing {

class HeldAttention final : public PrefillAttention {
 public:
  // layer(l): the test's probabilities of layer l, or null for none.
  HeldAttention(int n_layers, int n_heads, int prompt_len, std::function<const std::vector<float>*(int)> layer)
      : n_layers_(n_layers), n_heads_(n_heads), T_(prompt_len), layer_(std::move(layer)) {}
  // Over [layer][n_heads][T][T].
  HeldAttention(const std::vector<std::vector<float>>& probs, int n_heads, int prompt_len)
      : HeldAttention(static_cast<int>(probs.size()), n_heads, prompt_len,
                      [&probs](int l) { return &probs.at(static_cast<size_t>(l)); }) {}

  int n_layers() const override { return n_layers_; }
  int n_heads() const override { return n_heads_; }
  int prompt_len() const override { return T_; }
  std::shared_ptr<const std::vector<float>> probs(int layer) const override {
    const std::vector<float>* p = layer_(layer);
    // Not owned: the test's array outlives every caller.
    return p ? std::shared_ptr<const std::vector<float>>(std::shared_ptr<const std::vector<float>>(), p) : nullptr;
  }
  int64_t capture_bytes() const override { return 0; }
  int64_t cached_bytes() const override { return 0; }
  // Every prepare and reduce asked of it, in order (reductions are made anew each time).
  struct Asked {
    bool prepare = false;
    std::vector<int> layers, queries;  // (a reduction: its layer)
    bool below = false;                // counts asked for (prepare: below_p >= 0), at p
    double p = 0;
    bool zeros_below = false;
    int call = 0;  // the prepare or reduce call it came in (a prepare's row sets share one)
  };
  std::vector<Asked> asked() const {
    std::lock_guard<std::mutex> lock(mu_);
    return asked_;
  }
  void reduce(int layer, const AttentionReduction& r) const override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      asked_.push_back(Asked{false, {layer}, r.queries, r.below != nullptr, r.p, r.zeros_below, calls_++});
    }
    PrefillAttention::reduce(layer, r);
  }
  using PrefillAttention::prepare;
  void prepare(const std::vector<int>& layers, const std::vector<QueryRows>& sets) const override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const QueryRows& q : sets)
      asked_.push_back(Asked{true, layers, q.queries, q.below_p >= 0, q.below_p, q.zeros_below, calls_});
    ++calls_;
  }

 private:
  mutable std::mutex mu_;
  mutable std::vector<Asked> asked_;
  mutable int calls_ = 0;
  int n_layers_, n_heads_, T_;
  std::function<const std::vector<float>*(int)> layer_;
};

}  // namespace kvlens::testing
