#include "app/figures/figures_eval.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/errors.h"

namespace kvlens::fig {

namespace {

std::string metric_slug(const std::string& s) {
  std::string out;
  for (char c : s) out += std::isalnum(static_cast<unsigned char>(c)) ? static_cast<char>(std::tolower(c)) : '_';
  return out;
}

// A range around the values with a margin; log ranges stay positive.
void fit(Axis& a, const std::vector<double>& v) {
  double lo = INFINITY, hi = -INFINITY;
  for (double x : v)
    if (std::isfinite(x) && (!a.log || x > 0)) lo = std::min(lo, x), hi = std::max(hi, x);
  if (!std::isfinite(lo)) lo = a.log ? 1 : 0, hi = a.log ? 10 : 1;
  if (a.log) {
    a.min = lo / 1.25;
    a.max = hi * 1.25;
  } else {
    const double pad = hi > lo ? (hi - lo) * 0.06 : std::max(std::fabs(hi) * 0.1, 1e-3);
    a.min = lo - pad;
    a.max = hi + pad;
  }
}

const EvalRow* full_row(const EvalTable& t) {
  for (const EvalRow& r : t.rows)
    if (!r.variant.params) return &r;
  return nullptr;
}

double axis_value(const EvalRow& r, const SweepAxis& a) {
  const std::string v = r.variant.params->str(a.name);
  for (size_t i = 0; i < a.values.size(); ++i)
    if (a.values[i] == v) return a.numbers[i];
  return std::nan("");
}

std::string point_label(const EvalRow& r, const std::vector<SweepAxis>& axes) {
  std::string s;
  for (const SweepAxis& a : axes) s += (s.empty() ? "" : ",") + a.name + "=" + r.variant.params->str(a.name);
  return s;
}

void reference_line(Figure& f, const EvalTable& t, const std::string& metric) {
  const EvalRow* full = full_row(t);
  if (!full) return;
  const double y = row_metric(*full, metric);
  if (!std::isfinite(y)) return;
  Marker m;
  m.axis = 'y';
  m.at = y;
  m.label = "full cache";
  m.color = Color{0.35f, 0.35f, 0.35f, 1};
  f.markers.push_back(m);
}

}  // namespace

double row_metric(const EvalRow& r, const std::string& metric) {
  if (metric == "VQA") return r.vqa_accuracy().value_or(std::nan(""));
  if (metric == "softmax MSE") return r.softmax_mse.value_or(std::nan(""));
  for (const std::string& m : caption_metric_names())
    if (m == metric) return metric_value(r.scores, m);
  std::string names;
  for (const std::string& m : caption_metric_names()) names += m + ", ";
  throw InputError("unknown metric '" + metric + "' (one of " + names + "VQA, softmax MSE)");
}

std::vector<Figure> sweep_figures(const std::vector<SweepAxis>& axes, const EvalTable& t, const std::string& metric) {
  row_metric(full_row(t) ? *full_row(t) : t.rows.at(0), metric);  // names an unknown metric first
  std::vector<const EvalRow*> grid;
  for (const EvalRow& r : t.rows)
    if (r.variant.params) grid.push_back(&r);
  std::vector<Figure> out;
  const std::string note = std::to_string(t.images) + " images; " + metric + " as pycocoevalcap computes it";
  // Metric against each numeric axis (one or two axes).
  if (axes.size() <= 2)
    for (size_t i = 0; i < axes.size(); ++i) {
      const SweepAxis& a = axes[i];
      bool numeric = true;
      for (double x : a.numbers) numeric = numeric && std::isfinite(x);
      if (!numeric) continue;
      Figure f;
      f.id = "sweep_" + metric_slug(metric) + "_vs_" + metric_slug(a.name);
      f.title = metric + " against " + a.name;
      f.note = note;
      f.x.label = a.name;
      f.x.log = a.log;
      f.y.label = metric;
      std::map<std::string, Series> lines;  // one per value of the other axis
      std::vector<double> xs, ys;
      for (const EvalRow* r : grid) {
        const std::string key = axes.size() == 2 ? axes[1 - i].name + "=" + r->variant.params->str(axes[1 - i].name) : "";
        Series& s = lines[key];
        s.kind = SeriesKind::Line;
        s.markers = true;
        s.label = key.empty() ? t.rows.empty() ? "" : grid.front()->variant.method : key;
        s.x.push_back(axis_value(*r, a));
        s.y.push_back(row_metric(*r, metric));
        xs.push_back(s.x.back());
        ys.push_back(s.y.back());
      }
      int c = 0;
      for (auto& entry : lines) {
        const Series& s = entry.second;  // (a structured binding cannot be captured by the lambda in C++17)
        std::vector<size_t> idx(s.x.size());
        for (size_t k = 0; k < idx.size(); ++k) idx[k] = k;
        std::sort(idx.begin(), idx.end(), [&](size_t p, size_t q) { return s.x[p] < s.x[q]; });
        Series sorted = s;
        for (size_t k = 0; k < idx.size(); ++k) sorted.x[k] = s.x[idx[k]], sorted.y[k] = s.y[idx[k]];
        sorted.color = palette(c++);
        f.series.push_back(sorted);
      }
      reference_line(f, t, metric);
      if (const EvalRow* full = full_row(t)) ys.push_back(row_metric(*full, metric));
      fit(f.x, xs);
      fit(f.y, ys);
      out.push_back(std::move(f));
    }
  // Metric against KV bytes: every grid point, labelled.
  Figure f;
  f.id = "sweep_" + metric_slug(metric) + "_vs_kv_bytes";
  f.title = metric + " against KV cache bytes";
  f.note = note + "; KV bytes: mean over images after compression";
  f.x.label = "KV bytes";
  f.y.label = metric;
  Series s;
  s.kind = SeriesKind::Scatter;
  s.label = grid.empty() ? "" : grid.front()->variant.method;
  s.color = palette(0);
  std::vector<double> xs, ys;
  for (const EvalRow* r : grid) {
    s.x.push_back(r->kv_bytes);
    s.y.push_back(row_metric(*r, metric));
    s.point_labels.push_back(point_label(*r, axes));
  }
  xs = s.x;
  ys = s.y;
  if (const EvalRow* full = full_row(t)) {
    ys.push_back(row_metric(*full, metric));
    xs.push_back(full->kv_bytes);
    Series fs;
    fs.kind = SeriesKind::Scatter;
    fs.label = "full cache";
    fs.color = Color{0.35f, 0.35f, 0.35f, 1};
    fs.x = {full->kv_bytes};
    fs.y = {row_metric(*full, metric)};
    f.series.push_back(fs);
  }
  f.series.insert(f.series.begin(), s);
  double lo = INFINITY, hi = 0;
  for (double x : xs)
    if (x > 0) lo = std::min(lo, x), hi = std::max(hi, x);
  f.x.log = hi > 20 * lo;
  fit(f.x, xs);
  fit(f.y, ys);
  out.push_back(std::move(f));
  return out;
}

Figure calibration_heatmap(const std::vector<double>& taus, const EvalTable& t, const std::string& metric, bool log_z,
                           double best_tau1, double best_tau2) {
  const int n = static_cast<int>(taus.size());
  auto index = [&](double v) {
    for (int i = 0; i < n; ++i)
      if (taus[i] == v) return i;
    return -1;
  };
  Series h;
  h.kind = SeriesKind::Heatmap;
  h.rows = h.cols = n;
  h.z.assign(static_cast<size_t>(n) * n, std::nan(""));
  h.x0 = h.y0 = -0.5;
  h.x1 = h.y1 = n - 0.5;
  double lo = INFINITY, hi = -INFINITY;
  for (const EvalRow& r : t.rows) {
    if (!r.variant.params) continue;
    const int i = index(r.variant.params->num("tau1")), j = index(r.variant.params->num("tau2"));
    const double v = row_metric(r, metric);
    if (i < 0 || j < 0) continue;
    h.z[static_cast<size_t>(i) * n + j] = v;
    if (std::isfinite(v) && (!log_z || v > 0)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  h.z_log = log_z;
  h.z_min = std::isfinite(lo) ? lo : 0;
  h.z_max = std::isfinite(hi) && hi > lo ? hi : h.z_min + 1;
  Figure f;
  f.id = "calibration_" + metric_slug(metric);
  f.title = metric + " over the τ1/τ2 grid";
  f.note = std::to_string(t.images) + " images; the best pair marked";
  f.colorbar = metric;
  f.legend = false;
  f.series.push_back(h);
  Series best;
  best.kind = SeriesKind::Scatter;
  best.color = Color{1, 0.2f, 0.2f, 1};
  best.x = {static_cast<double>(index(best_tau2))};
  best.y = {static_cast<double>(index(best_tau1))};
  best.point_labels = {"best"};
  f.series.push_back(best);
  for (Axis* a : {&f.x, &f.y}) {
    a->min = -0.5;
    a->max = n - 0.5;
    for (int i = 0; i < n; ++i) a->ticks.push_back({static_cast<double>(i), format_value(taus[i])});
  }
  f.x.label = "τ2";
  f.y.label = "τ1";
  f.y.inverted = true;
  return f;
}

}  // namespace kvlens::fig
