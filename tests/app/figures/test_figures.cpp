// Figures built from a real run report: every number a figure shows is the report's number, the
// layout puts data where the axes say, and a broken report is refused naming the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "core/errors.h"
#include "app/figures/figures.h"
#include "app/figures/figures_report.h"
#include "app/figures/figure_svg.h"
#include "core/data/image.h"
#include "app/lab/experiment.h"
#include "tests/report_fixture.h"
#include "tests/test_util.h"

using namespace kvlens;
using namespace kvlens::fig;
namespace kt = kvlens::testing;

using kvlens::testing::by_label;
using kvlens::testing::measure;
using kvlens::testing::report;

namespace {

// The heatmap images a frame draws (not the colour bar, one pixel wide).
std::vector<const Prim*> heatmap_images(const Frame& fr) {
  std::vector<const Prim*> out;
  for (const Prim& p : fr.prims)
    if (p.type == Prim::Type::Image && p.image_w > 1) out.push_back(&p);
  return out;
}

}  // namespace

TEST(Figures, LayerMetricLinesAreTheReportsNumbers) {
  const auto& r = report();
  const Figure f = layer_metric_figure(r, LayerMetric::SoftmaxMse);
  const auto names = method_labels(r);
  ASSERT_EQ(f.series.size(), names.size());
  const int L = layer_count(r);
  ASSERT_EQ(f.x.ticks.size(), static_cast<size_t>(L));
  for (size_t m = 0; m < names.size(); ++m) {
    EXPECT_EQ(f.series[m].label, names[m]);
    ASSERT_EQ(f.series[m].y.size(), static_cast<size_t>(L));
    for (int l = 0; l < L; ++l) {
      EXPECT_EQ(f.series[m].x[l], l);
      EXPECT_DOUBLE_EQ(f.series[m].y[l], r["methods"][m]["layers"][l]["softmax_mse"].get<double>());
      EXPECT_GE(f.series[m].y[l], f.y.min);
      EXPECT_LE(f.series[m].y[l], f.y.max);
    }
  }
  const Figure k = layer_metric_figure(r, LayerMetric::OutputError);
  EXPECT_DOUBLE_EQ(k.series[1].y[1], r["methods"][1]["layers"][1]["attn_output_rel_error"].get<double>());
}

TEST(Figures, SparsityAndHitRates) {
  const auto& r = report();
  const Figure s = sparsity_figure(r);
  EXPECT_EQ(by_label(s, "full cache, prefill").y, r["full"]["sparsity_prefill"].get<std::vector<double>>());
  EXPECT_EQ(by_label(s, "full cache, decode").y, r["full"]["sparsity_decode"].get<std::vector<double>>());
  const Figure h = hit_rate_by_layer_figure(r, 1);
  EXPECT_EQ(h.id, "cache_hit_rate_by_layer_step2");
  ASSERT_EQ(h.series.size(), r["cache_hit_rate"]["rates"].size());
  for (const Series& ser : h.series)
    EXPECT_EQ(ser.y, r["cache_hit_rate"]["rates"][ser.label][1].get<std::vector<double>>()) << ser.label;
  const Figure hs = hit_rate_by_step_figure(r);
  const auto acc = r["cache_hit_rate"]["rates"]["accumulated"][0].get<std::vector<double>>();
  double mean = 0;
  for (double v : acc) mean += v / acc.size();
  EXPECT_NEAR(by_label(hs, "accumulated").y[0], mean, 1e-12);
  EXPECT_THROW(hit_rate_by_layer_figure(r, 5), InputError);
}

TEST(Figures, BytesBarsAndParetoView) {
  const auto& r = report();
  const Figure b = bytes_by_layer_figure(r);
  for (size_t m = 0; m < b.series.size(); ++m)
    for (size_t l = 0; l < b.series[m].y.size(); ++l)
      EXPECT_DOUBLE_EQ(b.series[m].y[l] * 1024.0, r["methods"][m]["layers"][l]["bytes"]["total"].get<double>());
  ASSERT_EQ(b.markers.size(), 1u);
  EXPECT_DOUBLE_EQ(b.markers[0].at * 1024.0 * layer_count(r), r["full"]["bytes_fp16"]["total"].get<double>());
  // Bars of one layer do not overlap.
  EXPECT_LT(b.series[0].x[0] + b.series[0].bar_width / 2, b.series[1].x[0] - b.series[1].bar_width / 2);

  const Figure p = bytes_vs_agreement_figure(r);
  const auto full = r["full"]["generated_ids"].get<std::vector<int>>();
  for (size_t m = 0; m < r["methods"].size(); ++m) {
    const Series& s = by_label(p, method_labels(r)[m]);
    EXPECT_DOUBLE_EQ(s.x[0] * 1024.0, r["methods"][m]["bytes_after_prefill"]["total"].get<double>());
    EXPECT_DOUBLE_EQ(s.y[0], greedy_agreement(full, r["methods"][m]["generated_ids"].get<std::vector<int>>()));
  }
  const Series& front = by_label(p, "Pareto front");
  for (size_t i = 1; i < front.x.size(); ++i) {
    EXPECT_GT(front.x[i], front.x[i - 1]);
    EXPECT_GT(front.y[i], front.y[i - 1]);
  }
  EXPECT_EQ(front.y.back(), 1.0);  // the full cache (or a method as good) ends the front
  // Every point is named beside it; a method at the same place as another is named in the
  // other's label instead of under it.
  EXPECT_EQ(by_label(p, "full cache (fp16)").point_labels, std::vector<std::string>{"full cache"});
  for (size_t m = 0; m < r["methods"].size(); ++m)
    EXPECT_EQ(by_label(p, method_labels(r)[m]).point_labels, std::vector<std::string>{method_labels(r)[m]});
  nlohmann::json twin = r;
  twin["methods"][1]["label"] = "twin";
  twin["methods"][1]["bytes_after_prefill"] = twin["methods"][0]["bytes_after_prefill"];
  twin["methods"][1]["generated_ids"] = twin["methods"][0]["generated_ids"];
  const Figure tp = bytes_vs_agreement_figure(twin);
  const std::string first = method_labels(twin)[0];
  EXPECT_EQ(by_label(tp, first).point_labels, std::vector<std::string>{first + ", twin"});
  EXPECT_EQ(by_label(tp, "twin").point_labels, std::vector<std::string>{""});
  EXPECT_DOUBLE_EQ(greedy_agreement({1, 2, 3, 4}, {1, 2, 9}), 0.5);
  EXPECT_DOUBLE_EQ(greedy_agreement({1, 2}, {1, 2}), 1.0);
  EXPECT_DOUBLE_EQ(greedy_agreement({1, 2}, {1, 2, 3}), 1.0);
}

TEST(Figures, ScoreHistogramAndCalibrationMarks) {
  const auto& r = report();
  const Figure f = score_histogram_figure(r, 0, 1);
  const auto& hj = r["methods"][0]["layers"][1]["visual_score_histogram"];
  const double lo = hj["lo"], hi = hj["hi"];
  const Series& cal = by_label(f, "quantized + calibrated");
  ASSERT_EQ(cal.x.size(), hj["calibrated"].size() + 1);
  for (size_t i = 0; i < cal.x.size(); ++i) EXPECT_NEAR(cal.x[i], lo + (hi - lo) * i / (cal.x.size() - 1), 1e-9);
  EXPECT_EQ(cal.y, hj["calibrated"].get<std::vector<double>>());
  EXPECT_EQ(by_label(f, "exact").y, hj["exact"].get<std::vector<double>>());
  // Pooled over heads: the taus in the note, no γ/δ marks (each head has its own range).
  EXPECT_TRUE(f.markers.empty());
  EXPECT_NE(f.note.find("τ1 = 0.5, τ2 = 2"), std::string::npos) << f.note;
  // One head's histogram with its calibration: γ, δ marked, [γ−τ1, δ−τ2] shaded.
  ScoreHistogram one;
  one.lo = -4;
  one.hi = 6;
  one.exact = one.quantized = one.calibrated = {1, 2, 3, 4, 5};
  const Figure hf = score_histogram_figure(one, "h", "one head", Calibration{0.5, 2}, -3, 5);
  ASSERT_EQ(hf.markers.size(), 2u);
  EXPECT_DOUBLE_EQ(hf.markers[0].at, -3);
  EXPECT_DOUBLE_EQ(hf.markers[1].at, 5);
  ASSERT_EQ(hf.bands.size(), 1u);
  EXPECT_DOUBLE_EQ(hf.bands[0].from, -3.5);
  EXPECT_DOUBLE_EQ(hf.bands[0].to, 3);
  EXPECT_EQ(hf.series[2].x, (std::vector<double>{-4, -2, 0, 2, 4, 6}));
  // A method that does not calibrate: no taus.
  EXPECT_EQ(score_histogram_figure(r, 1, 1).note.find("τ1"), std::string::npos);
  EXPECT_THROW(transfer_curve_figure(r, 1, 0), InputError);  // (its curves: test_figures_calibration.cpp)
}

// A map pooled into blocks (kvlens run --attention-bins): R prompt row blocks and one row per
// decode step over C key blocks; a block wholly after its queries is masked, the readout names
// the positions a block spans, and a map that does not fit its size is refused.
TEST(Figures, PooledAttentionHeatmap) {
  nlohmann::json r = report();
  const int n = r["attention"]["size"], S = r["attention"]["steps"], T = n - S, R = 3, C = 4, L = layer_count(r);
  ASSERT_GT(T, 2 * R);
  auto rows_of = [&](int count, double base) {
    nlohmann::json m = nlohmann::json::array();
    for (int b = 0; b < count; ++b) {
      nlohmann::json row = nlohmann::json::array();
      for (int c = 0; c < C; ++c) row.push_back(base + 0.01 * (b * C + c + 1));
      m.push_back(row);
    }
    return m;
  };
  r["attention"]["rows"] = R;
  r["attention"]["cols"] = C;
  r["attention"]["layers"] = nlohmann::json::array();
  for (int l = 0; l < L; ++l) r["attention"]["layers"].push_back(rows_of(R + S, 0.0));
  for (auto& m : r["methods"]) {
    m["decode_attention"] = nlohmann::json::array();
    for (int l = 0; l < L; ++l) m["decode_attention"].push_back(rows_of(S, 0.5));
  }
  const Figure f = attention_heatmap_figure(r, 1, -1);
  ASSERT_EQ(f.series.size(), 2u);
  const Series& p = f.series[0];
  ASSERT_EQ(p.rows, R);
  ASSERT_EQ(p.cols, C);
  const Figure fm = attention_heatmap_figure(r, 1, 1);  // the method's decode rows alone
  ASSERT_EQ(fm.series.size(), 1u);
  const Series& d = fm.series[0];
  ASSERT_EQ(d.rows, S);
  EXPECT_EQ(p.x1, n);
  EXPECT_EQ(p.y1, T);
  for (int b = 0; b < R; ++b) {
    int last = -1;  // the block's last query
    for (int i = 0; i < T; ++i)
      if (i * R / T == b) last = i;
    for (int c = 0; c < C; ++c) {
      int first = n;  // the block's first key
      for (int k = n - 1; k >= 0; --k)
        if (k * C / n == c) first = k;
      const double v = p.z[static_cast<size_t>(b) * C + c];
      if (first > last)
        EXPECT_TRUE(std::isnan(v)) << b << "," << c;
      else
        EXPECT_DOUBLE_EQ(v, 0.01 * (b * C + c + 1)) << b << "," << c;
    }
  }
  EXPECT_DOUBLE_EQ(d.z[0], 0.51);  // the method's first decode row, first block
  for (const Figure* x : {&f, &fm}) EXPECT_NE(x->note.find("blocks of about"), std::string::npos) << x->note;
  const Frame fr = draw(f, 640, 640, measure);
  const auto said = readout(f, fr, fr.px(0.5), fr.py(T - 0.5));
  ASSERT_FALSE(said.empty());
  const int lo = ((R - 1) * T + R - 1) / R;  // the last row block's first query
  EXPECT_NE(said[0].find("query position " + std::to_string(lo) + "-" + std::to_string(T - 1) + ", key position 0-"),
            std::string::npos)
      << said[0];
  // A block the method holds no key of (0) is drawn apart from the colour map's floor (1e-4)
  // and from the cells after the query (missing).
  r["methods"][1]["decode_attention"][1][0][0] = 0.0;
  r["methods"][1]["decode_attention"][1][0][1] = 1e-4;
  {
    const Figure e = attention_heatmap_figure(r, 1, 1);
    const Frame ef = draw(e, 640, 640, measure);
    ASSERT_FALSE(heatmap_images(ef).empty());
    const Prim* img = heatmap_images(ef).front();
    const uint8_t *absent = &img->rgba[0], *floor = &img->rgba[4];
    EXPECT_TRUE(absent[0] == absent[1] && absent[1] == absent[2]) << "grey";  // and apart from the floor:
    EXPECT_GT(std::abs(absent[0] - floor[0]) + std::abs(absent[1] - floor[1]) + std::abs(absent[2] - floor[2]), 60);
    EXPECT_LT(absent[0], 160) << "darker than the missing cells' light grey";
    EXPECT_NE(e.note.find("does not hold"), std::string::npos) << e.note;
    // A report from before zeros meant that (tiny values were rounded to 0): the colour map's floor.
    nlohmann::json old = r;
    old["attention"].erase("zero_is_absent");
    const Frame of = draw(attention_heatmap_figure(old, 1, 1), 640, 640, measure);
    ASSERT_FALSE(heatmap_images(of).empty());
    const Prim* oimg = heatmap_images(of).front();
    EXPECT_TRUE(std::equal(oimg->rgba.begin(), oimg->rgba.begin() + 3, oimg->rgba.begin() + 4)) << "0 drawn as 1e-4";
  }
  r["attention"]["cols"] = n + 1;
  EXPECT_THROW(attention_heatmap_figure(r, 1, -1), InputError);
}

TEST(Figures, AttentionHeatmapAndTokenFate) {
  const auto& r = report();
  ASSERT_TRUE(has_attention(r));
  const int n = r["attention"]["size"], S = r["attention"]["steps"];
  const Figure full = attention_heatmap_figure(r, 1, -1);
  const int T = n - S;
  ASSERT_EQ(full.series.size(), 2u) << "the prompt's rows, then the decode rows";
  const Series& h = full.series[0];
  const Series& hd = full.series[1];
  ASSERT_EQ(h.rows, T);
  ASSERT_EQ(h.cols, n);
  ASSERT_EQ(hd.rows, S);
  EXPECT_EQ(h.y1, T);
  EXPECT_EQ(hd.y0, T);
  EXPECT_EQ(hd.y1, n);
  EXPECT_DOUBLE_EQ(h.z[static_cast<size_t>(T - 1) * n + 3], r["attention"]["layers"][1][T - 1][3].get<double>());
  EXPECT_DOUBLE_EQ(hd.z[static_cast<size_t>(S - 1) * n + 3], r["attention"]["layers"][1][n - 1][3].get<double>());
  EXPECT_TRUE(std::isnan(h.z[static_cast<size_t>(3) * n + 4]));  // after the query: masked
  EXPECT_TRUE(std::isnan(hd.z[n - 1]));                          // the first decode row's last key
  // ... and drawn as missing (light grey), not as the bottom of the colour map.
  const Frame fr = draw(full, 640, 640, measure);
  ASSERT_FALSE(heatmap_images(fr).empty());
  const Prim* img = heatmap_images(fr).front();
  const uint8_t* masked = &img->rgba[(static_cast<size_t>(3) * n + 4) * 4];
  EXPECT_EQ(masked[0], masked[1]);
  EXPECT_EQ(masked[1], masked[2]);
  EXPECT_GT(masked[0], 200);
  EXPECT_THROW(attention_heatmap_figure(r, layer_count(r), -1), InputError);
  // A method's figure: its own decode rows alone, the plot's whole height (the prompt's rows
  // are the full cache's figure), with the full cache's masked cells.
  const Figure m = attention_heatmap_figure(r, 1, 1);  // streamingllm's decode rows
  ASSERT_EQ(m.series.size(), 1u);
  EXPECT_EQ(m.series[0].y0, T);
  EXPECT_EQ(m.y.min, T);
  EXPECT_EQ(m.y.max, n);
  EXPECT_DOUBLE_EQ(m.series[0].z[5], r["methods"][1]["decode_attention"][1][0][5].get<double>());
  for (size_t i = 0; i < hd.z.size(); ++i) EXPECT_EQ(std::isnan(m.series[0].z[i]), std::isnan(hd.z[i])) << i;
  const Frame mf = draw(m, 640, 640, measure);
  EXPECT_GT(mf.py(T + 1) - mf.py(T), 100) << "a decode row is a band, not a strip";
  // The readout names positions: the decode rows start at query position T.
  const auto said = readout(full, fr, fr.px(3.5), fr.py(T + 0.5));
  ASSERT_FALSE(said.empty());
  EXPECT_NE(said[0].find("query position " + std::to_string(T) + ", key position 3:"), std::string::npos) << said[0];
  // A boundary is marked at every position where the segment changes, and at the first generated row.
  std::set<double> want;
  const auto kinds = r["token_kinds"].get<std::vector<std::string>>();
  for (size_t t = 1; t < kinds.size(); ++t)
    if (kinds[t] != kinds[t - 1]) want.insert(static_cast<double>(t));
  want.insert(T);
  std::set<double> got;
  for (const Marker& mk : full.markers)
    if (mk.axis == 'x') got.insert(mk.at);
  EXPECT_EQ(got, want);

  const Figure fate = token_fate_figure(r, 1, 0, "kept");
  const int R = r["patch_grid"]["rows"], C = r["patch_grid"]["cols"];
  ASSERT_EQ(fate.series[0].rows, R);
  ASSERT_EQ(fate.series[0].cols, C);
  EXPECT_EQ(fate.series[0].z, r["methods"][1]["layers"][0]["token_fate"]["kept"].get<std::vector<double>>());
  EXPECT_THROW(token_fate_figure(r, 1, 0, "colour"), InputError);

  // Over the image as the model sees it: drawn first over the cells' rectangle, box-filtered to at
  // most 12 pixels a patch, the cells on top at 60 % opacity; without it, opaque cells alone.
  RGBImage scene;
  scene.width = 40 * C;
  scene.height = 40 * R;
  scene.data.resize(static_cast<size_t>(scene.width) * scene.height * 3);
  for (int y = 0; y < scene.height; ++y)
    for (int x = 0; x < scene.width; ++x)
      for (int c = 0; c < 3; ++c)
        scene.data[(static_cast<size_t>(y) * scene.width + x) * 3 + c] = static_cast<uint8_t>(c == 0 ? (x < scene.width / 2 ? 10 : 250) : 128);
  const Frame fp = draw(fate, 640, 640, measure);
  const std::vector<const Prim*> plain = heatmap_images(fp);
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_EQ(plain[0]->rgba[3], 255);
  const Figure over = token_fate_figure(r, 1, 0, "kept", &scene);
  EXPECT_EQ(over.series[0].z, fate.series[0].z);
  const Frame fo = draw(over, 640, 640, measure);
  const std::vector<const Prim*> both = heatmap_images(fo);
  ASSERT_EQ(both.size(), 2u);
  const Prim &back = *both[0], &cells = *both[1];
  EXPECT_EQ(back.image_w, 12 * C);
  EXPECT_EQ(back.image_h, 12 * R);
  EXPECT_DOUBLE_EQ(back.rect.x0, cells.rect.x0);
  EXPECT_DOUBLE_EQ(back.rect.x1, cells.rect.x1);
  EXPECT_DOUBLE_EQ(back.rect.y0, cells.rect.y0);
  EXPECT_DOUBLE_EQ(back.rect.y1, cells.rect.y1);
  EXPECT_EQ(back.rgba[0], 10);                             // the image's left half, top row
  EXPECT_EQ(back.rgba[(12 * C - 1) * 4], 250);             // its right half
  EXPECT_EQ(back.rgba[3], 255);
  EXPECT_EQ(cells.rgba[3], 153);                           // round(0.6 · 255)
  EXPECT_EQ(cells.image_w, C);
  EXPECT_NE(over.note.find("over the image"), std::string::npos);
}

TEST(Figures, EveryReportFigureHasAUniqueIdAndDraws) {
  const auto& r = report();
  const std::vector<Figure> all = report_figures(r);
  std::set<std::string> ids;
  for (const Figure& f : all) {
    EXPECT_TRUE(ids.insert(f.id).second) << f.id;
    const Frame fr = draw(f, 640, 400, measure);
    EXPECT_GT(fr.plot.width(), 100) << f.id;
    EXPECT_GT(fr.plot.height(), 100) << f.id;
    EXPECT_FALSE(figure_csv(f).empty());
  }
  // merged fate only where LOOK-M merged something; calibration only for calibquant.
  EXPECT_EQ(method_labels(r)[0], "calibquant:tau1=0.5,tau2=2");
  EXPECT_TRUE(ids.count("calibration_m0_calibquant_tau1_0.5_tau2_2_l0"));
  EXPECT_TRUE(ids.count("score_histogram_m1_streamingllm_budget_0.3_l0"));
  EXPECT_FALSE(ids.count("calibration_m1_streamingllm_budget_0.3_l0"));
  EXPECT_EQ(method_labels(r)[2], "lookm:alpha2=0.5,merge=average,text_prior=off");
  EXPECT_TRUE(ids.count("token_fate_merged_m2_lookm_alpha2_0.5_merge_average_text_prior_off_l0"));
  EXPECT_FALSE(std::any_of(ids.begin(), ids.end(), [](const std::string& id) { return id.rfind("token_fate_merged_m0", 0) == 0; }));
  EXPECT_TRUE(ids.count("cache_hit_rate_by_layer_step0"));
  EXPECT_TRUE(ids.count("attention_l0"));
}

TEST(Figures, LayoutPutsDataWhereTheAxesSay) {
  Figure f;
  f.title = "τ1 and γ";
  f.x.label = "x";
  f.y.label = "y";
  f.x.min = 0;
  f.x.max = 10;
  f.y.min = 0;
  f.y.max = 100;
  Series s;
  s.label = "line";
  s.x = {0, 5, 10};
  s.y = {0, 50, 100};
  f.series.push_back(s);
  const Frame fr = draw(f, 500, 300, measure);
  const Prim* poly = nullptr;
  bool title = false, xlabel = false, ylabel_vertical = false;
  for (const Prim& p : fr.prims) {
    if (p.type == Prim::Type::Polyline && p.pts.size() == 3) poly = &p;
    if (p.type == Prim::Type::Text && p.text == f.title) title = true;
    if (p.type == Prim::Type::Text && p.text == "x") xlabel = true;
    if (p.type == Prim::Type::Text && p.text == "y") ylabel_vertical = p.vertical;
  }
  ASSERT_NE(poly, nullptr);
  EXPECT_TRUE(title);
  EXPECT_TRUE(xlabel);
  EXPECT_TRUE(ylabel_vertical);
  EXPECT_NEAR(poly->pts[0].x, fr.plot.x0, 1e-9);
  EXPECT_NEAR(poly->pts[0].y, fr.plot.y1, 1e-9);
  EXPECT_NEAR(poly->pts[2].x, fr.plot.x1, 1e-9);
  EXPECT_NEAR(poly->pts[2].y, fr.plot.y0, 1e-9);
  EXPECT_NEAR(poly->pts[1].x, (fr.plot.x0 + fr.plot.x1) / 2, 1e-9);
  // Read-out at the middle point.
  const auto ro = readout(f, fr, poly->pts[1].x + 2, poly->pts[1].y);
  ASSERT_EQ(ro.size(), 1u);
  EXPECT_EQ(ro[0], "line: x = 5, y = 50");
  EXPECT_TRUE(readout(f, fr, 1, 1).empty());  // outside the plot
  // Zoom to x in [4, 6]: the middle point is at the centre, the ends are outside.
  View v;
  v.zoomed = true;
  v.x_min = 4;
  v.x_max = 6;
  const Frame z = draw(f, 500, 300, measure, v);
  EXPECT_NEAR(z.px(5), (z.plot.x0 + z.plot.x1) / 2, 1e-9);
  EXPECT_GT(z.px(10), z.plot.x1);
  EXPECT_NEAR(z.data_x(z.px(4.5)), 4.5, 1e-9);
  // Inverted y: min at the top.
  f.y.inverted = true;
  const Frame inv = draw(f, 500, 300, measure);
  EXPECT_NEAR(inv.py(0), inv.plot.y0, 1e-9);
}

TEST(Figures, TicksAreRoundAndInsideTheRange) {
  const auto t = nice_ticks(0.013, 0.87, 5, false);
  ASSERT_GE(t.size(), 3u);
  for (const Tick& k : t) {
    EXPECT_GE(k.value, 0.013 - 1e-12);
    EXPECT_LE(k.value, 0.87 + 1e-12);
  }
  EXPECT_EQ(t[0].label, "0.2");
  // One notation per axis: a log axis beyond [0.001, 10000] in powers of ten throughout,
  // within it in decimals; a linear axis of tiny values in scientific notation throughout; minus
  // signs as formulas print them.
  const auto lg = nice_ticks(2e-6, 3e-2, 6, true);
  ASSERT_EQ(lg.size(), 4u);  // 1e-5 … 1e-2
  std::vector<std::string> labels;
  for (const Tick& k : lg) labels.push_back(k.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"10⁻⁵", "10⁻⁴", "10⁻³", "10⁻²"}));
  labels.clear();
  for (const Tick& k : nice_ticks(1e-3, 20, 8, true)) labels.push_back(k.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"0.001", "0.01", "0.1", "1", "10"}));
  labels.clear();
  for (const Tick& k : nice_ticks(0, 1e-4, 5, false)) labels.push_back(k.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"0", "2e−5", "4e−5", "6e−5", "8e−5", "1.0e−4"}));
  labels.clear();
  for (const Tick& k : nice_ticks(-1, 1, 4, false)) labels.push_back(k.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"−1.0", "−0.5", "0.0", "0.5", "1.0"}));
  labels.clear();
  for (const Tick& k : nice_ticks(0, 3e5, 3, false)) labels.push_back(k.label);
  EXPECT_EQ(labels, (std::vector<std::string>{"0", "1e5", "2e5", "3e5"}));
  EXPECT_EQ(format_value(3), "3");
  EXPECT_EQ(format_value(0.000123456), "0.0001235");
}

TEST(Figures, BrokenReportIsRefusedNamingTheKey) {
  nlohmann::json r = report();
  r["methods"][1]["layers"][1].erase("softmax_mse");
  try {
    layer_metric_figure(r, LayerMetric::SoftmaxMse);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_STREQ(e.what(), "report.methods[1].layers[1] lacks 'softmax_mse'");
  }
  r = report();
  r["full"]["sparsity_prefill"][0] = "high";
  try {
    sparsity_figure(r);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("report.full.sparsity_prefill[0]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(score_histogram_figure(report(), 7, 0), InputError);
}

// A figure's data is one tidy table that Python's csv module reads as is: one header, then one
// row per plotted point with every column, the figure, series and kind named, the point's numbers
// as plotted (summed per column here), and the figure's method / layer / head on every row. Lines,
// a scatter with labels (one with a comma and a quote), a histogram's bins and a heatmap's cells
// (by position: the attention map's decode rows go on from the prompt's).
TEST(Figures, CsvIsOneTidyTableThatPythonReads) {
  const auto& r = report();
  std::vector<Figure> figs = {layer_metric_figure(r, LayerMetric::SoftmaxKl), bytes_vs_agreement_figure(r),
                              score_histogram_figure(r, 0, 1), attention_heatmap_figure(r, 1, 2)};
  ASSERT_EQ(figs[1].series.at(1).kind, SeriesKind::Scatter);
  figs[1].series[1].point_labels = {"a, \"quoted\" label"};
  const std::string dir = kt::make_temp_dir("figcsv");
  for (const Figure& f : figs) {
    SCOPED_TRACE(f.id);
    size_t points = 0;
    double sx = 0, sy = 0, sv = 0, shi = 0;
    auto fin = [](double v) { return std::isfinite(v) ? v : 0.0; };  // unplotted cells (NaN) are not summed
    for (const Series& s : f.series) {
      if (s.kind == SeriesKind::Heatmap) {
        points += static_cast<size_t>(s.rows) * s.cols;
        // Cells one position wide: x and y are their positions (the decode rows start at y0 = T).
        ASSERT_EQ(s.y1 - s.y0, s.rows);
        ASSERT_EQ(s.x1 - s.x0, s.cols);
        for (int rr = 0; rr < s.rows; ++rr)
          for (int c = 0; c < s.cols; ++c)
            sx += s.x0 + c, sy += s.y0 + rr, sv += fin(s.z[static_cast<size_t>(rr) * s.cols + c]);
      } else if (s.kind == SeriesKind::StepHistogram) {
        for (size_t i = 0; i + 1 < s.x.size() && i < s.y.size(); ++i)
          ++points, sx += fin(s.x[i]), shi += fin(s.x[i + 1]), sy += fin(s.y[i]);
      } else {
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) ++points, sx += fin(s.x[i]), sy += fin(s.y[i]);
      }
    }
    ASSERT_GT(points, 0u);
    const std::string path = dir + "/" + f.id + ".csv";
    kt::write_file(path, figure_csv(f));
    const std::string py =
        "import csv,json,math,sys\n"
        "rows=list(csv.reader(open(sys.argv[1],newline='')))\n"
        "h=rows[0]; b=rows[1:]\n"
        "col=lambda n:[r[h.index(n)] for r in b]\n"
        "s=lambda n:sum(float(x) for x in col(n) if x and math.isfinite(float(x)))\n"
        "print(json.dumps({'header':h,'n':len(b),'widths':sorted(set(len(r) for r in b)),'figure':sorted(set(col('figure'))),"
        "'method':sorted(set(col('method'))),'layer':sorted(set(col('layer'))),'head':sorted(set(col('head'))),"
        "'labels':sorted(set(col('label'))),'x':s('x'),'y':s('y'),'value':s('value'),'x_hi':s('x_hi')}))\n";
    kt::write_file(dir + "/read.py", py);
    const kt::RunResult res = kt::run("python3 " + dir + "/read.py " + path);
    ASSERT_EQ(res.code, 0) << res.output;
    const nlohmann::json j = nlohmann::json::parse(res.output);
    EXPECT_EQ(j["header"], nlohmann::json::parse(R"(["figure","series","kind","x","x_hi","y","value","label","method","layer","head"])"));
    EXPECT_EQ(j["n"].get<size_t>(), points);
    EXPECT_EQ(j["widths"], nlohmann::json::parse("[11]"));
    EXPECT_EQ(j["figure"], nlohmann::json::array({f.id}));
    EXPECT_EQ(j["method"], nlohmann::json::array({f.method}));
    EXPECT_EQ(j["layer"], nlohmann::json::array({f.layer >= 0 ? std::to_string(f.layer) : ""}));
    EXPECT_EQ(j["head"], nlohmann::json::array({f.head >= 0 ? std::to_string(f.head) : ""}));
    // %.9g keeps 9 digits of each value: sums agree to that share of their magnitude.
    auto near = [&](const char* k, double want) {
      EXPECT_NEAR(j[k].get<double>(), want, 1e-8 * std::max(1.0, std::abs(want)) * static_cast<double>(points)) << k;
    };
    near("x", sx);
    near("y", sy);
    near("value", sv);
    near("x_hi", shi);
    if (f.id == figs[1].id) {
      EXPECT_NE(j["labels"].dump().find(R"(a, \"quoted\" label)"), std::string::npos) << j["labels"];
    }
  }
  // The figures that show one method and layer say which.
  EXPECT_FALSE(figs[2].method.empty());
  EXPECT_EQ(figs[2].layer, 1);
  EXPECT_EQ(figs[3].layer, 1);
  EXPECT_EQ(figs[3].method, method_labels(r)[2]);
  const std::string scatter = figure_csv(figs[1]);
  EXPECT_NE(scatter.find("\"a, \"\"quoted\"\" label\""), std::string::npos) << scatter;
}

// The SVG writer, one primitive of each kind: shapes with their colours and opacities, text as
// escaped <text> anchored as the raster renderer anchors it (a vertical label rotated about its
// baseline point), an image as an embedded PNG of its pixels, clips opened and closed in pairs.
TEST(Figures, SvgWritesEachPrimitiveAsAnElement) {
  Frame fr;
  fr.width = 300;
  fr.height = 200;
  auto prim = [&](Prim::Type t) {
    Prim p;
    p.type = t;
    p.color = Color{1, 0, 0, 0.5f};
    fr.prims.push_back(p);
    return &fr.prims.back();
  };
  prim(Prim::Type::Clip)->rect = Rect{10, 10, 290, 190};
  Prim* line = prim(Prim::Type::Polyline);
  line->pts = {{10, 20}, {30, 40}, {50, 20}};
  line->dashed = true;
  line->width = 2;
  prim(Prim::Type::FillRect)->rect = Rect{1, 2, 11, 22};
  Prim* dot = prim(Prim::Type::Circle);
  dot->pts = {{7, 8}};
  dot->width = 3;
  Prim* img = prim(Prim::Type::Image);
  img->rect = Rect{0, 0, 100, 50};
  img->image_w = 2;
  img->image_h = 1;
  img->rgba = {255, 0, 0, 255, 0, 0, 255, 128};
  prim(Prim::Type::Unclip);
  Prim* label = prim(Prim::Type::Text);
  label->text = "a < b & \"c\"";
  label->pts = {{100, 200}};
  label->size = 10;
  label->valign = -1;
  label->halign = 0;
  label->vertical = true;
  const std::string svg = svg_document(fr);
  EXPECT_NE(svg.find("width=\"300pt\" height=\"200pt\" viewBox=\"0 0 300 200\""), std::string::npos) << svg;
  EXPECT_NE(svg.find("<polyline fill=\"none\" stroke=\"rgb(255,0,0)\" stroke-opacity=\"0.5\" stroke-width=\"2\" "
                     "stroke-linejoin=\"round\" stroke-dasharray=\"5,3.5\" points=\"10,20 30,40 50,20\"/>"),
            std::string::npos) << svg;
  EXPECT_NE(svg.find("<rect x=\"1\" y=\"2\" width=\"10\" height=\"20\" fill=\"rgb(255,0,0)\" fill-opacity=\"0.5\"/>"),
            std::string::npos) << svg;
  EXPECT_NE(svg.find("<circle cx=\"7\" cy=\"8\" r=\"3\""), std::string::npos) << svg;
  // Top-aligned vertical text: the baseline sits the font's ascent (1901/2048 em) right of the anchor.
  const std::string x = "109.282";
  EXPECT_NE(svg.find("<text x=\"" + x + "\" y=\"200\" font-family=\"DejaVu Sans\" font-size=\"10\" text-anchor=\"middle\""),
            std::string::npos) << svg;
  EXPECT_NE(svg.find("transform=\"rotate(-90 " + x + " 200)\">a &lt; b &amp; &quot;c&quot;</text>"), std::string::npos) << svg;
  size_t opens = 0, closes = 0;
  for (size_t at = svg.find("<g clip-path"); at != std::string::npos; at = svg.find("<g clip-path", at + 1)) ++opens;
  for (size_t at = svg.find("</g>"); at != std::string::npos; at = svg.find("</g>", at + 1)) ++closes;
  EXPECT_EQ(opens, 1u);
  EXPECT_EQ(closes, 1u);
  EXPECT_LT(svg.find("</g>"), svg.find("<text")) << "the text is outside the clip";
  // The image: a PNG of its 2 × 1 pixels.
  const std::string tag = "href=\"data:image/png;base64,";
  const size_t at = svg.find(tag);
  ASSERT_NE(at, std::string::npos) << svg;
  const std::string b64 = svg.substr(at + tag.size(), svg.find('"', at + tag.size()) - at - tag.size());
  std::string bytes;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : b64) {
    if (c == '=') break;
    const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    acc = (acc << 6) | static_cast<uint32_t>(alphabet.find(c));
    bits += 6;
    if (bits >= 8) bits -= 8, bytes += static_cast<char>((acc >> bits) & 0xff);
  }
  const RGBImage png = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "embedded");
  ASSERT_EQ(png.width, 2);
  ASSERT_EQ(png.height, 1);
  EXPECT_EQ(png.data, (std::vector<uint8_t>{255, 0, 0, 0, 0, 255}));
}

// How a figure is looked at on screen (fig::View): a hidden series is not drawn, not read out and
// greyed in the legend (whose series entries are where a click toggles them), and the y axis is
// fitted to what stays shown; the y scale can be switched either way and the y range zoomed.
TEST(Figures, ViewHidesSeriesSwitchesTheYScaleAndZoomsY) {
  const auto& r = report();
  const Figure f = layer_metric_figure(r, LayerMetric::SoftmaxKl);
  ASSERT_GE(f.series.size(), 2u);
  // The series with the largest value: hiding it must lower the axis's top.
  size_t top = 0;
  double top_y = -1;
  for (size_t i = 0; i < f.series.size(); ++i)
    for (double y : f.series[i].y)
      if (y > top_y) top_y = y, top = i;
  const std::string gone = f.series[top].label;
  // The series' own strokes (its width; the legend's swatch is 2.2 px wide).
  auto strokes_of = [&](const Frame& fr, Color c) {
    int n = 0;
    for (const Prim& p : fr.prims)
      if (p.type == Prim::Type::Polyline && p.width == f.series[top].line_width && p.color.r == c.r &&
          p.color.g == c.g && p.color.b == c.b)
        ++n;
    return n;
  };
  const Frame all = draw(f, 640, 400, measure);
  View v;
  v.hidden.insert(gone);
  const Frame some = draw(f, 640, 400, measure, v);
  EXPECT_GT(strokes_of(all, f.series[top].color), 0);
  EXPECT_EQ(strokes_of(some, f.series[top].color), 0);
  ASSERT_EQ(some.legend_series.size(), f.series.size());
  for (const auto& [rect, label] : some.legend_series) {
    EXPECT_GE(rect.x0, 0);
    EXPECT_LE(rect.x1, some.width);
    EXPECT_LT(rect.y1, some.plot.y0) << label << ": the legend sits above the plot";
  }
  EXPECT_LT(some.y.max, all.y.max) << "the axis fitted to the series still shown";
  for (size_t i = 0; i < f.series.size(); ++i)
    if (i != top)
      for (double y : f.series[i].y)
        if (std::isfinite(y) && (!some.y.log || y > 0)) {
          EXPECT_GE(y, some.y.min);
          EXPECT_LE(y, some.y.max);
        }
  // Read-outs skip the hidden series.
  const double px = all.px(f.series[top].x[0]);
  bool seen = false;
  for (double py = all.plot.y0 + 1; py < all.plot.y1; py += 7)
    for (const std::string& l : readout(f, some, px, py)) seen = seen || l.rfind(gone + ":", 0) == 0;
  EXPECT_FALSE(seen);
  // The y scale, either way, and a y range.
  View lin, lg, zoom;
  lin.y_scale = YScale::Linear;
  lg.y_scale = YScale::Log;
  const Frame fl = draw(f, 640, 400, measure, lin), fg = draw(f, 640, 400, measure, lg);
  EXPECT_FALSE(fl.y.log);
  EXPECT_LE(fl.y.min, 0.0);
  EXPECT_TRUE(fg.y.log);
  EXPECT_GT(fg.y.min, 0.0);
  zoom.y_zoomed = true;
  zoom.y_min = all.y.min + (all.y.max - all.y.min) * 0.25;
  zoom.y_max = all.y.max - (all.y.max - all.y.min) * 0.25;
  const Frame fz = draw(f, 640, 400, measure, zoom);
  EXPECT_DOUBLE_EQ(fz.y.min, zoom.y_min);
  EXPECT_DOUBLE_EQ(fz.y.max, zoom.y_max);
  // A matrix (inverted y) keeps its axis whatever the view's scale.
  Figure m;
  m.y.inverted = true;
  m.y.min = 0;
  m.y.max = 4;
  Series cells;
  cells.kind = SeriesKind::Heatmap;
  cells.rows = cells.cols = 2;
  cells.z = {1, 2, 3, 4};
  m.series.push_back(cells);
  const Frame mf = draw(m, 300, 300, measure, lg);
  EXPECT_FALSE(mf.y.log);
  EXPECT_DOUBLE_EQ(mf.y.max, 4);
  EXPECT_EQ(parse_y_scale("log", "y"), YScale::Log);
  EXPECT_THROW(parse_y_scale("logarithmic", "y"), InputError);
  const Axis a = fit_value_axis("v", {0.002, 0.5, std::nan("")}, true);
  EXPECT_TRUE(a.log);
  EXPECT_DOUBLE_EQ(a.min, 0.001);
  EXPECT_DOUBLE_EQ(a.max, 1.0);
  const Axis b = fit_value_axis("v", {-1, 3}, true);
  EXPECT_TRUE(b.log);  // some positive: log from the positive values
  const Axis c = fit_value_axis("v", {-1, 3}, false);  // (no point on the frame: margins at both ends)
  EXPECT_FALSE(c.log);
  EXPECT_DOUBLE_EQ(c.min, -1 - 4 * 0.04);
  EXPECT_DOUBLE_EQ(c.max, 3 + 4 * 0.08);
  const Axis d = fit_value_axis("v", {0.01, 0.1, 1}, true), e = fit_value_axis("v", {0, 2}, false);
  EXPECT_TRUE(d.min < 0.01 && d.max > 1 && e.min < 0) << d.min << " " << d.max << " " << e.min;
}

// Small multiples over the patch grid: every layer × head tile holds its head's values at its
// patches, the mean column their mean, the cells between tiles are missing, one log colour scale
// over the three decades below the largest value, square patches; a head without values is
// missing and a wrong-sized one is refused.
TEST(Figures, PatchSmallMultiplesPlaceEachHeadsTile) {
  const int R = 2, C = 3, L = 2, H = 3;
  std::vector<std::vector<std::vector<float>>> att(L, std::vector<std::vector<float>>(H));
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < R * C; ++i) att[l][h].push_back(static_cast<float>(0.01 * (1 + l * 100 + h * 10 + i)));
  att[1][2].clear();  // not recorded
  const Figure f = patch_multiples_figure(att, R, C, true, "calibquant", 4);
  ASSERT_EQ(f.series.size(), 1u);
  const Series& s = f.series[0];
  ASSERT_EQ(s.cols, (H + 1) * (C + 1) - 1);
  ASSERT_EQ(s.rows, L * (R + 1) - 1);
  auto z = [&](int row, int col) { return s.z[static_cast<size_t>(row) * s.cols + col]; };
  double biggest = 0;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          const double got = z(l * (R + 1) + r, h * (C + 1) + c);
          if (att[l][h].empty()) {
            EXPECT_TRUE(std::isnan(got)) << "layer " << l << " head " << h;
            continue;
          }
          EXPECT_FLOAT_EQ(got, att[l][h][r * C + c]) << "layer " << l << " head " << h;
          biggest = std::max(biggest, got);
          // The mean column: over the heads that hold values.
          double m = 0;
          int n = 0;
          for (int k = 0; k < H; ++k)
            if (!att[l][k].empty()) m += att[l][k][r * C + c], ++n;
          EXPECT_NEAR(z(l * (R + 1) + r, H * (C + 1) + c), m / n, 1e-9);
        }
  for (int col = 0; col < s.cols; ++col) EXPECT_TRUE(std::isnan(z(R, col))) << "the gap between layer tiles";
  for (int row = 0; row < s.rows; ++row) EXPECT_TRUE(std::isnan(z(row, C))) << "the gap between head tiles";
  EXPECT_TRUE(s.z_log);
  EXPECT_DOUBLE_EQ(s.z_max, biggest);
  EXPECT_DOUBLE_EQ(s.z_min, biggest * 1e-3);
  EXPECT_DOUBLE_EQ(f.aspect, (C + 1.0) / (R + 1.0));
  // Square patches as drawn.
  const Frame fr = draw(f, 900, 500, measure);
  const double cell_w = fr.plot.width() / s.cols, cell_h = fr.plot.height() / s.rows;
  EXPECT_NEAR(cell_w, cell_h, 1e-6 * cell_w);
  att[0][1].pop_back();
  EXPECT_THROW(patch_multiples_figure(att, R, C, true, "calibquant", 4), InputError);
}
