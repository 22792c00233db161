#include "core/row_merge.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/errors.h"

namespace kvlens {

const char* merge_kind_name(MergeKind k) {
  switch (k) {
    case MergeKind::None: return "none";
    case MergeKind::Average: return "average";
    case MergeKind::Pivotal: return "pivotal";
    case MergeKind::Weighted: return "weighted";
  }
  return "?";
}

void merge_rows(MergeKind kind, int d, const std::vector<RowAssignment>& contrib, std::vector<float>& k,
                std::vector<float>& v, std::vector<int>& count) {
  if (d < 1 || k.size() % static_cast<size_t>(d) != 0 || v.size() != k.size())
    throw InternalError("merge_rows: k/v are not [n][d]");
  const int n = static_cast<int>(k.size() / static_cast<size_t>(d));
  count = contribution_counts(contrib, n, kind != MergeKind::None, "merge_rows");
  if (kind == MergeKind::None) return;
  std::vector<double> acc_k(k.size(), 0.0), acc_v(k.size(), 0.0);
  for (const RowAssignment& a : contrib) {
    const size_t e = static_cast<size_t>(a.e) * d, c = static_cast<size_t>(a.c) * d;
    for (int t = 0; t < d; ++t) {
      const double ke = k[e + t], ve = v[e + t], kc = k[c + t], vc = v[c + t];
      double& ak = acc_k[c + t];
      double& av = acc_v[c + t];
      switch (kind) {
        case MergeKind::Average: ak += ke; av += ve; break;
        case MergeKind::Pivotal: ak += 0.5 * (ke + kc); av += 0.5 * (ve + vc); break;
        case MergeKind::Weighted: ak = std::fma(a.s, ke, ak); av = std::fma(a.s, ve, av); break;
        case MergeKind::None: break;
      }
    }
  }
  for (int c = 0; c < n; ++c) {
    if (count[static_cast<size_t>(c)] == 0) continue;  // nothing merged: the row stays an exact copy
    const double w = 1.0 / (count[static_cast<size_t>(c)] + 1);
    for (int t = 0; t < d; ++t) {
      const size_t i = static_cast<size_t>(c) * d + t;
      k[i] = static_cast<float>((k[i] + acc_k[i]) * w);
      v[i] = static_cast<float>((v[i] + acc_v[i]) * w);
    }
  }
}

std::vector<int> contribution_counts(const std::vector<RowAssignment>& contrib, int n, bool sources_unmerged,
                                     const std::string& what) {
  std::vector<int> count(static_cast<size_t>(std::max(n, 0)), 0);
  for (const RowAssignment& a : contrib) {
    if (a.e < 0 || a.e >= n || a.c < 0 || a.c >= n || a.e == a.c)
      throw InternalError(what + ": row " + std::to_string(a.e) + " into row " + std::to_string(a.c) + " of " +
                          std::to_string(n));
    ++count[static_cast<size_t>(a.c)];
  }
  if (sources_unmerged)
    for (const RowAssignment& a : contrib)
      if (count[static_cast<size_t>(a.e)] != 0)
        throw InternalError(what + ": row " + std::to_string(a.e) + " is both merged and merged into");
  return count;
}

}  // namespace kvlens
