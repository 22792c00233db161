// Diagnostics that compare a compressed KV cache against the full one on the same prefill:
// score histograms (exact / quantized / calibrated), softmax MSE and KL, attention-output
// error, sparsity, CacheHitRate of scoring strategies, token fate over the patch grid, and the
// first divergence of the greedy output.
#pragma once
#include <mutex>
#include <array>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/kv_store.h"
#include "core/observer.h"
#include "core/compress/policy.h"

namespace kvlens {

// What the diagnostics compare against: what the prefill left behind.
struct PrefillView {
  const KVStore* full = nullptr;                     // full-precision store after prefill
  const PrefillAttention* attention = nullptr;       // the prompt's attention, a layer at a time
  const std::vector<SegmentKind>* kinds = nullptr;   // [T]
  int n_heads = 0;
  int prompt_len = 0;
};

// The first decode step's pre-softmax scores of one layer's visual keys, per query head: exact
// (the full-precision keys), quantized (the keys the method stores, before any score transform)
// and calibrated (after the method's score transform: what the softmax saw). [head][key]; the
// keys of a head are those its KV head kept, for all three (an evicted key has no quantized
// score, so its exact one is left out too). `every`: the exact scores of every visual key, kept
// or not, which set the histogram's range (so that a method that kept none still has bins, over
// the range of the keys it dropped).
struct VisualScores {
  std::vector<std::vector<float>> exact, quantized, calibrated, every;
};

// One decode query of a method compared with its exact attention (core/exact_attention.h), per
// query head: the terms compare_layers averages (see LayerDiagnostics), and with `visual` the
// visual keys' scores of VisualScores.
struct QueryComparison {
  std::vector<double> softmax_mse, softmax_kl, output_rel_error;  // [n_heads]
  VisualScores visual;
};
// e: the method's decode event. Its quantized scores and output come from e.k / e.v when the
// event has rows (the reference), else from e.raw_scores / e.out. kinds: the prompt's [T].
QueryComparison compare_query(const AttentionEvent& e, const ExactAttention& x, const std::vector<SegmentKind>& kinds,
                              bool visual);

// Keeps the decode-phase attention events of one run (steps < max_steps).
class DecodeRecorder : public AttentionObserver {
 public:
  struct Entry {
    int step = 0, layer = 0, n_heads = 0, n_kv_heads = 0, n_k = 0, head_dim = 0;
    int32_t query_pos = 0;
    std::vector<float> scores, probs;   // [n_heads][n_k]
    std::vector<float> q;               // [n_heads][head_dim]
    std::vector<float> k, v;            // [n_kv_heads][n_k][head_dim]
    std::vector<int32_t> key_pos;       // [n_kv_heads][n_k], -1 = padding
    std::vector<SegmentKind> key_kind;  // [n_kv_heads][n_k]
    bool compared = false;              // a comparing recorder's entry: `comparison` holds it
    QueryComparison comparison;
  };
  // Records decode steps 0 .. max_steps − 1; with keep_rows false, without the keys and values
  // (enough for probabilities, hit rates and sparsity).
  explicit DecodeRecorder(int max_steps, bool keep_rows = true) : max_steps_(max_steps), keep_rows_(keep_rows) {}
  // Records them compared with `pv` as they come (compare_query; the visual scores at step 0),
  // keeping no rows: what compare_layers reads. A device that computes the exact attention
  // from pv's capture hands over no rows at all; otherwise the event's rows are compared with
  // pv's full store on the host.
  DecodeRecorder(int max_steps, const PrefillView& compare_to)
      : max_steps_(max_steps), keep_rows_(false), compare_(true), pv_(compare_to) {}
  // Records only `steps` (each in 0 .. max_steps − 1) instead of every step below max_steps:
  // the steps between are not observed (on a device they run as plain steps).
  void record_only(const std::vector<int>& steps);
  void on_attention(const AttentionEvent& e) override;
  int decode_steps() const override { return max_steps_; }
  bool reads_step(int step) const override {
    return step >= 0 && step < max_steps_ && (only_.empty() || only_[static_cast<size_t>(step)]);
  }
  bool reads_decode_kv() const override { return keep_rows_ || compare_; }
  const PrefillAttention* compares_to() const override { return compare_ ? pv_.attention : nullptr; }
  bool takes_concurrent_events() const override { return true; }  // entries kept in (step, layer) order
  bool keeps_rows() const { return keep_rows_; }
  bool compares() const { return compare_; }
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(int step, int layer) const;
  int steps() const;

 private:
  int max_steps_;
  bool keep_rows_;
  bool compare_ = false;
  PrefillView pv_;
  std::vector<char> only_;  // [max_steps]: the steps recorded; empty = all
  std::mutex mu_;            // entries_ while events of several layers come at once
  std::vector<Entry> entries_;
};

// Keeps, for every decode step, each query head's attention over the visual tokens, indexed by
// visual token (0 where the store no longer holds the token): the overlay of one generated
// token's attention on the patch grid.
class VisualAttentionRecorder : public AttentionObserver {
 public:
  VisualAttentionRecorder(int first_visual, int n_visual) : first_(first_visual), n_visual_(n_visual) {}
  void on_attention(const AttentionEvent& e) override;
  bool reads_decode_kv() const override { return false; }
  bool reads_probabilities_only() const override { return true; }
  bool takes_concurrent_events() const override { return true; }
  Span reads_span() const override { return {first_, n_visual_}; }
  void on_span_attention(int step, int layer, int n_heads, const float* sums) override;
  int steps() const { return static_cast<int>(rows_.size()); }
  int n_visual() const { return n_visual_; }
  // [n_visual] for one step, layer and head; head = -1 gives the mean over heads. Empty when
  // that step or layer was not seen.
  std::vector<float> attention(int step, int layer, int head) const;

 private:
  int first_, n_visual_;
  int n_heads_ = 0;
  std::mutex mu_;  // rows_ while events of several layers come at once
  std::vector<std::vector<std::vector<float>>> rows_;  // [step][layer][head × n_visual]
  void keep(int step, int layer, int n_heads, std::vector<float> row);
};

// Mean over query heads of the decode attention of steps < `steps` at `layer`, by key position:
// [steps][n_cols] (keys at positions >= n_cols, and padding, are dropped).
std::vector<float> decode_attention_rows(const DecodeRecorder& rec, int layer, int steps, int n_cols);

struct ScoreHistogram {
  double lo = 0, hi = 0;
  std::vector<int64_t> exact, quantized, calibrated;  // same bin edges
};

// Histograms of the visual scores on shared bins over all three kinds: one query head
// (head >= 0) or all heads pooled (head = -1).
ScoreHistogram visual_score_histogram(const VisualScores& s, int head, int bins);
// The same scores with the calibrated ones recomputed by `policy`'s score transform from the
// stored quantized scores, without decoding again (exact and quantized are kept). Holds for
// transforms that read only the visual keys' scores, as CalibQuant's g(x) does; a policy with no
// transform gives calibrated = quantized.
VisualScores retransform_visual_scores(const VisualScores& s, int layer, const KVPolicy& policy);
// γ and δ of each query head: the range of its quantized visual scores, which CalibQuant's g(x)
// maps onto [γ − τ1, δ − τ2] (0 and 0 for a head without any).
struct ScoreRanges {
  std::vector<double> gamma, delta;
};
ScoreRanges score_range_by_head(const VisualScores& s);

// Each decode query of the method is compared with the exact attention of the same query over
// the full-precision prompt (and the method's generated rows): P_full over those keys, P_method
// the method's probabilities summed by position (0 for an evicted key). Means over query heads
// and the recorded decode steps:
//   softmax_mse      = mean_j (P_full(j) − P_method(j))², j over the exact keys
//   softmax_kl       = KL(P_full ‖ P_method) = Σ_j P_full(j) · ln(P_full(j) / max(P_method(j), 1e-10)):
//                      the full cache is the reference distribution; an evicted key counts with
//                      P_method clamped at 1e-10
//   output_rel_error = ‖o_method − o_full‖₂ / ‖o_full‖₂ (a norm ratio), o = Σ_j P(j) v_j with the
//                      method's stored values for o_method and the exact values for o_full
//   sparsity_decode  = share of the method's attention entries below p · (row max)
// The histogram uses the first decode step: pre-softmax scores q·k/√d of the visual keys,
// exact (full keys), quantized (the method's keys) and calibrated (the scores the method's
// attention used, after any score transform), counted in bins over one shared [lo, hi].
struct LayerDiagnostics {
  int layer = 0;
  double softmax_mse = 0, softmax_kl = 0, output_rel_error = 0;  // mean over heads and steps
  double sparsity_decode = 0;                                     // this method's decode attention
  ScoreHistogram visual_scores;                                   // first decode step, visual keys
  VisualScores visual_score_samples;                              // the scores behind it, per head
  std::vector<float> fate_kept;   // per visual token: share of KV heads that keep it
  std::vector<float> fate_bits;   // per visual token: mean bits of kept rows (32 = fp32; 0 = no head keeps it)
  std::vector<float> fate_merged; // per visual token: mean rows merged into it
  KVBytes bytes;                  // after prefill compression
};

struct FirstDivergence {
  int position = -1;  // index into the generated ids; -1 = identical
  int full_token = -1, method_token = -1;
  float full_prob = 0, method_prob = 0;
};

// γ = share of attention entries below p · (row max) among unmasked entries, averaged over heads.
double sparsity(const float* probs, int n_heads, int n_q, int n_k, double p);
double prefill_sparsity(const PrefillView& pv, int layer, double p);
// prefill_sparsity of every layer, in order: the counts of all layers prepared first (a capture
// on a device reduces them in one pass with one wait, not one a layer).
std::vector<double> prefill_sparsities(const PrefillView& pv, double p);
// Each of n_layers layers' decode sparsity, the mean in step order of sparsity() over the
// recorded steps below `steps` (0 for a layer with none), the layers side by side on the team.
std::vector<double> decode_sparsities(const DecodeRecorder& rec, int n_layers, int steps, double p);

// `method` either keeps rows or compares (its entries then hold the comparisons).
std::vector<LayerDiagnostics> compare_layers(const PrefillView& pv, const DecodeRecorder& method,
                                             const KVStore& compressed, int hist_bins, double p);

FirstDivergence first_divergence(const std::vector<int>& full_ids, const std::vector<float>& full_probs,
                                 const std::vector<int>& ids, const std::vector<float>& probs);

// CacheHitRate of each scoring strategy (VL-Cache §3.2): |S_ψ,k ∩ S_ψ*,k| / k, where S_ψ,k is
// the top k prompt tokens by the strategy's score ψ and S_ψ*,k the top k by the true attention
// of the full cache's decode query at step s over the prompt keys, A_{m+1} = softmax(q K_{:m}ᵀ/√d):
// each query head's probabilities of the prompt keys renormalised to sum to 1 (the decode query
// also sees the generated keys). k = budget_rows(budget, prompt_len) (floor, at least 1: the rows
// an eviction policy at that budget keeps). Strategies score a key by the prefill attention it
// receives: accumulated (all queries), normalized (all queries, divided by the n_j = T − j
// queries that can see key j), sliding_window (the last `window_queries` queries), post_vision
// (the queries after the last visual token), and recency (position only, as StreamingLLM keeps
// tokens). Top-k ties go to the earlier token, as the selection code's top_k.
// Two rates, each [strategy][step index][layer]:
// - rates (layer level, VL-Cache's definition, whose formulas omit heads): ψ and ψ* are the means
//   over every query head of the layer; one top-k each.
// - rates_head (per KV head): ψ and ψ* are the means over the query heads sharing one KV head
//   (what an eviction policy ranks when it keeps rows per KV head); one top-k each per KV head,
//   the rate averaged over the KV heads.
struct HitRates {
  std::vector<std::string> strategies;
  std::vector<int> steps;
  int k = 0;
  std::vector<std::vector<std::vector<double>>> rates, rates_head;
};
HitRates cache_hit_rates(const PrefillView& pv, const DecodeRecorder& full, double budget,
                         const std::vector<int>& steps, int window_queries = 32);
// The truth side of cache_hit_rates, which reads no prefill attention (so it can run while a
// device reduces the prefill): k, the recorded steps among `steps`, and for each step and layer
// the top k prompt keys by the full cache's decode attention, layer[step][layer] and per KV head
// head[step][layer][kv head] (ascending).
struct HitTruth {
  int k = 0;
  std::vector<int> steps;
  std::vector<std::vector<std::vector<int>>> layer;
  std::vector<std::vector<std::vector<std::vector<int>>>> head;
};
HitTruth hit_rate_truth(const PrefillView& pv, const DecodeRecorder& full, double budget, const std::vector<int>& steps);
// cache_hit_rates from its truth side made before.
HitRates cache_hit_rates(const PrefillView& pv, const HitTruth& truth, int window_queries = 32);
// The first query row of each set of queries the strategies of cache_hit_rates sum the prefill
// attention over, to the prompt's end: every row (accumulated, and from it normalized), the last
// `window_queries` (sliding_window), the rows after the last visual token (post_vision; the last
// row when none follow it).
std::array<int, 3> hit_rate_query_starts(const PrefillView& pv, int window_queries);
// Every layer's reductions that prefill_sparsities(pv, p) and cache_hit_rates(pv, ..,
// window_queries) read, prepared at once (PrefillAttention::prepare: on a device, each layer's
// queries and keys recomputed once for all of them, one wait).
void prepare_prefill_diagnostics(const PrefillView& pv, double p, int window_queries);

// The definitions above as one line each, keyed like the report's fields (the report carries
// them, so a reader of the JSON knows e.g. which distribution KL takes as reference).
nlohmann::json diagnostic_definitions();

nlohmann::json to_json(const LayerDiagnostics& d);
nlohmann::json to_json(const HitRates& h);
nlohmann::json to_json(const KVBytes& b);

}  // namespace kvlens
