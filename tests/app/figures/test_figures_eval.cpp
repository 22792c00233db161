// Figures of sweeps and calibration grids, built from hand-made tables: which points go where.
#include <gtest/gtest.h>

#include <cmath>

#include "core/errors.h"
#include "app/figures/figures_eval.h"

namespace kvlens {
namespace {

EvalRow row(const std::string& spec, double cider, double bytes, double mse = NAN) {
  EvalRow r;
  if (spec == "full") {
    r.variant.key = r.variant.label = r.variant.method = "full";
  } else {
    r.variant.params = parse_method_spec(spec);
    r.variant.key = r.variant.params->spec();
    r.variant.method = r.variant.params->method();
  }
  r.scores.cider_d = cider;
  r.kv_bytes = bytes;
  if (!std::isnan(mse)) r.softmax_mse = mse;
  return r;
}

TEST(FiguresEval, SweepLinesAreSortedAndSplitByTheOtherAxis) {
  const Params base = parse_method_spec("vlcache");
  const std::vector<SweepAxis> axes{parse_sweep_axis("budget=0.4,0.1", base), parse_sweep_axis("recent_ratio=0,0.2", base)};
  EvalTable t;
  t.images = 3;
  t.rows = {row("full", 4.0, 1000),
            row("vlcache:budget=0.4,recent_ratio=0", 1.0, 400),
            row("vlcache:budget=0.4,recent_ratio=0.2", 3.0, 400),
            row("vlcache:budget=0.1,recent_ratio=0", 0.5, 100),
            row("vlcache:budget=0.1,recent_ratio=0.2", 1.5, 100)};
  const std::vector<fig::Figure> f = fig::sweep_figures(axes, t, "CIDEr-D");
  ASSERT_EQ(f.size(), 3u);  // vs budget, vs recent_ratio, vs bytes
  EXPECT_EQ(f[0].id, "sweep_cider_d_vs_budget");
  ASSERT_EQ(f[0].series.size(), 2u);  // one line per recent_ratio
  EXPECT_EQ(f[0].series[0].label, "recent_ratio=0");
  EXPECT_EQ(f[0].series[0].x, (std::vector<double>{0.1, 0.4}));
  EXPECT_EQ(f[0].series[0].y, (std::vector<double>{0.5, 1.0}));
  EXPECT_EQ(f[0].series[1].y, (std::vector<double>{1.5, 3.0}));
  ASSERT_EQ(f[0].markers.size(), 1u);
  EXPECT_EQ(f[0].markers[0].at, 4.0);  // the full cache
  EXPECT_EQ(f[2].id, "sweep_cider_d_vs_kv_bytes");
  EXPECT_EQ(f[2].series[0].x, (std::vector<double>{400, 400, 100, 100}));
  EXPECT_EQ(f[2].series[0].point_labels[0], "budget=0.4,recent_ratio=0");
  EXPECT_EQ(f[2].series[1].x, std::vector<double>{1000});
  EXPECT_THROW(fig::sweep_figures(axes, t, "CIDEr"), InputError);
}

TEST(FiguresEval, CalibrationHeatmapRowsAreTau1ColumnsTau2) {
  EvalTable t;
  t.images = 2;
  t.rows.push_back(row("full", 4.0, 1000));
  for (int a : {0, 3})
    for (int b : {0, 3})
      t.rows.push_back(row("calibquant:tau1=" + std::to_string(a) + ",tau2=" + std::to_string(b), 10 * a + b, 100, 1e-3 * (1 + a)));
  const fig::Figure f = fig::calibration_heatmap({0, 3}, t, "CIDEr-D", false, 3, 0);
  const fig::Series& h = f.series.at(0);
  ASSERT_EQ(h.kind, fig::SeriesKind::Heatmap);
  EXPECT_EQ(h.z, (std::vector<double>{0, 3, 30, 33}));  // row-major: (τ1=0: τ2=0, 3), (τ1=3: ...)
  EXPECT_EQ(h.z_min, 0);
  EXPECT_EQ(h.z_max, 33);
  const fig::Series& best = f.series.at(1);
  EXPECT_EQ(best.x, std::vector<double>{0});  // τ2 = 0 is column 0
  EXPECT_EQ(best.y, std::vector<double>{1});  // τ1 = 3 is row 1
  const fig::Figure m = fig::calibration_heatmap({0, 3}, t, "softmax MSE", true, 0, 0);
  EXPECT_TRUE(m.series[0].z_log);
  EXPECT_DOUBLE_EQ(m.series[0].z_max, 4e-3);
}

}  // namespace
}  // namespace kvlens
