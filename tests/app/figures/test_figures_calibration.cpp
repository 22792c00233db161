// CalibQuant's g(x) drawn as the method applies it: one line a head over that head's own visual
// score range [γ_h, δ_h] onto [γ_h − τ1, δ_h − τ2] (not one line over the range pooled over
// heads), from a report and from per-head ranges; one head alone is the single curve.
#include <gtest/gtest.h>

#include <algorithm>

#include "app/figures/figures.h"
#include "app/figures/figures_report.h"
#include "tests/report_fixture.h"

using namespace kvlens;
using namespace kvlens::fig;
using kvlens::testing::report;

TEST(Figures, CalibrationCurvesAHeadEach) {
  const auto& r = report();  // method 0: calibquant, tau1 = 0.5, tau2 = 2
  const auto& range = r["methods"][0]["layers"][1]["visual_score_range_by_head"];
  const auto g = range["gamma"].get<std::vector<double>>(), d = range["delta"].get<std::vector<double>>();
  ASSERT_GT(g.size(), 1u);
  const Figure t = transfer_curve_figure(r, 0, 1);
  std::vector<const Series*> lines;
  for (const Series& s : t.series)
    if (s.label != "identity") lines.push_back(&s);
  size_t h = 0, drawn = 0;
  for (const Series* s : lines) {
    while (h < g.size() && !(d[h] > g[h])) ++h;  // (a head without a range has no line)
    ASSERT_LT(h, g.size());
    EXPECT_NEAR(s->x.front(), g[h], 1e-9) << "head " << h;
    EXPECT_NEAR(s->x.back(), d[h], 1e-9) << "head " << h;
    EXPECT_NEAR(s->y.front(), g[h] - 0.5, 1e-9) << "head " << h;
    EXPECT_NEAR(s->y.back(), d[h] - 2, 1e-9) << "head " << h;
    ++h, ++drawn;
  }
  size_t ranged = 0;
  for (size_t i = 0; i < g.size(); ++i) ranged += d[i] > g[i];
  EXPECT_EQ(drawn, ranged);
  EXPECT_GT(drawn, 1u);
  EXPECT_EQ(lines.front()->label, "g(x), a line a head");
  // The axes hold every head's curve.
  EXPECT_LE(t.x.min, *std::min_element(g.begin(), g.end()));
  EXPECT_GE(t.x.max, *std::max_element(d.begin(), d.end()));
  EXPECT_LE(t.y.min, *std::min_element(g.begin(), g.end()) - 0.5);
  // Per-head ranges given directly; a head without a range is skipped; one head is the single curve.
  const Calibration c{1.0, 0.25};
  const Figure two = transfer_curves_figure({-2, 0, -1}, {2, 0, 3}, c, "t", "t");
  ASSERT_EQ(two.series.size(), 3u);  // identity and two heads
  EXPECT_NEAR(two.series[2].x.front(), -1, 1e-12);
  EXPECT_NEAR(two.series[2].y.back(), 3 - 0.25, 1e-12);
  const Figure one = transfer_curves_figure({-2, 0}, {2, 0}, c, "o", "o");
  const Figure single = transfer_curve_figure(-2, 2, c, "o", "o");
  ASSERT_EQ(one.series.size(), single.series.size());
  EXPECT_EQ(one.series[1].y, single.series[1].y);
}
