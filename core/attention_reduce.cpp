#include "core/attention_reduce.h"

#include <algorithm>
#include <cstdio>

#include "core/errors.h"

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
}

std::string AttentionReduction::key() const {
  std::string k;
  k += column_sums ? 'c' : '-';
  k += below ? 'b' : '-';
  k += zeros_below ? 'z' : '-';
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

void reduce_attention(const float* P, int n_heads, int T, const AttentionReduction& r) {
  r.check(T, "attention reduction");
  for (int h = 0; h < n_heads; ++h) {
    const float* Ph = P + static_cast<size_t>(h) * T * T;
    if (r.column_sums) {
      double* s = r.column_sums + static_cast<size_t>(h) * T;
      for (int j = 0; j < T; ++j) {
        double acc = 0.0;
        for (int i : r.queries)
          if (j <= i) acc += Ph[static_cast<size_t>(i) * T + j];
        s[j] = acc;
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
  }
}

}  // namespace kvlens
