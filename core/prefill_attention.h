// The prompt's attention of one layer, recomputed on demand from what prefill captured (each
// layer's q/k/v projection input, from which its post-RoPE queries, keys and values are
// recomputed: O(layers · tokens · hidden)) instead of held for every layer: no [layers][heads][T][T] array exists anywhere. Methods that score tokens and the
// diagnostics read one layer at a time (having asked to prepare every layer's reductions, which
// a capture on a device makes in one pass); a few recent layers are kept for a caller that asks
// again.
#pragma once
#include <memory>
#include <numeric>
#include <vector>

#include "core/attention_reduce.h"

namespace kvlens {

class PrefillAttention {
 public:
  virtual ~PrefillAttention() = default;
  virtual int n_layers() const = 0;
  virtual int n_heads() const = 0;
  virtual int prompt_len() const = 0;
  // Causal attention probabilities [n_heads][T][T] of `layer` (masked entries 0), the same values
  // the prefill's attention computed; shared with the caller while it holds them. Thread-safe.
  virtual std::shared_ptr<const std::vector<float>> probs(int layer) const = 0;
  // Reduces `layer`'s probabilities as `r` asks (core/attention_reduce.h). The default reduces
  // probs(layer) on the host; a capture on a device reduces them there. Thread-safe.
  virtual void reduce(int layer, const AttentionReduction& r) const {
    const auto p = probs(layer);
    reduce_attention(p->data(), n_heads(), prompt_len(), r);
  }
  // The column sums over the query rows `queries` of `layer` (AttentionReduction::column_sums,
  // [n_heads][T]), shared with the caller: a capture that keeps its reductions hands out the
  // array it keeps, so a method that scores each KV head in turn copies nothing. The default
  // reduces anew. Thread-safe.
  virtual std::shared_ptr<const std::vector<double>> column_sums(int layer, const std::vector<int>& queries) const {
    auto s = std::make_shared<std::vector<double>>(static_cast<size_t>(n_heads()) * prompt_len());
    AttentionReduction r;
    r.queries = queries;
    r.column_sums = s->data();
    reduce(layer, r);
    return s;
  }
  // One set of query rows whose reductions prepare makes ready: the column sums over `queries`,
  // and with below_p ≥ 0 the counts below that share of the row's maximum (zeros_below as
  // AttentionReduction has it).
  struct QueryRows {
    std::vector<int> queries;
    double below_p = -1.0;
    bool zeros_below = false;
  };
  // Makes each of `layers`' reductions over each of `sets` ready for reduce and column_sums. A
  // capture on a device recomputes each layer's queries and keys once for all the sets and
  // reduces every layer and set in one pass with one wait, where a layer at a time would wait
  // once per layer; a method or a diagnostic that reads every layer asks this first. The default
  // does nothing. Thread-safe.
  virtual void prepare(const std::vector<int>& layers, const std::vector<QueryRows>& sets) const {}
  // prepare of one set.
  void prepare(const std::vector<int>& layers, const std::vector<int>& queries, double below_p = -1.0,
               bool zeros_below = false) const {
    prepare(layers, std::vector<QueryRows>{QueryRows{queries, below_p, zeros_below}});
  }
  // prepare for every layer.
  void prepare_every_layer(const std::vector<QueryRows>& sets) const {
    std::vector<int> layers(static_cast<size_t>(n_layers()));
    std::iota(layers.begin(), layers.end(), 0);
    prepare(layers, sets);
  }
  void prepare_every_layer(const std::vector<int>& queries, double below_p = -1.0, bool zeros_below = false) const {
    prepare_every_layer(std::vector<QueryRows>{QueryRows{queries, below_p, zeros_below}});
  }
  // Bytes the capture holds (every layer's projection input and the queries, keys and values it
  // keeps recomputed, in the backend's memory), and of the probabilities it keeps for callers now
  // (host memory).
  virtual int64_t capture_bytes() const = 0;
  virtual int64_t cached_bytes() const = 0;
};

}  // namespace kvlens
