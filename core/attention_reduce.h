// Reductions of one layer's causal prefill attention, computed where the probabilities are (a
// device reduces them in its memory; only the reduced numbers cross to the host): column sums
// over chosen query rows, and how many of their entries fall below a share of their row's
// maximum. Methods score tokens and diagnostics measure sparsity through these instead of
// reading every head's T×T probabilities.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
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
  // [map_rows][map_cols], a heatmap of the attention pooled into blocks: each block's mean over
  // heads and over its causal entries (j ≤ i) of the listed query rows i in row bin
  // ⌊i·map_rows/T⌋ and the keys j in column bin ⌊j·map_cols/map_keys⌋ (map_keys ≥ T: the key
  // axis may run on past the prompt, as a heatmap that goes on with decode steps draws it); 0
  // where a block holds no such entry. Sums in double: rows ascending, then heads, then keys
  // ascending. Null: not asked.
  float* map = nullptr;
  int map_rows = 0, map_cols = 0, map_keys = 0;

  // The query rows [begin, end), clamped to [0, T).
  static std::vector<int> range(int begin, int end, int T);
  // Throws InternalError unless queries are ascending, distinct and in [0, T), and a map asked
  // for has 1 ≤ map_rows ≤ T, T ≤ map_keys and 1 ≤ map_cols ≤ map_keys; `what` names the caller.
  void check(int T, const std::string& what) const;
  // The map's bins: the row bin of query row i, and the first key of column bin c (column bin c
  // holds keys [map_key_begin(c), map_key_begin(c + 1))).
  int map_row_bin(int i, int T) const { return static_cast<int>(static_cast<int64_t>(i) * map_rows / T); }
  int64_t map_key_begin(int c) const {
    return (static_cast<int64_t>(c) * map_keys + map_cols - 1) / map_cols;
  }
  // The keys [first, second) of column bin c that query position i sees (j ≤ i); empty once the
  // bin starts after i.
  std::pair<int64_t, int64_t> map_keys_seen(int c, int64_t i) const {
    return {map_key_begin(c), std::min<int64_t>(map_key_begin(c + 1), i + 1)};
  }
  // Writes `map` from the blocks' sums [map_rows][map_cols] (taken as the map's comment says):
  // each sum over n_heads · (the block's causal entries), 0 for a block without one.
  void finish_map(const double* sums, int n_heads, int T) const;
  // A key for remembering results: the queries, what is asked and p.
  std::string key() const;
};

// Rows already reduced over heads, pooled as AttentionReduction::map pools keys: row r of
// rows [n_rows][keys] is the query at position first_pos + r, and out [n_rows][cols] holds each
// column bin's mean over its keys j ≤ that position (0 where there is none).
void pool_map_rows(const float* rows, int n_rows, int first_pos, int keys, int cols, float* out);

// The host reference: reduces causal probabilities P [n_heads][T][T] as `r` asks.
void reduce_attention(const float* P, int n_heads, int T, const AttentionReduction& r);

}  // namespace kvlens
