// The comparison table of a run report: every instance's numbers as the report has them, sorted
// by any column, and its CSV.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "app/figures/figures_report.h"
#include "core/errors.h"
#include "tests/report_fixture.h"

using namespace kvlens;
using namespace kvlens::fig;
using kvlens::testing::report;

namespace {

// The comparison table holds each method's report numbers, in report order until sorted; sorting
// by a column orders the rows by it either way, keeps the rows of equal values in report order and
// puts a method without a value (a caption that never diverges) last; an unknown column is refused.
// The report with a fourth method labelled `label`: the first one's numbers and a caption that
// never diverges (ties, and a missing value).
nlohmann::json report_with_copy(const std::string& label) {
  nlohmann::json r = report();
  nlohmann::json extra = r["methods"][0];
  extra["label"] = label;
  extra["first_divergence"]["position"] = -1;
  r["methods"].push_back(extra);
  return r;
}

TEST(Figures, ComparisonTableIsTheReportsNumbersSortedByAnyColumn) {
  const nlohmann::json r = report_with_copy("copy");
  const ComparisonTable t = comparison_table(r);
  ASSERT_EQ(t.rows.size(), 4u);
  ASSERT_EQ(t.columns.size(), 9u);
  EXPECT_EQ(t.columns[0].key, "method");
  for (size_t i = 0; i < t.rows.size(); ++i) {
    const auto& m = r["methods"][i];
    const auto& v = t.rows[i].values;
    EXPECT_EQ(t.rows[i].method, static_cast<int>(i));
    EXPECT_EQ(t.rows[i].name, method_labels(r)[i]);
    EXPECT_DOUBLE_EQ(v[0], m["bytes_after_prefill"]["total"].get<double>() / 1024);
    EXPECT_DOUBLE_EQ(v[1], m["compression_vs_fp16"].get<double>());
    EXPECT_DOUBLE_EQ(v[2], m["mean_softmax_mse"].get<double>());
    EXPECT_DOUBLE_EQ(v[3], m["mean_softmax_kl"].get<double>());
    EXPECT_DOUBLE_EQ(v[4], m["mean_attn_output_rel_error"].get<double>());
    const int at = m["first_divergence"]["position"].get<int>();
    if (at < 0) {
      EXPECT_TRUE(std::isnan(v[5]));
    } else {
      EXPECT_DOUBLE_EQ(v[5], at);
    }
    EXPECT_DOUBLE_EQ(v[6], m["timings_ms"]["compress"].get<double>());
    EXPECT_DOUBLE_EQ(v[7], m["timings_ms"]["decode"].get<double>());
  }
  for (size_t c = 0; c < t.columns.size(); ++c)
    for (bool desc : {false, true}) {
      ComparisonTable s = t;
      sort_comparison(s, t.columns[c].key, desc);
      const std::string at = t.columns[c].key + (desc ? " descending" : " ascending");
      for (size_t i = 0; i + 1 < s.rows.size(); ++i) {
        const ComparisonTable::Row &a = s.rows[i], &b = s.rows[i + 1];
        if (c == 0) {
          EXPECT_TRUE(desc ? a.name >= b.name : a.name <= b.name) << at;
          continue;
        }
        const double x = a.values[c - 1], y = b.values[c - 1];
        if (std::isnan(x)) {
          EXPECT_TRUE(std::isnan(y)) << at << ": a row without a value before one with";
          continue;
        }
        if (std::isnan(y)) continue;
        EXPECT_TRUE(desc ? x >= y : x <= y) << at << " rows " << i << ", " << i + 1;
        if (x == y) {
          EXPECT_LT(a.method, b.method) << at << ": equal values keep report order";
        }
      }
    }
  // The copy ties the first method on bytes: report order, either way.
  ComparisonTable s = t;
  sort_comparison(s, "kv_kib", true);
  std::vector<int> order;
  for (const auto& row : s.rows) order.push_back(row.method);
  EXPECT_LT(std::find(order.begin(), order.end(), 0) - order.begin(), std::find(order.begin(), order.end(), 3) - order.begin());
  sort_comparison(s, "diverges_at", false);
  EXPECT_EQ(s.rows.back().name, "copy");
  sort_comparison(s, "diverges_at", true);
  EXPECT_EQ(s.rows.back().name, "copy");
  EXPECT_THROW(sort_comparison(s, "cider", false), InputError);
  EXPECT_TRUE(comparison_column("mse"));
  EXPECT_FALSE(comparison_column("cider"));
}

}  // namespace

// The comparison table as CSV: a header of the column keys, one row per method in the table's
// order, every number the table's to 9 significant digits, an empty field for a missing value,
// a name with a comma quoted; read back field by field (RFC 4180) it is the table.
TEST(Figures, ComparisonCsvIsTheTable) {
  const nlohmann::json r = report_with_copy("copy, \"quoted\"");
  ComparisonTable t = comparison_table(r);
  sort_comparison(t, "mse", true);
  const std::string csv = comparison_csv(t);
  // RFC 4180 records.
  std::vector<std::vector<std::string>> rows(1);
  std::string field;
  bool quoted = false;
  for (size_t i = 0; i < csv.size(); ++i) {
    const char c = csv[i];
    if (quoted) {
      if (c == '"' && i + 1 < csv.size() && csv[i + 1] == '"') field += '"', ++i;
      else if (c == '"') quoted = false;
      else field += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      rows.back().push_back(field), field.clear();
    } else if (c == '\n') {
      rows.back().push_back(field), field.clear();
      rows.emplace_back();
    } else {
      field += c;
    }
  }
  rows.pop_back();  // after the last line break
  ASSERT_EQ(rows.size(), t.rows.size() + 1);
  for (size_t c = 0; c < t.columns.size(); ++c) EXPECT_EQ(rows[0][c], t.columns[c].key);
  for (size_t i = 0; i < t.rows.size(); ++i) {
    ASSERT_EQ(rows[i + 1].size(), t.columns.size());
    EXPECT_EQ(rows[i + 1][0], t.rows[i].name);
    for (size_t c = 0; c < t.rows[i].values.size(); ++c) {
      const double v = t.rows[i].values[c];
      const std::string& f = rows[i + 1][c + 1];
      if (std::isnan(v)) {
        EXPECT_TRUE(f.empty()) << t.rows[i].name << " " << t.columns[c + 1].key;
      } else {
        EXPECT_NEAR(std::stod(f), v, std::abs(v) * 1e-8) << t.rows[i].name << " " << t.columns[c + 1].key;
      }
    }
  }
}
