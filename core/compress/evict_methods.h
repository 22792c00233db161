// The eviction / merge methods and the composition, one file each (core/compress/<name>.cpp),
// plus the paper formulas other code (diagnostics, tests) may reuse.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "core/compress/method.h"
#include "core/compress/policy.h"
#include "core/row_merge.h"

namespace kvlens {

MethodSpec vlcache_method();       // VL-Cache: sparsity-aware layer budgets, post-vision scores
MethodSpec lookm_method();         // LOOK-M: text-prior eviction + KV merging
MethodSpec h2o_method();           // H2O: accumulated-attention heavy hitters + recent window
MethodSpec snapkv_method();        // SnapKV: observation-window votes, pooled over keys
MethodSpec streamingllm_method();  // StreamingLLM: attention sinks + recent window
MethodSpec pyramidkv_method();     // PyramidKV: linearly decreasing layer budgets, SnapKV scores
MethodSpec stack_method();         // eviction/merge policy, then a quantization policy

// The eviction methods a stack may name (all of the above but stack), in registry order.
std::vector<MethodSpec> plain_eviction_methods();

// The schema of an eviction method: its name, summary and parameters, the first of them the
// budget every eviction method takes (a share of the prompt in [kMinBudget, 1], default 0.1,
// `budget_help` saying how the method spends it).
MethodSpec eviction_spec(std::string name, std::string summary, const std::string& budget_help,
                         std::vector<ParamSpec> more);

// ---- VL-Cache (core/compress/methods/vlcache.cpp) ----
// First post-vision prompt token: the one after the last visual token (0 when the prompt has
// no visual token). When the prompt ends with a visual token, the last prompt token stands in
// (τ = 1) so that A' is never empty.
int post_vision_begin(const PrefillContext& c);
// γ of query head h: the share of unmasked post-vision entries (i ≥ post_vision_begin, j ≤ i)
// with A'_ij < p · max_j A'_ij, i.e. zeroed by ThresholdFilter(A', p).
double post_vision_head_sparsity(const PrefillContext& c, int head, double p);
// γ(l): the mean of post_vision_head_sparsity over the query heads of layer c.
double post_vision_sparsity(const PrefillContext& c, double p);
// Algorithm 1: β(l) = clip((1 − γ(l)) / Z · α · L, 0.01, 1), Z = Σ_l (1 − γ(l)), L = gamma.size().
std::vector<double> sparsity_budgets(const std::vector<double>& gamma, double alpha);

// ---- SnapKV (core/compress/methods/snapkv.cpp), shared with PyramidKV ----
enum class Pooling { Max, Avg };
// Votes of the last `window` prompt queries for every prompt key of KV head `kv_head`
// (Σ over window rows of probs, mean over the head's query group), pooled over keys with a
// stride-1 window of `kernel` (odd) and same padding: max-pool ignores the padding, avg-pool
// divides by `kernel` (padding counts as 0). Only keys before the window are voted on; window
// keys score +inf, since the window is always kept.
std::vector<double> snapkv_scores(const PrefillContext& c, int kv_head, int window, int kernel,
                                  Pooling pooling);
// The query rows snapkv_scores sums over: the window, [T − min(window, T), T).
std::pair<int, int> snapkv_rows(const PrefillContext& c, int window);
// The parameters of SnapKV's selection (window, kernel, pooling), shared with PyramidKV.
std::vector<ParamSpec> snapkv_selection_params();
Pooling parse_pooling(const std::string& s);

// ---- PyramidKV (core/compress/methods/pyramidkv.cpp) ----
// Layer budgets for L layers with mean α: the last layer keeps α/β, the first 2α − α/β, linear in
// between (the PyramidKV schedule); when the first exceeds 1 it becomes 1 and the last 2α − 1,
// so the mean stays α.
std::vector<double> pyramid_budgets(int n_layers, double alpha, double beta);

// ---- LOOK-M (core/compress/methods/lookm.cpp) ----
// Merges the evicted rows of one head into the kept ones, in place. k, v: [n][d]; keep:
// ascending kept indices. Each evicted key e goes to the kept key c maximizing cos(k_e, k_c)
// (ties to the earlier kept row; a zero vector has similarity 0 to everything); with E_c the
// evicted rows assigned to c and L = |E_c|:
//   average  (Eq. 10): x_c ← (x_c + Σ_{e∈E_c} x_e) / (L + 1)
//   pivotal  (Eq. 11): x_c ← (x_c + ½ Σ_{e∈E_c} (x_e + x_c)) / (L + 1)
//   weighted (Eq. 12): x_c ← (x_c + Σ_{e∈E_c} s_ec · x_e) / (L + 1),  s_ec = cos(k_e, k_c)
// for x = k and x = v (the assignment and weights come from the keys only).
void lookm_merge(MergeKind kind, int d, const std::vector<int>& keep, std::vector<float>& k,
                 std::vector<float>& v);
// LOOK-M's assignment (Eq. 9) of one head: for each row e of k [n][d] that `keep` (ascending)
// does not list, in ascending e, the kept row c of largest cos(k_e, k_c) and that similarity s
// (dot products and norms added in double in ascending component order; a zero vector has
// similarity 0 to everything; ties to the earlier kept row). On `backend` where it has the op
// (Backend::cosine_assign), else on the host: the same numbers either way.
using LookMAssignment = RowAssignment;
std::vector<LookMAssignment> lookm_assign(int d, const std::vector<int>& keep, const std::vector<float>& k,
                                          Backend* backend = nullptr);
// The same for several heads at once (keep[h] for the rows k[h]): on `backend`, one call for all
// of them; on the host, head by head.
std::vector<std::vector<LookMAssignment>> lookm_assign_heads(int d, const std::vector<std::vector<int>>& keep,
                                                             const std::vector<std::vector<float>>& k,
                                                             Backend* backend = nullptr);
// The authors' similarity filter (merge_filter=above_mean / code): s[h][j] is the best cosine of
// KV head h's j-th evicted row (ascending); index j passes when the mean of s[·][j] over the
// heads that have a j-th row is ≥ the mean of every s[h][j].
std::vector<char> lookm_above_mean(const std::vector<std::vector<double>>& s);
// The contributions merged from a layer's assignments a[h] (each head's evicted rows in
// ascending order) under `spec` (Backend::kv_lookm_merge does the same where the cache is): all
// of them; with spec.above_mean only the indices j that lookm_above_mean passes, and with
// spec.prefix_sources for an average merge the f-th of those takes a[h][f]'s evicted row as its
// source (the authors' scatter of the unfiltered rows).
std::vector<std::vector<LookMAssignment>> lookm_contributions(std::vector<std::vector<LookMAssignment>> a,
                                                              const LookMMergeSpec& spec);

}  // namespace kvlens
