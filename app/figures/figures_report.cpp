#include "app/figures/figures_report.h"
#include "app/figures/report_json.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "core/attention_reduce.h"
#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens::fig {

using namespace report_json;

namespace {


Axis layer_axis(int L, double pad) {
  Axis a;
  a.label = "layer";
  a.min = -pad;
  a.max = L - 1 + pad;
  for (int l = 0; l < L; ++l) a.ticks.push_back({static_cast<double>(l), std::to_string(l)});
  return a;
}

// A y axis fitted to the values: from 0 (linear, non-negative data) or log10 when the values
// span more than two decades and are all positive.
Axis value_axis(const std::string& label, const std::vector<double>& v, bool allow_log) {
  double lo = kBig, hi = -kBig;
  for (double x : v)
    if (std::isfinite(x)) {
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  return fit_value_axis(label, v, allow_log && lo <= hi && lo > 0 && hi / lo > 100);
}

Series line_series(const std::string& label, Color c, std::vector<double> x, std::vector<double> y) {
  Series s;
  s.kind = SeriesKind::Line;
  s.label = label;
  s.color = c;
  s.markers = true;
  s.x = std::move(x);
  s.y = std::move(y);
  return s;
}

std::vector<double> iota_d(int n) {
  std::vector<double> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

std::optional<Calibration> report_calibration(const J& method) {
  return method_calibration(parse_method_spec(method.at("spec").str()));
}

}  // namespace

std::string slug(const std::string& s) {
  std::string o;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-';
    if (ok) o += c;
    else if (!o.empty() && o.back() != '_') o += '_';
  }
  while (!o.empty() && o.back() == '_') o.pop_back();
  return o.substr(0, 60);
}

size_t method_count(const nlohmann::json& report) { return root(report).at("methods").size(); }

int layer_count(const nlohmann::json& report) {
  return static_cast<int>(root(report).at("full").at("sparsity_prefill").size());
}

std::vector<std::string> method_labels(const nlohmann::json& report) {
  const J ms = root(report).at("methods");
  std::vector<std::string> out;
  std::map<std::string, int> seen;
  for (size_t i = 0; i < ms.size(); ++i) {
    const J m = ms.at(i);
    std::string name = m.has("label") ? m.at("label").str() : m.at("short_spec").str();
    const int n = ++seen[name];
    if (n > 1) name += " #" + std::to_string(n);
    out.push_back(name);
  }
  return out;
}

namespace {

const std::vector<ComparisonTable::Column>& comparison_columns() {
  static const std::vector<ComparisonTable::Column> c = {
      {"method", "method", "the method instance"},
      {"kv_kib", "KiB", "KV cache KiB after prefill compression"},
      {"ratio", "ratio", "compression ratio to the fp16 full cache"},
      {"mse", "MSE", "softmax MSE against the full cache, mean over layers, heads and diagnostic steps"},
      {"kl", "KL", "KL(full ‖ method) of the attention, mean over layers, heads and diagnostic steps"},
      {"output_error", "out err", "attention output relative error ‖o − ô‖ / ‖o‖, mean"},
      {"diverges_at", "diverges", "first generated token that differs from the full cache's (never: the same caption)"},
      {"compress_ms", "compress", "compression time, ms"},
      {"decode_ms", "decode", "decode time, ms"},
      {"cider_d", "CIDEr-D", "CIDEr-D of the caption against the image's reference captions, with the dataset's "
                             "document frequencies (when the image belongs to a caption dataset)"}};
  return c;
}

}  // namespace

ComparisonTable comparison_table(const nlohmann::json& report) {
  ComparisonTable t;
  t.columns = comparison_columns();
  const bool cider = root(report).has("references");  // (else no CIDEr-D column)
  if (!cider) t.columns.pop_back();
  const std::vector<std::string> names = method_labels(report);
  for (size_t i = 0; i < names.size(); ++i) {
    const J m = method_at(report, static_cast<int>(i));
    const int at = m.at("first_divergence").at("position").integer();
    ComparisonTable::Row r;
    r.method = static_cast<int>(i);
    r.name = names[i];
    r.values = {m.at("bytes_after_prefill").at("total").num() / 1024, m.at("compression_vs_fp16").num(),
                m.at("mean_softmax_mse").num(), m.at("mean_softmax_kl").num(), m.at("mean_attn_output_rel_error").num(),
                at >= 0 ? static_cast<double>(at) : std::nan(""), m.at("timings_ms").at("compress").num(),
                m.at("timings_ms").at("decode").num()};
    if (cider) r.values.push_back(m.has("cider_d") ? m.at("cider_d").num() : std::nan(""));
    t.rows.push_back(std::move(r));
  }
  return t;
}

std::string comparison_csv(const ComparisonTable& t) {
  std::string o;
  for (size_t c = 0; c < t.columns.size(); ++c) o += (c ? "," : "") + t.columns[c].key;
  o += "\n";
  for (const ComparisonTable::Row& r : t.rows) {
    o += csv_field(r.name);
    for (double v : r.values) {
      o += ",";
      if (std::isnan(v)) continue;
      char buf[40];
      std::snprintf(buf, sizeof buf, "%.9g", v);
      o += buf;
    }
    o += "\n";
  }
  return o;
}

bool comparison_column(const std::string& key) {
  for (const auto& c : comparison_columns())
    if (c.key == key) return true;
  return false;
}

void sort_comparison(ComparisonTable& t, const std::string& key, bool descending) {
  int col = -1;
  for (size_t i = 0; i < t.columns.size(); ++i)
    if (t.columns[i].key == key) col = static_cast<int>(i);
  if (col < 0 && comparison_column(key)) return;  // a column this report lacks (CIDEr-D without references)
  if (col < 0) throw InputError("comparison table: no column '" + key + "'");
  std::stable_sort(t.rows.begin(), t.rows.end(), [&](const ComparisonTable::Row& a, const ComparisonTable::Row& b) {
    if (col == 0) return descending ? b.name < a.name : a.name < b.name;
    const double x = a.values[static_cast<size_t>(col - 1)], y = b.values[static_cast<size_t>(col - 1)];
    if (std::isnan(x) || std::isnan(y)) return !std::isnan(x) && std::isnan(y);
    return descending ? y < x : x < y;
  });
}

Figure layer_metric_figure(const nlohmann::json& report, LayerMetric metric) {
  static const char* keys[] = {"softmax_mse", "softmax_kl", "attn_output_rel_error", "sparsity_decode"};
  static const char* ids[] = {"softmax_mse_by_layer", "softmax_kl_by_layer", "attn_output_error_by_layer",
                              "method_sparsity_by_layer"};
  static const char* titles[] = {"Softmax MSE against the full cache", "Softmax KL(full ‖ method)",
                                 "Attention output relative error ‖o − ô‖ / ‖o‖", "Decode sparsity γ of each method"};
  static const char* ylabels[] = {"softmax MSE", "KL", "relative error", "sparsity γ"};
  const int k = static_cast<int>(metric);
  Figure f;
  f.id = ids[k];
  f.title = titles[k];
  f.note = "first " + format_value(root(report).at("options").at("diag_steps").num()) + " decode steps, mean over heads";
  const int L = layer_count(report);
  f.x = layer_axis(L, 0.25);
  const std::vector<std::string> names = method_labels(report);
  std::vector<double> all;
  for (size_t m = 0; m < names.size(); ++m) {
    std::vector<double> y;
    for (int l = 0; l < L; ++l) y.push_back(layer_at(method_at(report, static_cast<int>(m)), l).at(keys[k]).num());
    all.insert(all.end(), y.begin(), y.end());
    f.series.push_back(line_series(names[m], palette(static_cast<int>(m)), iota_d(L), y));
  }
  f.y = value_axis(ylabels[k], all, metric != LayerMetric::SparsityDecode);
  if (metric == LayerMetric::SparsityDecode) f.y.max = std::max(f.y.max, 1.0);
  return f;
}

Figure sparsity_figure(const nlohmann::json& report) {
  Figure f;
  f.id = "sparsity_by_layer";
  f.title = "Attention sparsity γ(l)";
  f.note = "γ = share of A_ij < p·max_j A_ij, p = " + format_value(root(report).at("options").at("sparsity_p").num());
  const int L = layer_count(report);
  f.x = layer_axis(L, 0.25);
  const J full = root(report).at("full");
  f.series.push_back(line_series("full cache, prefill", Color{0.2f, 0.2f, 0.2f, 1}, iota_d(L), full.at("sparsity_prefill").nums()));
  Series d = line_series("full cache, decode", Color{0.2f, 0.2f, 0.2f, 1}, iota_d(L), full.at("sparsity_decode").nums());
  d.dashed = true;
  f.series.push_back(d);
  const std::vector<std::string> names = method_labels(report);
  for (size_t m = 0; m < names.size(); ++m) {
    std::vector<double> y;
    for (int l = 0; l < L; ++l) y.push_back(layer_at(method_at(report, static_cast<int>(m)), l).at("sparsity_decode").num());
    Series s = line_series(names[m] + ", decode", palette(static_cast<int>(m)), iota_d(L), y);
    s.dashed = true;
    f.series.push_back(s);
  }
  f.y.label = "sparsity γ";
  f.y.min = 0;
  f.y.max = 1.02;
  return f;
}

Figure hit_rate_by_layer_figure(const nlohmann::json& report, int step_index) {
  const J h = root(report).at("cache_hit_rate");
  const std::vector<int> steps = h.at("steps").ints();
  if (step_index < 0 || static_cast<size_t>(step_index) >= steps.size())
    throw InputError("report: cache_hit_rate has " + std::to_string(steps.size()) + " steps, no step index " +
                     std::to_string(step_index));
  Figure f;
  f.id = "cache_hit_rate_by_layer_step" + std::to_string(steps[step_index]);
  f.title = "CacheHitRate at decode step " + std::to_string(steps[step_index]);
  f.note = "|top-k by strategy ∩ top-k by decode attention| / k, k = " + std::to_string(h.at("k").integer());
  const int L = layer_count(report);
  f.x = layer_axis(L, 0.25);
  const J rates = h.at("rates");
  int i = 0;
  for (auto it = rates.v.begin(); it != rates.v.end(); ++it, ++i) {
    const J per_step{it.value(), rates.where + "." + it.key()};
    f.series.push_back(line_series(it.key(), palette(i), iota_d(L), per_step.at(step_index).nums()));
  }
  f.y.label = "CacheHitRate";
  f.y.min = 0;
  f.y.max = 1.02;
  return f;
}

Figure hit_rate_by_step_figure(const nlohmann::json& report) {
  const J h = root(report).at("cache_hit_rate");
  const std::vector<int> steps = h.at("steps").ints();
  Figure f;
  f.id = "cache_hit_rate_by_step";
  f.title = "CacheHitRate by decode step (mean over layers)";
  f.note = "k = " + std::to_string(h.at("k").integer()) + " keys";
  f.x.label = "decode step";
  f.x.min = steps.empty() ? 0 : steps.front() - 0.3;
  f.x.max = steps.empty() ? 1 : steps.back() + 0.3;
  for (int s : steps) f.x.ticks.push_back({static_cast<double>(s), std::to_string(s)});
  const J rates = h.at("rates");
  int i = 0;
  for (auto it = rates.v.begin(); it != rates.v.end(); ++it, ++i) {
    const J per_step{it.value(), rates.where + "." + it.key()};
    std::vector<double> x, y;
    for (size_t si = 0; si < steps.size(); ++si) {
      const std::vector<double> v = per_step.at(si).nums();
      double m = 0;
      for (double r : v) m += r / std::max<size_t>(v.size(), 1);
      x.push_back(steps[si]);
      y.push_back(m);
    }
    f.series.push_back(line_series(it.key(), palette(i), x, y));
  }
  f.y.label = "CacheHitRate";
  f.y.min = 0;
  f.y.max = 1.02;
  return f;
}

Figure bytes_by_layer_figure(const nlohmann::json& report) {
  Figure f;
  f.id = "bytes_by_layer";
  f.title = "KV bytes per layer after compression";
  f.note = "codes + scales + zero points + indices + metadata, exact";
  const int L = layer_count(report);
  f.x = layer_axis(L, 0.5);
  const std::vector<std::string> names = method_labels(report);
  const double w = 0.8 / std::max<size_t>(names.size(), 1);
  std::vector<double> all;
  for (size_t m = 0; m < names.size(); ++m) {
    Series s;
    s.kind = SeriesKind::Bars;
    s.label = names[m];
    s.color = palette(static_cast<int>(m));
    s.bar_width = w * 0.92;
    for (int l = 0; l < L; ++l) {
      s.x.push_back(l - 0.4 + w * (m + 0.5));
      s.y.push_back(layer_at(method_at(report, static_cast<int>(m)), l).at("bytes").at("total").num() / 1024.0);
    }
    all.insert(all.end(), s.y.begin(), s.y.end());
    f.series.push_back(s);
  }
  const double full = root(report).at("full").at("bytes_fp16").at("total").num() / 1024.0 / std::max(L, 1);
  all.push_back(full);
  f.markers.push_back({'y', full, "full cache, fp16", Color{0.2f, 0.2f, 0.2f, 1}, true});
  f.y = value_axis("KiB", all, false);
  return f;
}

double greedy_agreement(const std::vector<int>& full_ids, const std::vector<int>& ids) {
  if (full_ids.empty()) return ids.empty() ? 1.0 : 0.0;
  size_t n = 0;
  while (n < full_ids.size() && n < ids.size() && full_ids[n] == ids[n]) ++n;
  if (n == full_ids.size() && ids.size() == full_ids.size()) return 1.0;
  return static_cast<double>(n) / full_ids.size();
}

Figure bytes_vs_agreement_figure(const nlohmann::json& report) {
  Figure f;
  f.id = "bytes_vs_agreement";
  f.title = "KV bytes against caption agreement";
  f.note = "agreement: share of the full cache's greedy tokens reproduced before the first divergence";
  const J full = root(report).at("full");
  const std::vector<int> full_ids = full.at("generated_ids").ints();
  const std::vector<std::string> names = method_labels(report);
  struct P {
    double x, y;
  };
  std::vector<P> pts{{full.at("bytes_fp16").at("total").num() / 1024.0, 1.0}};
  Series ref;
  ref.kind = SeriesKind::Scatter;
  ref.label = "full cache (fp16)";
  ref.color = Color{0.2f, 0.2f, 0.2f, 1};
  ref.x = {pts[0].x};
  ref.y = {1.0};
  f.series.push_back(ref);
  for (size_t m = 0; m < names.size(); ++m) {
    const J mj = method_at(report, static_cast<int>(m));
    Series s;
    s.kind = SeriesKind::Scatter;
    s.label = names[m];
    s.color = palette(static_cast<int>(m));
    s.x = {mj.at("bytes_after_prefill").at("total").num() / 1024.0};
    s.y = {greedy_agreement(full_ids, mj.at("generated_ids").ints())};
    pts.push_back({s.x[0], s.y[0]});
    f.series.push_back(s);
  }
  // Every point named beside it; points at the same place share one label ("a, b"), so a
  // method hidden under another is still listed.
  for (size_t i = 0; i < f.series.size(); ++i) {  // the full cache, then the methods
    Series& a = f.series[i];
    if (a.point_labels.size() == 1 && a.point_labels[0].empty()) continue;  // already folded into an earlier label
    std::string label = i == 0 ? "full cache" : a.label;
    for (size_t j = i + 1; j < f.series.size(); ++j) {
      Series& b = f.series[j];
      if (b.x[0] == a.x[0] && b.y[0] == a.y[0]) {
        label += ", " + b.label;
        b.point_labels = {""};
      }
    }
    a.point_labels = {label};
  }
  // Pareto front: fewest bytes for each level of agreement.
  std::sort(pts.begin(), pts.end(), [](const P& a, const P& b) { return a.x < b.x || (a.x == b.x && a.y > b.y); });
  Series front;
  front.kind = SeriesKind::Line;
  front.label = "Pareto front";
  front.color = Color{0.55f, 0.55f, 0.6f, 1};
  front.dashed = true;
  double best = -1;
  for (const P& p : pts)
    if (p.y > best) {
      front.x.push_back(p.x);
      front.y.push_back(p.y);
      best = p.y;
    }
  f.series.insert(f.series.begin(), front);
  double xmax = 0;
  for (const P& p : pts) xmax = std::max(xmax, p.x);
  f.x.label = "KV bytes after prefill (KiB)";
  f.x.min = 0;
  f.x.max = xmax * 1.08 + 1e-9;
  f.y.label = "greedy agreement";
  f.y.min = -0.02;
  f.y.max = 1.06;
  return f;
}

std::optional<Calibration> method_calibration(const Params& p) {
  const std::optional<Params> stage = calibration_stage(p);
  if (!stage || stage->method() != p.method()) return std::nullopt;  // a composition's stage: no marks
  return calibration_of(p);
}

Figure score_histogram_figure(const ScoreHistogram& h, const std::string& id, const std::string& title,
                              std::optional<Calibration> calib, double gamma, double delta) {
  Figure f;
  f.id = id;
  f.title = title;
  f.note = "scores q·k/√d of the visual keys at the first decode step, shared bins";
  const size_t n = h.exact.size();
  std::vector<double> edges;
  for (size_t i = 0; i <= n; ++i) edges.push_back(h.lo + (h.hi - h.lo) * i / std::max<size_t>(n, 1));
  const std::pair<const std::vector<int64_t>*, const char*> kinds[] = {
      {&h.exact, "exact"}, {&h.quantized, "quantized"}, {&h.calibrated, "quantized + calibrated"}};
  const Color colors[] = {Color{0.3f, 0.3f, 0.33f, 1}, palette(1), palette(3)};
  double ymax = 1;
  for (int k = 0; k < 3; ++k) {
    Series s;
    s.kind = SeriesKind::StepHistogram;
    s.label = kinds[k].second;
    s.color = colors[k];
    s.fill = true;
    s.dashed = k == 0;
    s.x = edges;
    for (int64_t c : *kinds[k].first) {
      s.y.push_back(static_cast<double>(c));
      ymax = std::max(ymax, static_cast<double>(c));
    }
    f.series.push_back(s);
  }
  f.x.label = "score";
  const double span = h.hi > h.lo ? h.hi - h.lo : 1;  // a margin, so marks at the ends show
  f.x.min = h.lo - 0.02 * span;
  f.x.max = h.lo + 1.02 * span;
  f.y.label = "keys";
  f.y.min = 0;
  f.y.max = ymax * 1.1;
  if (calib && delta > gamma) {
    f.markers.push_back({'x', gamma, "γ, δ: quantized score range", Color{0.35f, 0.35f, 0.4f, 1}, true});
    f.markers.push_back({'x', delta, "", Color{0.35f, 0.35f, 0.4f, 1}, true});
    f.bands.push_back({'x', gamma - calib->tau1, delta - calib->tau2, "[γ−τ1, δ−τ2]", with_alpha(palette(3), 0.12f)});
  }
  return f;
}

Figure score_histogram_figure(const nlohmann::json& report, int method, int layer) {
  const J m = method_at(report, method);
  const J l = layer_at(m, layer);
  const J hj = l.at("visual_score_histogram");
  ScoreHistogram h;
  h.lo = hj.at("lo").num();
  h.hi = hj.at("hi").num();
  for (auto [key, out] : {std::pair{"exact", &h.exact}, {"quantized", &h.quantized}, {"calibrated", &h.calibrated}})
    for (double c : hj.at(key).nums()) out->push_back(static_cast<int64_t>(c));
  if (h.exact.size() != h.quantized.size() || h.exact.size() != h.calibrated.size())
    throw InputError(hj.where + ": exact, quantized and calibrated must have the same number of bins");
  const std::string name = method_labels(report)[method];
  const bool span = root(report).has("prompt_span");  // a text-only model: the template's span
  Figure f = score_histogram_figure(h, "score_histogram_" + method_id(report, method) + "_l" + std::to_string(layer),
                                    std::string(span ? "Prompt-span score histogram: " : "Visual score histogram: ") +
                                        name + ", layer " + std::to_string(layer) + ", all heads");
  if (span) f.note = "scores q·k/√d of the prompt span's keys (the methods' visual segment) at the first decode step, shared bins";
  f.method = name;
  f.layer = layer;
  // g(x) maps each head's own [γ, δ]; pooled over heads there is no one range to mark.
  if (const auto c = report_calibration(m))
    f.note += "; g(x) per head, τ1 = " + format_value(c->tau1) + ", τ2 = " + format_value(c->tau2);
  return f;
}

namespace {

// g(x) over [gamma, delta] (delta > gamma) in `steps` segments.
Series g_line(double gamma, double delta, Calibration c, int steps, double width, const std::string& label) {
  Series g = line_series(label, palette(3), {}, {});
  g.markers = false;
  g.line_width = width;
  for (int i = 0; i <= steps; ++i) {
    const double x = gamma + (delta - gamma) * i / steps;
    g.x.push_back(x);
    g.y.push_back((delta - gamma + c.tau1 - c.tau2) / (delta - gamma) * (x - gamma) + gamma - c.tau1);
  }
  return g;
}

}  // namespace

Figure transfer_curve_figure(double gamma, double delta, Calibration c, const std::string& id, const std::string& title) {
  Figure f;
  f.id = id;
  f.title = title;
  f.note = "g(x) = (δ−γ+τ1−τ2)/(δ−γ)·(x−γ)+γ−τ1 on the visual scores; γ = " + format_value(gamma) +
           ", δ = " + format_value(delta) + ", τ1 = " + format_value(c.tau1) + ", τ2 = " + format_value(c.tau2);
  if (!(delta > gamma)) delta = gamma + 1;
  const double pad = (delta - gamma) * 0.08;
  Series id_line = line_series("identity", Color{0.55f, 0.55f, 0.6f, 1}, {gamma - pad, delta + pad}, {gamma - pad, delta + pad});
  id_line.dashed = true;
  id_line.markers = false;
  f.series = {id_line, g_line(gamma, delta, c, 32, 2.2, "g(x)")};
  f.markers.push_back({'x', gamma, "γ, δ", Color{0.35f, 0.35f, 0.4f, 1}, true});
  f.markers.push_back({'x', delta, "", Color{0.35f, 0.35f, 0.4f, 1}, true});
  f.markers.push_back({'y', gamma - c.tau1, "γ−τ1, δ−τ2", palette(3), true});
  f.markers.push_back({'y', delta - c.tau2, "", palette(3), true});
  f.x.label = "quantized score x";
  f.x.min = gamma - pad;
  f.x.max = delta + pad;
  f.y.label = "calibrated score g(x)";
  f.y.min = std::min(gamma - c.tau1, gamma) - pad;
  f.y.max = std::max(delta - c.tau2, delta) + pad;
  return f;
}

Figure transfer_curves_figure(const std::vector<double>& gamma, const std::vector<double>& delta, Calibration c,
                              const std::string& id, const std::string& title) {
  if (gamma.size() != delta.size()) throw InternalError("transfer_curves_figure: γ and δ of different head counts");
  std::vector<size_t> heads;
  for (size_t h = 0; h < gamma.size(); ++h)
    if (delta[h] > gamma[h]) heads.push_back(h);
  if (heads.size() <= 1) {
    const size_t h = heads.empty() ? 0 : heads[0];
    return transfer_curve_figure(gamma.empty() ? 0.0 : gamma[h], delta.empty() ? 1.0 : delta[h], c, id, title);
  }
  double lo = 1e300, hi = -1e300;
  for (size_t h : heads) lo = std::min(lo, gamma[h]), hi = std::max(hi, delta[h]);
  Figure f = transfer_curve_figure(lo, hi, c, id, title);  // the identity, axes and labels over the union
  f.series.resize(1);
  f.markers.clear();
  for (size_t h : heads)
    f.series.push_back(g_line(gamma[h], delta[h], c, 16, 1.2, f.series.size() == 1 ? "g(x), a line a head" : ""));
  f.note = "g(x) = (δ−γ+τ1−τ2)/(δ−γ)·(x−γ)+γ−τ1, a line for each of " + std::to_string(heads.size()) +
           " heads over its own [γ, δ]; τ1 = " + format_value(c.tau1) + ", τ2 = " + format_value(c.tau2);
  return f;
}

Figure transfer_curve_figure(const nlohmann::json& report, int method, int layer) {
  const J m = method_at(report, method);
  const std::optional<Calibration> c = report_calibration(m);
  if (!c) throw InputError(m.where + " (" + method_labels(report)[method] + ") does not calibrate its scores");
  const J r = layer_at(m, layer).at("visual_score_range_by_head");
  const std::vector<double> g = r.at("gamma").nums(), d = r.at("delta").nums();
  if (g.empty() || g.size() != d.size()) throw InputError(r.where + " must hold one γ and one δ a head");
  Figure f = transfer_curves_figure(g, d, *c, "calibration_" + method_id(report, method) + "_l" + std::to_string(layer),
                                    "Calibration g(x): " + method_labels(report)[method] + ", layer " +
                                        std::to_string(layer) + ", all heads");
  f.method = method_labels(report)[method];
  f.layer = layer;
  return f;
}

bool has_attention(const nlohmann::json& report) { return report.is_object() && report.contains("attention"); }

Figure attention_heatmap_figure(const nlohmann::json& report, int layer, int method) {
  const J a = root(report).at("attention");
  const int n = a.at("size").integer(), S = a.at("steps").integer(), T = n - S;
  // Pooled blocks (kvlens run --attention-bins): R rows of prompt queries, then one row per
  // decode step, over C key blocks; a report without them holds every position (R = T, C = n).
  const int R = a.has("rows") ? a.at("rows").integer() : T, C = a.has("cols") ? a.at("cols").integer() : n;
  if (T < 1 || S < 0 || R < 1 || R > T || C < 1 || C > n)
    throw InputError(a.where + ": " + std::to_string(R) + " x " + std::to_string(C) + " blocks of " +
                     std::to_string(n) + " positions with " + std::to_string(S) + " decode steps do not fit");
  const J rows = a.at("layers").at(static_cast<size_t>(std::max(layer, 0)));
  if (layer < 0 || rows.size() != static_cast<size_t>(R + S))
    throw InputError(rows.where + " must hold " + std::to_string(R + S) + " rows");
  auto read = [&](const J& m, int r, std::vector<double>& z, int at) {
    const std::vector<double> row = m.at(static_cast<size_t>(r)).nums();
    if (row.size() != static_cast<size_t>(C))
      throw InputError(m.at(static_cast<size_t>(r)).where + " must hold " + std::to_string(C) + " values");
    std::copy(row.begin(), row.end(), z.begin() + static_cast<size_t>(at) * C);
  };
  // Two heatmaps over the same key blocks: the prompt's R pooled rows over query positions
  // [0, T), and the S decode rows over [T, n).
  Series s, d;
  s.kind = d.kind = SeriesKind::Heatmap;
  s.rows = R;
  d.rows = S;
  s.cols = d.cols = C;
  s.z.assign(static_cast<size_t>(R) * C, 0.0);
  d.z.assign(static_cast<size_t>(S) * C, 0.0);
  for (int i = 0; i < R; ++i) read(rows, i, s.z, i);
  std::string who = "full cache";
  const J decode = method >= 0 ? method_at(report, method).at("decode_attention").at(static_cast<size_t>(layer)) : rows;
  for (int i = 0; i < S; ++i) read(decode, method >= 0 ? i : R + i, d.z, i);
  if (method >= 0) who = method_labels(report)[method];
  // (a method's figure shows its decode rows alone: they set its colour scale)
  const bool own_rows = method >= 0 && S > 0;
  double zmax = 0;
  for (double v : d.z) zmax = std::max(zmax, v);
  if (!own_rows)
    for (double v : s.z) zmax = std::max(zmax, v);
  // Blocks wholly after their queries (causal mask) are not attention at all: drawn as missing,
  // not as 0. A block's keys start where the report's pooling put them; prompt row block i ends
  // at the last query q with ⌊q·R/T⌋ = i, a decode row at its own position.
  AttentionReduction bins;
  bins.map_cols = C;
  bins.map_keys = n;
  auto key_begin = [&](int c) { return bins.map_key_begin(c); };
  for (int i = 0; i < R; ++i) {
    const int64_t last = (static_cast<int64_t>(i + 1) * T + R - 1) / R - 1;
    for (int c = 0; c < C; ++c)
      if (key_begin(c) > last) s.z[static_cast<size_t>(i) * C + c] = std::nan("");
  }
  for (int i = 0; i < S; ++i)
    for (int c = 0; c < C; ++c)
      if (key_begin(c) > T + i) d.z[static_cast<size_t>(i) * C + c] = std::nan("");
  s.x0 = d.x0 = 0;
  s.x1 = d.x1 = n;
  s.y0 = 0;
  s.y1 = d.y0 = T;
  d.y1 = n;
  s.z_log = d.z_log = true;
  // (reports from before positive values were kept positive hold rounded zeros: not read so)
  s.zero_absent = d.zero_absent = a.has("zero_is_absent") && a.at("zero_is_absent").v.is_boolean() &&
                                  a.at("zero_is_absent").v.get<bool>();
  s.z_min = d.z_min = 1e-4;
  s.z_max = d.z_max = std::max(zmax, 1e-3);
  Figure f;
  f.id = "attention_" + (method >= 0 ? method_id(report, method) + "_" : std::string()) + "l" + std::to_string(layer);
  f.method = method >= 0 ? method_labels(report)[method] : "full";
  f.layer = layer;
  f.title = "Attention, layer " + std::to_string(layer) + ": " + who + " (mean over heads)";
  // A method's figure shows its own decode rows alone, each a band of the plot (the prompt's
  // rows are the full cache's, in its figure); the full cache's shows both.
  const std::string keys = format_number(std::round(10.0 * n / C) / 10) + " keys";
  if (own_rows) {
    f.note = "rows: the first " + std::to_string(S) + " tokens this method generated; dark grey: keys it does not hold";
    if (C < n) f.note += "; blocks of about " + keys;
  } else {
    f.note = "rows: prompt queries, then the first " + std::to_string(S) + " generated tokens" +
             (method >= 0 ? " decoded by this method" : "");
    if (R < T || C < n)
      f.note += "; blocks of about " + format_number(std::round(10.0 * T / R) / 10) + " queries x " + keys + ", each its mean";
    f.series.push_back(s);
  }
  if (S > 0) f.series.push_back(d);
  f.colorbar = "attention (log)";
  matrix_axes(f, "key position", n, "query position", n);
  if (own_rows) {  // a tick at a row's middle (at most 12 of them): the row's query position
    f.y.min = T;
    const int every = (S + 11) / 12;
    for (int i = 0; i < S; i += every) f.y.ticks.push_back({T + i + 0.5, std::to_string(T + i)});
  }
  // Segment boundaries.
  const std::vector<std::string> kinds = [&] {
    std::vector<std::string> k;
    const J tk = root(report).at("token_kinds");
    for (size_t i = 0; i < tk.size(); ++i) k.push_back(tk.at(i).str());
    return k;
  }();
  // (a text-only model's visual segment is the span of the prompt its template marks)
  const bool span = root(report).has("prompt_span");
  const std::map<std::string, std::pair<std::string, Color>> begins = {
      {"visual", {span ? "the methods' prompt span begins" : "visual tokens begin", Color{0.55f, 0.8f, 1.0f, 0.95f}}},
      {"post_vision_text", {span ? "text after the span begins" : "post-vision text begins", Color{1.0f, 0.55f, 0.2f, 0.95f}}},
      {"generated", {"generated tokens begin", Color{0.95f, 0.25f, 0.3f, 0.95f}}}};
  auto mark = [&](const std::string& kind, int at) {
    auto it = begins.find(kind);
    if (it == begins.end()) return;
    f.markers.push_back({'x', static_cast<double>(at), it->second.first, it->second.second, true});
    if (at >= f.y.min) f.markers.push_back({'y', static_cast<double>(at), "", it->second.second, true});
  };
  for (size_t t = 1; t < kinds.size(); ++t)
    if (kinds[t] != kinds[t - 1]) mark(kinds[t], static_cast<int>(t));
  if (S > 0) mark("generated", T);
  return f;
}

std::vector<Figure> report_figures(const nlohmann::json& report, const RGBImage* image) {
  std::vector<Figure> out;
  for (LayerMetric m : {LayerMetric::SoftmaxMse, LayerMetric::SoftmaxKl, LayerMetric::OutputError})
    out.push_back(layer_metric_figure(report, m));
  out.push_back(sparsity_figure(report));
  const size_t steps = root(report).at("cache_hit_rate").at("steps").size();
  for (size_t s = 0; s < steps; ++s) out.push_back(hit_rate_by_layer_figure(report, static_cast<int>(s)));
  out.push_back(hit_rate_by_step_figure(report));
  out.push_back(bytes_by_layer_figure(report));
  out.push_back(bytes_vs_agreement_figure(report));
  const int L = layer_count(report);
  const bool att = has_attention(report);
  // Token fate over the patch grid and the visual keys' scores: none for a text-only model (no
  // visual tokens, no grid).
  const J grid = root(report).at("patch_grid");
  const bool fate = grid.at("rows").integer() > 0 && grid.at("cols").integer() > 0;
  const bool visual = root(report).at("n_visual_tokens").integer() > 0;
  if (att)
    for (int l = 0; l < L; ++l) out.push_back(attention_heatmap_figure(report, l, -1));
  for (size_t m = 0; m < method_count(report); ++m) {
    const int mi = static_cast<int>(m);
    const bool calib = report_calibration(method_at(report, mi)).has_value();
    for (int l = 0; l < L; ++l) {
      if (visual) out.push_back(score_histogram_figure(report, mi, l));
      if (calib && visual) out.push_back(transfer_curve_figure(report, mi, l));
      if (fate) {
        out.push_back(token_fate_figure(report, mi, l, "kept", image));
        out.push_back(token_fate_figure(report, mi, l, "bits", image));
        const std::vector<double> merged = layer_at(method_at(report, mi), l).at("token_fate").at("merged").nums();
        if (std::any_of(merged.begin(), merged.end(), [](double x) { return x > 0; }))
          out.push_back(token_fate_figure(report, mi, l, "merged", image));
      }
      if (att) out.push_back(attention_heatmap_figure(report, l, mi));
    }
  }
  return out;
}

}  // namespace kvlens::fig
