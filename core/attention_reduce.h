// Reductions of one layer's causal prefill attention, computed where the probabilities are (a
// device reduces them in its memory; only the reduced numbers cross to the host): column sums
// over chosen query rows, and how many of their entries fall below a share of their row's
// maximum. Methods score tokens and diagnostics measure sparsity through these instead of
// reading every head's T×T probabilities.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kvlens {

struct AttentionReduction {
  std::vector<int> queries;  // query rows, ascending and distinct, each < T
  // [n_heads][T]: Σ over the query rows i of P[h][i][j], added in double in ascending i from 0.0
  // (entries j > i are masked: 0). Null: not asked.
  double* column_sums = nullptr;
  // [n_heads]: the entries j ≤ i of the query rows i with P < p · (max over j ≤ i of the row), p
  // compared in double; with zeros_below, an entry equal to 0 counts too (at p = 0). Null: not asked.
  int64_t* below = nullptr;
  double p = 0.0;
  bool zeros_below = false;

  // The query rows [begin, end), clamped to [0, T).
  static std::vector<int> range(int begin, int end, int T);
  // Throws InternalError unless queries are ascending, distinct and in [0, T); `what` names the caller.
  void check(int T, const std::string& what) const;
  // A key for remembering results: the queries, what is asked and p.
  std::string key() const;
};

// The host reference: reduces causal probabilities P [n_heads][T][T] as `r` asks.
void reduce_attention(const float* P, int n_heads, int T, const AttentionReduction& r);

}  // namespace kvlens
