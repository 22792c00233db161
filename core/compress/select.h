// The one shared top-k / gather helper of the eviction methods. A score-based method writes
// its per-token score (and, where the paper has one, its layer budgets); everything else —
// budget arithmetic, the recent window, deterministic top-k, keeping rows per KV head and
// recomputing byte counts — lives here, so every method evicts the same way.
//
// Conventions shared by every eviction method:
// - Budgets are fractions of the prompt's KV length T. A fraction f keeps floor(f·T) rows
//   (the `int(T·ratio)` of the papers' code), never fewer than 1 and never more than T.
// - At prefill each KV head of a layer holds exactly the T prompt rows, in prompt order
//   (segments in order, rows in order); row i is prompt token i.
// - A KV head's score is the mean over the query heads that share it (GQA: query head h uses
//   KV head h / (n_heads / n_kv_heads)).
// - Ties in a score go to the earlier token, so selection is deterministic.
// - Kept rows are exact copies of the originals unless a method merges into them (a merged row
//   of an fp16 segment is rounded to half precision again). A segment left with no rows in
//   every KV head is dropped; one that still has rows in some head stays (with empty HeadRows
//   where a head kept nothing of it). Bytes are recomputed as dense rows (2 or 4 B per value).
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "core/kv_store.h"
#include "core/compress/policy.h"

namespace kvlens {

// How many rows one layer keeps in each KV head, and how many of those are the recent window
// (the last `recent` prompt tokens, kept whatever their score).
struct LayerPlan {
  int keep = 0;
  int recent = 0;
};

// Budgets are fractions of the prompt in [kMinBudget, 1]: a budget of 0 is refused (it would
// keep nothing), and a positive budget whose floor(budget · T) is 0 keeps the minimum, one row
// per KV head and layer.
constexpr double kMinBudget = 0.001;

// floor(fraction · n) clamped to [1, n] (n ≥ 1). Throws InputError on a fraction outside
// [0, 1] or a non-finite one.
int budget_rows(double fraction, int n);

// A plan keeping `keep` rows of n with a recent window of `recent` rows, both clamped so that
// 1 ≤ keep ≤ n and 0 ≤ recent ≤ keep.
LayerPlan make_plan(int keep, int recent, int n);

// Indices of the `k` highest scores among the indices allowed by `allowed` (all when null),
// ties to the smaller index, returned in ascending order. k is clamped to the allowed count.
std::vector<int> top_k(const std::vector<double>& score, int k,
                       const std::vector<char>* allowed = nullptr);

// The rows a plan keeps out of n = score.size(): the last plan.recent rows plus the top
// (plan.keep − plan.recent) of the rows before them by score. Ascending.
std::vector<int> select_recent_topk(const std::vector<double>& score, const LayerPlan& plan);

// Column sums of the prefill probabilities over the query rows [q_begin, q_end), averaged over
// the query heads of KV head `kv_head`: out[j] = mean_{h in group} Σ_{i=q_begin}^{q_end−1}
// probs[h][i][j], for j in [0, T). Masked entries are 0 in probs, so this is causal.
std::vector<double> column_sums(const PrefillContext& c, int kv_head, int q_begin, int q_end);

// Checks what an eviction method relies on: consistent head counts, token kinds of length T,
// probs present when `needs_probs`, every KV head holding exactly T rows stored as fp32 or
// fp16. Throws InputError naming `method` and the layer.
void check_prefill(const std::string& method, const PrefillContext& c, const LayerKV& layer,
                   bool needs_probs);

// The rows of KV head h of one layer, concatenated over segments in order ([n][head_dim]).
void gather_head(const LayerKV& layer, int h, int head_dim, std::vector<float>& k,
                 std::vector<float>& v, std::vector<int32_t>& pos,
                 std::vector<SegmentKind>* kinds = nullptr);

// Has the attention of the contexts' layers (one PrefillAttention, one prompt) reduce every
// layer over the query rows [rows.first, rows.second) at once (PrefillAttention::prepare): the
// column sums, and the counts below below_p when it is ≥ 0. Nothing for fewer than two layers.
void prepare_layers(const std::vector<const PrefillContext*>& cs, std::pair<int, int> rows, double below_p = -1.0,
                    bool zeros_below = false);

// Keeps, in every KV head h, the rows keep[h] (ascending indices into the head's rows over all
// segments, as gather_head orders them). The kept rows' k/v are copied from the store, or from
// k[h]/v[h] ([n][head_dim], the head's gathered rows after a merge) when those are given.
// Drops segments left empty in every head and recomputes bytes (fp32 rows: dense_bytes(D, 4),
// fp16: dense_bytes(D, 2)); a segment stored otherwise (already quantized) throws InputError.
void keep_rows(const std::string& method, LayerKV& layer, int head_dim,
               const std::vector<std::vector<int>>& keep,
               const std::vector<std::vector<float>>* k = nullptr,
               const std::vector<std::vector<float>>* v = nullptr);

// Base of the score-based eviction methods. on_prefill plans every layer (plan()), scores every
// KV head (score()), selects (select(), by default recent window + top-k), optionally merges
// (merge()) and keeps the rows. A method only writes plan() and score().
class ScoreEvictPolicy : public KVPolicy {
 public:
  std::string name() const override { return name_; }
  bool needs_prefill_attention() const override { return true; }
  bool acts_on_decode() const override { return false; }  // every method evicts at prefill only
  // Selection reads attention and positions; a merge reads rows on the host only where the host
  // holds them (on a device cache it merges there, merge_layers).
  bool reads_rows() const override { return false; }
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) override;
  // One layer on its own: plans with {ctx} alone, so budgets that depend on every layer
  // (VL-Cache's sparsity allocation) degrade to the uniform budget. Prefer on_prefill.
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override;

  // What the last on_prefill decided, one entry per context given (for diagnostics).
  const std::vector<LayerPlan>& last_plans() const { return plans_; }

 protected:
  explicit ScoreEvictPolicy(std::string name) : name_(std::move(name)) {}
  // One plan per context, in the order given.
  virtual std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const = 0;
  // One score per prompt token for KV head `kv_head` (higher = more worth keeping).
  virtual std::vector<double> score(const PrefillContext& c, int kv_head) const = 0;
  // The query rows [first, second) over which score() reads column sums (column_sums), the same
  // for every layer of a prompt; an empty range when it reads none. on_prefill has every
  // layer's sums made ready at once (PrefillAttention::prepare) before the layers select.
  virtual std::pair<int, int> scored_rows(const PrefillContext& c) const { return {0, 0}; }
  // The rows to keep (ascending). Default: select_recent_topk(score, plan).
  virtual std::vector<int> select(const PrefillContext& c, int kv_head, const LayerPlan& plan,
                                  const std::vector<double>& score) const;
  // Whether merge_layers changes kept rows.
  virtual bool merges() const { return false; }
  // One layer's merge, once every KV head of it has selected: keep[h] the kept indices of head
  // h's rows (gather_head's order over `layer`, which still holds every prompt row). With k and
  // v (the heads' gathered rows [n][D]) the merge edits their kept rows, which keep_rows then
  // stores. Without (null: the rows are in the device cache alone, the layer's segments
  // layout_only) the method merges there through c->backend (kv_lookm_merge), and the next
  // kv_sync stores the merged rows.
  struct MergeJob {
    const PrefillContext* c = nullptr;
    const LayerKV* layer = nullptr;
    const std::vector<std::vector<int>>* keep = nullptr;
    std::vector<std::vector<float>>* k = nullptr;
    std::vector<std::vector<float>>* v = nullptr;
  };
  // Merges the layers of `jobs`: one job with host rows, or every layer whose rows are in the
  // device cache alone, at once (so a device merges them in one pass).
  virtual void merge_layers(const std::vector<MergeJob>& jobs) const {}

 private:
  // Scores and selects every KV head of each layer (keep[i][h]); a layer whose rows the host
  // holds is merged and kept at once, the others merged together afterwards, then kept.
  void compress_layers(const std::vector<const PrefillContext*>& cs, const std::vector<LayerPlan>& plans,
                       const std::vector<LayerKV*>& layers) const;
  std::vector<std::vector<int>> select_layer(const PrefillContext& c, const LayerPlan& plan, const LayerKV& layer) const;
  std::string name_;
  std::vector<LayerPlan> plans_;
};

}  // namespace kvlens
