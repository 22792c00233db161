#include "app/gui/caption_diff.h"

#include <algorithm>
#include <sstream>

namespace kvlens::gui {

std::vector<std::string> caption_words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> w;
  for (std::string x; in >> x;) w.push_back(x);
  return w;
}

namespace {

std::string joined(const std::vector<std::string>& w, size_t from, size_t to) {
  std::string s;
  for (size_t i = from; i < to; ++i) s += (i > from ? " " : "") + w[i];
  return s;
}

}  // namespace

std::vector<WordDiff> caption_word_diff(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<int>> L(n + 1, std::vector<int>(m + 1, 0));
  for (size_t i = n; i-- > 0;)
    for (size_t j = m; j-- > 0;) L[i][j] = a[i] == b[j] ? L[i + 1][j + 1] + 1 : std::max(L[i + 1][j], L[i][j + 1]);
  // The matched pairs along one longest common subsequence, then a sentinel past both ends.
  std::vector<std::pair<size_t, size_t>> match;
  for (size_t i = 0, j = 0; i < n && j < m;) {
    if (a[i] == b[j]) {
      match.emplace_back(i, j);
      ++i, ++j;
    } else if (L[i + 1][j] >= L[i][j + 1]) {
      ++i;
    } else {
      ++j;
    }
  }
  match.emplace_back(n, m);
  std::vector<WordDiff> out(m);
  size_t i0 = 0, j0 = 0;  // the gap before each match: a[i0, i) against b[j0, j)
  for (const auto& [i, j] : match) {
    for (size_t x = j0; x < j; ++x) out[x].differs = true;
    if (j > j0) {
      out[j0].replaced = joined(a, i0, i);
    } else if (i > i0 && m > 0) {
      (j < m ? out[j].dropped : out[m - 1].dropped_after) = joined(a, i0, i);
    }
    i0 = i + 1, j0 = j + 1;
  }
  return out;
}

}  // namespace kvlens::gui
