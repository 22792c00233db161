// Merging evicted KV rows into kept ones (LOOK-M's Eq. 10–12): the host reference that the
// LOOK-M method runs on host rows and that every backend's merge where the cache is
// (Backend::kv_lookm_merge) equals bit for bit.
#pragma once
#include <string>
#include <vector>

namespace kvlens {

enum class MergeKind { None, Average, Pivotal, Weighted };
const char* merge_kind_name(MergeKind k);  // "none" / "average" / "pivotal" / "weighted"

// Row e of a KV head folded into its kept row c with weight s (LOOK-M's Eq. 9: c is e's most
// cosine-similar kept row, s that similarity). Rows are indices in the head's row order
// (gather_head's: segments in order, rows in order).
struct RowAssignment {
  int e = 0, c = 0;
  double s = 0;
};

// Folds every contribution into its kept row, for x = k and x = v ([n][d] each), against the
// kept rows' original values; count[c] = the contributions to row c (n entries). Per kept row c
// with contributions, in the order given, from acc = 0 in double:
//   average  (Eq. 10): acc = acc + x_e
//   pivotal  (Eq. 11): acc = acc + 0.5 · (x_e + x_c)
//   weighted (Eq. 12): acc = fma(s, x_e, acc)
// then x_c = float((x_c + acc) · (1 / (count + 1))). Every operation is one correctly rounded
// double operation (the weighted step one fused multiply-add), so a device that does the same
// ones gets the same floats. Sources are never kept rows, so the order of the kept rows does not
// matter. MergeKind::None leaves the rows and counts every contribution.
void merge_rows(MergeKind kind, int d, const std::vector<RowAssignment>& contrib, std::vector<float>& k,
                std::vector<float>& v, std::vector<int>& count);
// count[c] = the contributions to row c of n rows. Throws InternalError (its text starting with
// `what`) for a row out of range or merged into itself and, with `sources_unmerged`, for a row
// both merged and merged into (what a merge requires).
std::vector<int> contribution_counts(const std::vector<RowAssignment>& contrib, int n, bool sources_unmerged,
                                     const std::string& what);

}  // namespace kvlens
