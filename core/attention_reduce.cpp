#include "core/attention_reduce.h"

#include <algorithm>
#include <cstdio>

#include "core/errors.h"
#include "core/parallel.h"
#include "core/team.h"

namespace kvlens {

std::vector<int> AttentionReduction::range(int begin, int end, int T) {
  begin = std::clamp(begin, 0, T);
  end = std::clamp(end, begin, T);
  std::vector<int> q;
  for (int i = begin; i < end; ++i) q.push_back(i);
  return q;
}

void AttentionReduction::check(int T, const std::string& what) const {
  for (size_t i = 0; i < queries.size(); ++i)
    if (queries[i] < 0 || queries[i] >= T || (i > 0 && queries[i] <= queries[i - 1]))
      throw InternalError(what + ": query rows must be ascending, distinct and below " + std::to_string(T) +
                          "; row " + std::to_string(i) + " is " + std::to_string(queries[i]));
  if (map && (map_rows < 1 || map_rows > T || map_keys < T || map_cols < 1 || map_cols > map_keys))
    throw InternalError(what + ": a map of " + std::to_string(map_rows) + " x " + std::to_string(map_cols) +
                        " blocks over " + std::to_string(T) + " query rows and " + std::to_string(map_keys) +
                        " keys (rows in [1, T], keys >= T, columns in [1, keys])");
}

void AttentionReduction::finish_map(const double* sums, int n_heads, int T) const {
  // The causal entries of each block: a listed row i has, in column bin c, the keys of the bin
  // up to i.
  std::vector<int64_t> count(static_cast<size_t>(map_rows) * map_cols, 0);
  for (int i : queries) {
    int64_t* row = count.data() + static_cast<size_t>(map_row_bin(i, T)) * map_cols;
    for (int c = 0; c < map_cols; ++c) {
      const auto [b, e] = map_keys_seen(c, i);
      if (e <= b) break;
      row[c] += e - b;
    }
  }
  for (size_t x = 0; x < count.size(); ++x)
    map[x] = count[x] ? static_cast<float>(sums[x] / (static_cast<double>(n_heads) * count[x])) : 0.0f;
}

std::string AttentionReduction::key() const {
  std::string k;
  k += column_sums ? 'c' : '-';
  k += below ? 'b' : '-';
  k += zeros_below ? 'z' : '-';
  if (map) k += "m" + std::to_string(map_rows) + "x" + std::to_string(map_cols) + "/" + std::to_string(map_keys);
  char pb[32];
  std::snprintf(pb, sizeof pb, "%.17g:", p);  // every bit of p: 0.001 and 0.0014 are different requests
  k += pb;
  // Runs of consecutive rows as first+count: a range is a few bytes.
  for (size_t i = 0; i < queries.size();) {
    size_t j = i + 1;
    while (j < queries.size() && queries[j] == queries[j - 1] + 1) ++j;
    k += std::to_string(queries[i]) + "+" + std::to_string(j - i) + ",";
    i = j;
  }
  return k;
}

void pool_map_rows(const float* rows, int n_rows, int first_pos, int keys, int cols, float* out) {
  AttentionReduction bins;
  bins.map_cols = cols;
  bins.map_keys = keys;
  for (int r = 0; r < n_rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const auto [b, e] = bins.map_keys_seen(c, int64_t{first_pos} + r);
      double acc = 0.0;
      for (int64_t j = b; j < e; ++j) acc += rows[static_cast<size_t>(r) * keys + j];
      out[static_cast<size_t>(r) * cols + c] = e > b ? static_cast<float>(acc / static_cast<double>(e - b)) : 0.0f;
    }
}

void reduce_attention(const float* P, int n_heads, int T, const AttentionReduction& r) {
  r.check(T, "attention reduction");
  // Heads side by side on the team (core/team.h), a thread for each 2^20 entries read.
  const int64_t entries = static_cast<int64_t>(n_heads) * static_cast<int64_t>(r.queries.size()) * T;
  const int threads = static_cast<int>(std::clamp<int64_t>(entries >> 20, 1, product_threads()));
  team_each(n_heads, threads, [&](int64_t head) {
    const int h = static_cast<int>(head);
    const float* Ph = P + static_cast<size_t>(h) * T * T;
    if (r.column_sums) {
      // Row by row, each column's sum still taken in ascending i from 0.0.
      double* s = r.column_sums + static_cast<size_t>(h) * T;
      std::fill(s, s + T, 0.0);
      for (int i : r.queries) {
        const float* row = Ph + static_cast<size_t>(i) * T;
        for (int j = 0; j <= i; ++j) s[j] += row[j];
      }
    }
    if (r.below) {
      int64_t n = 0;
      for (int i : r.queries) {
        const float* row = Ph + static_cast<size_t>(i) * T;
        const float mx = *std::max_element(row, row + i + 1);
        const double thr = r.p * mx;
        for (int j = 0; j <= i; ++j) n += (row[j] < thr || (r.zeros_below && row[j] == 0.0f)) ? 1 : 0;
      }
      r.below[h] = n;
    }
  });
  if (r.map) {
    std::vector<double> sums(static_cast<size_t>(r.map_rows) * r.map_cols, 0.0);
    for (int i : r.queries) {
      double* row = sums.data() + static_cast<size_t>(r.map_row_bin(i, T)) * r.map_cols;
      for (int c = 0; c < r.map_cols; ++c) {
        const auto [b, e] = r.map_keys_seen(c, i);
        if (e <= b) break;
        double acc = row[c];
        for (int h = 0; h < n_heads; ++h) {
          const float* p = P + (static_cast<size_t>(h) * T + i) * T;
          for (int64_t j = b; j < e; ++j) acc += p[j];
        }
        row[c] = acc;
      }
    }
    r.finish_map(sums.data(), n_heads, T);
  }
}

}  // namespace kvlens
