#include "app/figures/figures.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens::fig {

namespace {

constexpr double kPad = 10, kTitle = 15, kTick = 12, kLabel = 13, kLegend = 12, kNote = 11;
constexpr double kTickLen = 4;
const Color kInk{0.15f, 0.15f, 0.17f, 1}, kGrid{0.88f, 0.88f, 0.9f, 1}, kFrame{0.45f, 0.45f, 0.5f, 1};
const Color kWhite{1, 1, 1, 1}, kMissing{0.85f, 0.85f, 0.85f, 1};
// A log-scale heatmap's exact zeros (nothing there: keys a method does not hold), apart from
// the colour map's floor and from missing cells.
const Color kAbsent{0.42f, 0.42f, 0.42f, 1};

Color hex(uint32_t v) {
  return {((v >> 16) & 255) / 255.0f, ((v >> 8) & 255) / 255.0f, (v & 255) / 255.0f, 1};
}

uint64_t fnv1a(const std::vector<uint8_t>& b, uint64_t h = 0xcbf29ce484222325ull) {
  for (uint8_t c : b) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// Tick label for v on a linear axis with ticks `step` apart.
// A label's minus signs as the formulas print them (U+2212), not hyphens.
std::string with_minus_signs(const std::string& s) {
  std::string o;
  for (char c : s) o += c == '-' ? std::string("\u2212") : std::string(1, c);
  return o;
}

// "1.0e-04" → "1.0e−4": the exponent without its padding zeros or plus sign.
std::string short_exponent(const std::string& s) {
  const size_t e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mant = s.substr(0, e), exp = s.substr(e + 1);
  const bool neg = !exp.empty() && exp[0] == '-';
  if (!exp.empty() && (exp[0] == '-' || exp[0] == '+')) exp = exp.substr(1);
  while (exp.size() > 1 && exp[0] == '0') exp = exp.substr(1);
  return mant + "e" + (neg ? "-" : "") + exp;
}

// One linear tick: fixed decimals enough for the step, or (sci, for an axis of tiny or huge
// values) scientific notation with the mantissa digits the step needs.
std::string tick_label(double v, double step, bool sci) {
  if (std::abs(v) < step * 1e-9) v = 0;
  if (sci) {
    if (v == 0) return "0";
    const int d = std::clamp(static_cast<int>(std::floor(std::log10(std::abs(v)) + 1e-9) - std::floor(std::log10(step) + 1e-9)), 0, 6);
    char f[16];
    std::snprintf(f, sizeof f, "%%.%de", d);
    return short_exponent(fmt(f, v));
  }
  const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
  char f[16];
  std::snprintf(f, sizeof f, "%%.%df", std::min(decimals, 6));
  return fmt(f, v);
}

// 10^e as "10" with a superscript exponent ("10⁻⁴").
std::string power_of_ten(int e) {
  static const char* digits[] = {"\u2070", "\u00b9", "\u00b2", "\u00b3", "\u2074",
                                 "\u2075", "\u2076", "\u2077", "\u2078", "\u2079"};
  std::string o = "10";
  if (e < 0) o += "\u207b";
  for (char c : std::to_string(std::abs(e))) o += digits[c - '0'];
  return o;
}

Prim text(double x, double y, const std::string& s, double size, int ha, int va, Color c = kInk, bool vertical = false) {
  Prim p;
  p.type = Prim::Type::Text;
  p.pts = {{x, y}};
  p.text = s;
  p.size = size;
  p.halign = ha, p.valign = va;
  p.color = c, p.vertical = vertical;
  return p;
}

Prim line(std::vector<Point> pts, Color c, double w, bool dashed = false) {
  Prim p;
  p.type = Prim::Type::Polyline;
  p.pts = std::move(pts);
  p.color = c;
  p.width = w;
  p.dashed = dashed;
  return p;
}

Prim rect(Prim::Type t, Rect r, Color c, double w = 1) {
  Prim p;
  p.type = t;
  p.rect = r;
  p.color = c;
  p.width = w;
  return p;
}

Prim circle(double x, double y, double radius, Color c) {
  Prim p;
  p.type = Prim::Type::Circle;
  p.pts = {{x, y}};
  p.width = radius, p.color = c;
  return p;
}

bool valid_on(const Axis& a, double v) { return std::isfinite(v) && (!a.log || v > 0); }

// Ticks of an axis over its (visible) range: its fixed ticks inside the range, or round numbers.
std::vector<Tick> axis_ticks(const Axis& a, int target) {
  if (a.ticks.empty()) return nice_ticks(a.min, a.max, target, a.log);
  std::vector<Tick> t;
  const double lo = std::min(a.min, a.max), hi = std::max(a.min, a.max), eps = (hi - lo) * 1e-9;
  for (const Tick& k : a.ticks)
    if (k.value >= lo - eps && k.value <= hi + eps) t.push_back(k);
  return t;
}

struct LegendEntry {
  std::string label;
  Color color;
  int style;  // 0 line, 1 box, 2 dot
  bool dashed;
  double w;
  bool series = false;  // a series' entry (a click toggles it)
  bool off = false;     // its series is hidden
};

}  // namespace

Color palette(int i) {
  static const uint32_t c[] = {0x4E79A7, 0xF28E2B, 0xE15759, 0x59A14F, 0xB07AA1,
                               0x76B7B2, 0xEDC948, 0xFF9DA7, 0x9C755F, 0x7F7F7F};
  const int n = static_cast<int>(sizeof c / sizeof c[0]);
  return hex(c[((i % n) + n) % n]);
}

Color colormap(double t) {
  // viridis at nine evenly spaced stops, linearly interpolated
  static const uint32_t stops[] = {0x440154, 0x482878, 0x3E4A89, 0x31688E, 0x26828E,
                                   0x1F9E89, 0x35B779, 0x6ECE58, 0xFDE725};
  if (!std::isfinite(t)) return kMissing;
  t = std::clamp(t, 0.0, 1.0) * 8;
  const int i = std::min(7, static_cast<int>(t));
  const double f = t - i;
  const Color a = hex(stops[i]), b = hex(stops[i + 1]);
  return {static_cast<float>(a.r + (b.r - a.r) * f), static_cast<float>(a.g + (b.g - a.g) * f),
          static_cast<float>(a.b + (b.b - a.b) * f), 1};
}

Color with_alpha(Color c, float a) {
  c.a = a;
  return c;
}

const char* series_kind_name(SeriesKind k) {
  switch (k) {
    case SeriesKind::Line: return "line";
    case SeriesKind::StepHistogram: return "step-histogram";
    case SeriesKind::Bars: return "bars";
    case SeriesKind::Heatmap: return "heatmap";
    case SeriesKind::Scatter: return "scatter";
  }
  return "?";
}

std::string format_value(double v) {
  if (!std::isfinite(v)) return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  if (v == std::round(v) && std::abs(v) < 1e7) return fmt("%.0f", v);
  return fmt("%.4g", v);
}

std::vector<Tick> nice_ticks(double lo, double hi, int target, bool log) {
  std::vector<Tick> t;
  if (!std::isfinite(lo) || !std::isfinite(hi)) return t;
  if (lo > hi) std::swap(lo, hi);
  target = std::max(target, 2);
  if (log) {
    if (hi <= 0) return t;
    lo = lo > 0 ? lo : hi * 1e-6;
    const int e0 = static_cast<int>(std::ceil(std::log10(lo) - 1e-9)), e1 = static_cast<int>(std::floor(std::log10(hi) + 1e-9));
    const int every = std::max(1, (e1 - e0 + 1 + target - 1) / target);
    // One notation for the whole axis: decimals while every decade is between 0.001 and
    // 10000, else powers of ten.
    const bool powers = e0 < -3 || e1 > 4;
    for (int e = e0; e <= e1; ++e)
      if ((e - e0) % every == 0)
        t.push_back({std::pow(10.0, e), powers ? power_of_ten(e) : tick_label(std::pow(10.0, e), std::pow(10.0, std::min(e, 0)), false)});
    if (t.size() < 2) {  // less than a decade: fall back to round numbers on the range
      t.clear();
      for (const Tick& k : nice_ticks(lo, hi, target, false))
        if (k.value > 0) t.push_back(k);
    }
    return t;
  }
  if (hi - lo < 1e-300) {
    t.push_back({lo, with_minus_signs(format_value(lo))});
    return t;
  }
  const double raw = (hi - lo) / target, mag = std::pow(10.0, std::floor(std::log10(raw))), n = raw / mag;
  const double step = (n < 1.5 ? 1 : n < 3 ? 2 : n < 7 ? 5 : 10) * mag;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) t.push_back({v, ""});
  // One notation for the whole axis: scientific when its values are all below 0.001 or reach
  // 100000, else fixed decimals.
  double biggest = 0;
  for (const Tick& k : t) biggest = std::max(biggest, std::abs(k.value));
  const bool sci = biggest >= 1e5 || (biggest > 0 && biggest < 1e-3);
  for (Tick& k : t) k.label = with_minus_signs(tick_label(k.value, step, sci));
  return t;
}

double axis_fraction(const Axis& a, double v) {
  if (a.log) {
    const double l0 = std::log10(a.min), l1 = std::log10(a.max);
    return (std::log10(v) - l0) / (l1 - l0);
  }
  return (v - a.min) / (a.max - a.min);
}

double axis_value(const Axis& a, double f) {
  if (a.log) {
    const double l0 = std::log10(a.min), l1 = std::log10(a.max);
    return std::pow(10.0, l0 + f * (l1 - l0));
  }
  return a.min + f * (a.max - a.min);
}

double Frame::px(double v) const { return plot.x0 + axis_fraction(x, v) * plot.width(); }
double Frame::py(double v) const {
  const double f = axis_fraction(y, v);
  return y.inverted ? plot.y0 + f * plot.height() : plot.y1 - f * plot.height();
}
double Frame::data_x(double p) const { return axis_value(x, (p - plot.x0) / plot.width()); }
double Frame::data_y(double p) const {
  const double f = y.inverted ? (p - plot.y0) / plot.height() : (plot.y1 - p) / plot.height();
  return axis_value(y, f);
}

namespace {

// Heatmap pixels: one RGBA pixel per cell, row 0 first.
Prim heatmap_image(const Series& s) {
  Prim p;
  p.type = Prim::Type::Image;
  p.image_w = s.cols;
  p.image_h = s.rows;
  p.rgba.resize(static_cast<size_t>(s.rows) * s.cols * 4);
  const double lo = s.z_log ? std::log10(std::max(s.z_min, 1e-300)) : s.z_min;
  const double hi = s.z_log ? std::log10(std::max(s.z_max, 1e-300)) : s.z_max;
  for (size_t i = 0; i < s.z.size() && i < p.rgba.size() / 4; ++i) {
    double v = s.z[i];
    const bool absent = s.zero_absent && s.z_log && v == 0.0;
    if (s.z_log && !std::isnan(v)) v = v > 0 ? std::log10(v) : lo;
    const Color c = absent ? kAbsent : std::isfinite(v) ? colormap(hi > lo ? (v - lo) / (hi - lo) : 0.5) : kMissing;
    p.rgba[i * 4 + 0] = static_cast<uint8_t>(std::lround(c.r * 255));
    p.rgba[i * 4 + 1] = static_cast<uint8_t>(std::lround(c.g * 255));
    p.rgba[i * 4 + 2] = static_cast<uint8_t>(std::lround(c.b * 255));
    p.rgba[i * 4 + 3] = static_cast<uint8_t>(std::lround(std::clamp(s.alpha, 0.0f, 1.0f) * 255));
  }
  p.image_key = fnv1a(p.rgba, static_cast<uint64_t>(s.rows) * 1000003u + s.cols);
  return p;
}

// An image over `r` from rows of RGBA pixels, row 0 drawn at the bottom when `flip`.
Prim image_prim(const Rect& r, int w, int h, const std::vector<uint8_t>& rgba, bool flip, uint64_t seed) {
  Prim p;
  p.type = Prim::Type::Image;
  p.rect = r;
  p.image_w = w;
  p.image_h = h;
  p.rgba = rgba;
  if (flip) {
    const size_t row = static_cast<size_t>(w) * 4;
    for (int y = 0; y < h / 2; ++y)
      std::swap_ranges(p.rgba.begin() + y * row, p.rgba.begin() + (y + 1) * row, p.rgba.begin() + (h - 1 - y) * row);
  }
  p.image_key = fnv1a(p.rgba, seed);
  return p;
}

}  // namespace

std::pair<std::string, std::string> heatmap_cell_units(double a0, double a1, int n, int i) {
  const double w = (a1 - a0) / n, lo = a0 + i * w;
  if (w > 1.0)  // a pooled block: the whole units it spans
    return {format_number(std::ceil(lo - 1e-9)), format_number(std::ceil(lo + w - 1e-9) - 1)};
  if (w == 1.0 && a0 == std::floor(a0)) return {format_number(lo), ""};
  return {std::to_string(i), ""};
}

namespace {

const Series* first_heatmap(const Figure& f) {
  for (const Series& s : f.series)
    if (s.kind == SeriesKind::Heatmap) return &s;
  return nullptr;
}

}  // namespace

const char* y_scale_name(YScale s) {
  return s == YScale::Linear ? "linear" : s == YScale::Log ? "log" : "as built";
}

YScale parse_y_scale(const std::string& s, const std::string& what) {
  for (YScale y : {YScale::AsBuilt, YScale::Linear, YScale::Log})
    if (s == y_scale_name(y)) return y;
  throw InputError(what + " must be 'as built', 'linear' or 'log', got '" + s + "'");
}

Axis fit_value_axis(const std::string& label, const std::vector<double>& v, bool log) {
  Axis a;
  a.label = label;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, pos_lo = lo;
  for (double x : v) {
    if (!std::isfinite(x)) continue;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    if (x > 0) pos_lo = std::min(pos_lo, x);
  }
  if (lo > hi) {
    a.min = 0;
    a.max = 1;
    return a;
  }
  // The range's ends: whole decades (log) or 0 (linear) where no value lies on them; a value
  // on an end moves that end out by a twentieth of the span (log) or 4 % (linear), so that no
  // point sits on the frame.
  if (log && hi > 0) {
    a.log = true;
    const double l0 = std::log10(pos_lo), l1 = std::log10(hi);
    const double e0 = std::floor(l0), e1 = std::max(std::ceil(l1), e0 + 1), m = (e1 - e0) * 0.05;
    a.min = std::pow(10.0, l0 - e0 < m ? e0 - m : e0);
    a.max = std::pow(10.0, e1 - l1 < m ? e1 + m : e1);
    return a;
  }
  a.min = std::min(0.0, lo);
  const double span = hi > a.min ? hi - a.min : 1.0;
  a.max = hi > a.min ? hi + span * 0.08 : a.min + 1;
  if (lo <= a.min) a.min -= span * 0.04;
  return a;
}

Frame draw(const Figure& f, double W, double H, const TextWidth& measure, const View& view) {
  Frame fr;
  fr.width = W;
  fr.height = H;
  fr.x = f.x;
  fr.y = f.y;
  if (view.zoomed && view.x_max > view.x_min) {
    fr.x.min = view.x_min;
    fr.x.max = view.x_max;
  }
  // The y axis of a value plot fitted again to what is shown, when the view hides series or
  // chooses the scale; then the view's y range.
  fr.hidden = view.hidden;
  if (!fr.y.inverted && fr.y.ticks.empty() && (view.y_scale != YScale::AsBuilt || !view.hidden.empty())) {
    std::vector<double> shown;
    for (const Series& s : f.series)
      if (s.kind != SeriesKind::Heatmap && view.shows(s)) shown.insert(shown.end(), s.y.begin(), s.y.end());
    const bool log = view.y_scale == YScale::Log || (view.y_scale == YScale::AsBuilt && f.y.log);
    if (!shown.empty()) {
      const Axis a = fit_value_axis(f.y.label, shown, log);
      fr.y.min = a.min;
      fr.y.max = a.max;
      fr.y.log = a.log;
    }
  }
  if (view.y_zoomed && view.y_max > view.y_min && (!fr.y.log || view.y_min > 0)) {
    fr.y.min = view.y_min;
    fr.y.max = view.y_max;
  }
  std::vector<Prim>& P = fr.prims;
  P.push_back(rect(Prim::Type::FillRect, {0, 0, W, H}, kWhite));

  // Legend entries.
  std::vector<LegendEntry> legend;
  if (f.legend) {
    for (const Series& s : f.series) {
      if (s.label.empty() || s.kind == SeriesKind::Heatmap) continue;
      const int style = s.kind == SeriesKind::Line ? 0 : s.kind == SeriesKind::Scatter ? 2 : 1;
      legend.push_back({s.label, s.color, style, s.dashed, 0, true, !view.shows(s)});
    }
    for (const Band& b : f.bands)
      if (!b.label.empty()) legend.push_back({b.label, b.color, 1, false, 0});
    for (const Marker& m : f.markers)
      if (!m.label.empty()) legend.push_back({m.label, m.color, 0, m.dashed, 0});
  }
  for (LegendEntry& e : legend) e.w = 22 + measure(e.label, kLegend) + 14;
  std::vector<std::vector<const LegendEntry*>> rows;
  {
    double used = 0;
    const double avail = std::max(40.0, W - 2 * kPad);
    for (const LegendEntry& e : legend) {
      if (rows.empty() || used + e.w > avail) {
        rows.emplace_back();
        used = 0;
      }
      rows.back().push_back(&e);
      used += e.w;
    }
  }
  const double legend_row = kLegend * 1.55;

  // Margins.
  double top = kPad;
  if (!f.title.empty()) top += kTitle * 1.45;
  top += rows.size() * legend_row + (rows.empty() ? 4 : 6);
  double bottom = kPad + kTick * 1.3 + kTickLen + 2;
  if (!f.x.label.empty()) bottom += kLabel * 1.45;
  // The note, wrapped at spaces to the figure's width (a word longer than that keeps its line).
  std::vector<std::string> note;
  for (size_t at = 0; at < f.note.size();) {
    size_t end = f.note.find(' ', at);
    std::string word = f.note.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (!note.empty() && measure(note.back() + " " + word, kNote) <= W - 2 * kPad) note.back() += " " + word;
    else note.push_back(word);
    at = end == std::string::npos ? f.note.size() : end + 1;
  }
  if (!note.empty()) bottom += kNote * (1.5 + 1.25 * (note.size() - 1));
  const std::vector<Tick> yt = axis_ticks(fr.y, std::max(2, static_cast<int>((H - top - bottom) / 45)));
  double ytw = 0;
  for (const Tick& t : yt) ytw = std::max(ytw, measure(t.label, kTick));
  double left = kPad + ytw + kTickLen + 4;
  if (!f.y.label.empty()) left += kLabel * 1.45;
  double right = kPad + 6;
  const Series* hm = first_heatmap(f);
  std::vector<Tick> cbt;
  if (hm && !f.colorbar.empty()) {
    cbt = nice_ticks(hm->z_min, hm->z_max, 4, hm->z_log);
    double w = 0;
    for (const Tick& t : cbt) w = std::max(w, measure(t.label, kTick));
    right += 10 + 12 + kTickLen + 3 + w + kLabel * 1.45;
  }
  fr.plot = {left, top, std::max(left + 20, W - right), std::max(top + 20, H - bottom)};
  if (f.aspect > 0 && !fr.x.log && !fr.y.log && fr.x.max > fr.x.min && fr.y.max > fr.y.min) {
    const double ux = fr.plot.width() / (fr.x.max - fr.x.min), uy = fr.plot.height() / (fr.y.max - fr.y.min);
    if (ux > f.aspect * uy) {  // too wide: narrower, centred
      const double w = f.aspect * uy * (fr.x.max - fr.x.min), x0 = fr.plot.x0 + (fr.plot.width() - w) / 2;
      fr.plot.x0 = x0;
      fr.plot.x1 = x0 + w;
    } else {  // too tall: shorter, at the top
      fr.plot.y1 = fr.plot.y0 + ux / f.aspect * (fr.y.max - fr.y.min);
    }
  }
  const Rect& pr = fr.plot;
  const std::vector<Tick> xt = axis_ticks(fr.x, std::max(2, static_cast<int>(pr.width() / 80)));

  // Grid.
  for (const Tick& t : xt) {
    const double x = fr.px(t.value);
    P.push_back(line({{x, pr.y0}, {x, pr.y1}}, kGrid, 1));
  }
  for (const Tick& t : yt) {
    const double y = fr.py(t.value);
    P.push_back(line({{pr.x0, y}, {pr.x1, y}}, kGrid, 1));
  }

  // Data, clipped to the plot area.
  Prim clip = rect(Prim::Type::Clip, pr, kInk);
  P.push_back(clip);
  for (const Band& b : f.bands) {
    Rect r = pr;
    if (b.axis == 'x') {
      r.x0 = fr.px(b.from);
      r.x1 = fr.px(b.to);
      if (r.x0 > r.x1) std::swap(r.x0, r.x1);
    } else {
      r.y0 = fr.py(b.to);
      r.y1 = fr.py(b.from);
      if (r.y0 > r.y1) std::swap(r.y0, r.y1);
    }
    P.push_back(rect(Prim::Type::FillRect, r, b.color));
  }
  std::vector<Rect> labels;  // the scatter point labels placed so far
  for (const Series& s : f.series) {
    if (!view.shows(s)) continue;
    switch (s.kind) {
      case SeriesKind::Heatmap: {
        if (s.rows <= 0 || s.cols <= 0) break;
        const Prim cells = heatmap_image(s);
        const double ya = fr.py(s.y0), yb = fr.py(s.y1);
        const Rect r{fr.px(s.x0), std::min(ya, yb), fr.px(s.x1), std::max(ya, yb)};
        // Rows run along y from y0; when y0 is drawn at the bottom, the pixel rows flip.
        if (s.backdrop && s.backdrop_w > 0 && s.backdrop_h > 0 &&
            s.backdrop->size() == static_cast<size_t>(s.backdrop_w) * s.backdrop_h * 4)
          P.push_back(image_prim(r, s.backdrop_w, s.backdrop_h, *s.backdrop, ya > yb, 0x6261636bu));
        P.push_back(image_prim(r, s.cols, s.rows, cells.rgba, ya > yb, cells.image_key));
        break;
      }
      case SeriesKind::Bars:
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
          if (!valid_on(fr.y, s.y[i]) || !std::isfinite(s.x[i])) continue;
          const double base = fr.y.log ? fr.y.min : std::max(std::min(0.0, fr.y.max), fr.y.min);
          double x0 = fr.px(s.x[i] - s.bar_width / 2), x1 = fr.px(s.x[i] + s.bar_width / 2);
          double y0 = fr.py(s.y[i]), y1 = fr.py(base);
          if (y0 > y1) std::swap(y0, y1);
          P.push_back(rect(Prim::Type::FillRect, {x0, y0, x1, y1}, s.color));
        }
        break;
      case SeriesKind::StepHistogram: {
        const size_t n = std::min(s.y.size(), s.x.empty() ? 0 : s.x.size() - 1);
        if (n == 0) break;
        const double base = fr.py(fr.y.log ? fr.y.min : 0.0);
        if (s.fill)
          for (size_t i = 0; i < n; ++i) {
            if (!(s.y[i] > 0)) continue;
            const double y = fr.py(s.y[i]);
            P.push_back(rect(Prim::Type::FillRect, {fr.px(s.x[i]), std::min(y, base), fr.px(s.x[i + 1]), std::max(y, base)},
                             with_alpha(s.color, 0.16f)));
          }
        std::vector<Point> pts{{fr.px(s.x[0]), base}};
        for (size_t i = 0; i < n; ++i) {
          const double y = valid_on(fr.y, s.y[i]) ? fr.py(s.y[i]) : base;
          pts.push_back({fr.px(s.x[i]), y});
          pts.push_back({fr.px(s.x[i + 1]), y});
        }
        pts.push_back({fr.px(s.x[n]), base});
        P.push_back(line(std::move(pts), s.color, s.line_width, s.dashed));
        break;
      }
      case SeriesKind::Line: {
        std::vector<Point> run;
        auto flush = [&] {
          if (run.size() > 1) P.push_back(line(run, s.color, s.line_width, s.dashed));
          run.clear();
        };
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
          if (!valid_on(fr.x, s.x[i]) || !valid_on(fr.y, s.y[i])) {
            flush();
            continue;
          }
          run.push_back({fr.px(s.x[i]), fr.py(s.y[i])});
          if (s.markers) P.push_back(circle(run.back().x, run.back().y, 2.6, s.color));
        }
        flush();
        break;
      }
      case SeriesKind::Scatter:
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
          if (!valid_on(fr.x, s.x[i]) || !valid_on(fr.y, s.y[i])) continue;
          const double x = fr.px(s.x[i]), y = fr.py(s.y[i]);
          P.push_back(circle(x, y, 4.5, s.color));
          if (i < s.point_labels.size() && !s.point_labels[i].empty()) {
            // Right of the point, or left of it where the plot ends; moved up (then down) a
            // line at a time past the labels already placed, so none covers another; a label
            // moved away is tied to its point by a thin leader.
            const double size = kLegend - 1, w = measure(s.point_labels[i], size), h = size * 1.25;
            const bool left = x + 7 + w > pr.x1;
            const double x0 = left ? x - 7 - w : x + 7, top0 = y - 2 - h;
            double top = top0;
            for (int k = 1; k <= 12; ++k) {
              const Rect box{x0, top, x0 + w, top + h};
              if (std::none_of(labels.begin(), labels.end(), [&](const Rect& o) {
                    return box.x0 < o.x1 && o.x0 < box.x1 && box.y0 < o.y1 && o.y0 < box.y1;
                  }))
                break;
              top = top0 + (k % 2 ? -1 : 1) * ((k + 1) / 2) * h;
            }
            labels.push_back(Rect{x0, top, x0 + w, top + h});
            if (top != top0) {
              const double lx = left ? x0 + w + 1 : x0 - 1, ly = top + h * 0.6, d = std::hypot(lx - x, ly - y);
              P.push_back(line({{x + (lx - x) * 4.5 / d, y + (ly - y) * 4.5 / d}, {lx, ly}}, Color{0.45f, 0.45f, 0.5f, 1}, 0.7));
            }
            P.push_back(text(left ? x - 7 : x + 7, top + h, s.point_labels[i], size, left ? 1 : -1, 1, kInk));
          }
        }
        break;
    }
  }
  for (const Marker& m : f.markers) {
    if (m.axis == 'x') {
      const double x = fr.px(m.at);
      P.push_back(line({{x, pr.y0}, {x, pr.y1}}, m.color, 1.4, m.dashed));
    } else {
      const double y = fr.py(m.at);
      P.push_back(line({{pr.x0, y}, {pr.x1, y}}, m.color, 1.4, m.dashed));
    }
  }
  Prim unclip;
  unclip.type = Prim::Type::Unclip;
  P.push_back(unclip);

  // Frame, ticks and labels.
  P.push_back(rect(Prim::Type::StrokeRect, pr, kFrame, 1));
  {
    double last_right = -1e30;  // skip x labels that would overlap the previous one
    for (const Tick& t : xt) {
      const double x = fr.px(t.value);
      P.push_back(line({{x, pr.y1}, {x, pr.y1 + kTickLen}}, kFrame, 1));
      const double w = measure(t.label, kTick);
      if (x - w / 2 < last_right + 4) continue;
      P.push_back(text(x, pr.y1 + kTickLen + 2, t.label, kTick, 0, -1));
      last_right = x + w / 2;
    }
    for (const Tick& t : yt) {
      const double y = fr.py(t.value);
      P.push_back(line({{pr.x0 - kTickLen, y}, {pr.x0, y}}, kFrame, 1));
      P.push_back(text(pr.x0 - kTickLen - 3, y, t.label, kTick, 1, 0));
    }
  }
  double yb = pr.y1 + kTickLen + 2 + kTick * 1.3;
  if (!f.x.label.empty()) {
    P.push_back(text((pr.x0 + pr.x1) / 2, yb + 2, f.x.label, kLabel, 0, -1));
    yb += kLabel * 1.45;
  }
  if (!f.y.label.empty())
    P.push_back(text(kPad, (pr.y0 + pr.y1) / 2, f.y.label, kLabel, 0, -1, kInk, true));
  for (size_t i = 0; i < note.size(); ++i)
    P.push_back(text(kPad, H - kPad - kNote * 1.25 * (note.size() - 1 - i), note[i], kNote, -1, 1, kFrame));
  double ty = kPad;
  if (!f.title.empty()) {
    P.push_back(text(W / 2, ty, f.title, kTitle, 0, -1));
    ty += kTitle * 1.45;
  }
  for (const auto& row : rows) {
    double x = std::max(kPad, std::min(pr.x0, W - kPad - [&] {
      double w = 0;
      for (const LegendEntry* e : row) w += e->w;
      return w;
    }()));
    const double cy = ty + legend_row / 2;
    for (const LegendEntry* e : row) {
      const Color c = e->off ? kGrid : e->color;  // a hidden series: greyed
      if (e->style == 0) P.push_back(line({{x, cy}, {x + 18, cy}}, c, 2.2, e->dashed));
      if (e->style == 1) P.push_back(rect(Prim::Type::FillRect, {x + 2, cy - 5, x + 16, cy + 5}, c));
      if (e->style == 2) P.push_back(circle(x + 9, cy, 4.5, c));
      P.push_back(text(x + 22, cy, e->label, kLegend, -1, 0, e->off ? kFrame : kInk));
      if (e->series) fr.legend_series.push_back({Rect{x, cy - legend_row / 2, x + e->w, cy + legend_row / 2}, e->label});
      x += e->w;
    }
    ty += legend_row;
  }
  if (hm && !f.colorbar.empty()) {
    const Rect cb{pr.x1 + 10, pr.y0, pr.x1 + 22, pr.y1};
    Prim g;
    g.type = Prim::Type::Image;
    g.rect = cb;
    g.image_w = 1;
    g.image_h = 64;
    for (int i = 0; i < 64; ++i) {
      const Color c = colormap(1.0 - i / 63.0);
      for (float v : {c.r, c.g, c.b}) g.rgba.push_back(static_cast<uint8_t>(std::lround(v * 255)));
      g.rgba.push_back(255);
    }
    g.image_key = fnv1a(g.rgba, 77);
    P.push_back(std::move(g));
    P.push_back(rect(Prim::Type::StrokeRect, cb, kFrame, 1));
    Axis za;
    za.min = hm->z_min;
    za.max = hm->z_max;
    za.log = hm->z_log;
    double w = 0;
    for (const Tick& t : cbt) {
      const double y = cb.y1 - axis_fraction(za, t.value) * cb.height();
      if (y < cb.y0 - 0.5 || y > cb.y1 + 0.5) continue;
      P.push_back(line({{cb.x1, y}, {cb.x1 + kTickLen, y}}, kFrame, 1));
      P.push_back(text(cb.x1 + kTickLen + 3, y, t.label, kTick, -1, 0));
      w = std::max(w, measure(t.label, kTick));
    }
    P.push_back(text(cb.x1 + kTickLen + 3 + w + 4, (cb.y0 + cb.y1) / 2, f.colorbar, kLabel, 0, -1, kInk, true));
  }
  return fr;
}

std::vector<std::string> readout(const Figure& f, const Frame& fr, double px, double py) {
  std::vector<std::string> out;
  if (!fr.plot.contains(px, py)) return out;
  const double x = fr.data_x(px), y = fr.data_y(py);
  auto x_text = [&](double v) {
    for (const Tick& t : f.x.ticks)
      if (std::abs(t.value - v) < 1e-9 * (1 + std::abs(v))) return t.label;
    return format_value(v);
  };
  for (const Series& s : f.series) {
    if (!series_shown(s, fr.hidden)) continue;
    const std::string name = s.label.empty() ? series_kind_name(s.kind) : s.label;
    switch (s.kind) {
      case SeriesKind::Line: {
        double best = 24;
        int at = -1;
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
          if (!valid_on(fr.x, s.x[i]) || !valid_on(fr.y, s.y[i])) continue;
          const double d = std::abs(fr.px(s.x[i]) - px);
          if (d < best) {
            best = d;
            at = static_cast<int>(i);
          }
        }
        if (at >= 0) out.push_back(name + ": x = " + x_text(s.x[at]) + ", y = " + format_value(s.y[at]));
        break;
      }
      case SeriesKind::StepHistogram:
        for (size_t i = 0; i + 1 < s.x.size() && i < s.y.size(); ++i)
          if (x >= s.x[i] && x < s.x[i + 1]) {
            out.push_back(name + ": [" + format_value(s.x[i]) + ", " + format_value(s.x[i + 1]) + ") " + format_value(s.y[i]));
            break;
          }
        break;
      case SeriesKind::Bars:
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
          if (std::abs(x - s.x[i]) <= s.bar_width / 2) {
            out.push_back(name + ": x = " + x_text(s.x[i]) + ", y = " + format_value(s.y[i]));
            break;
          }
        break;
      case SeriesKind::Heatmap: {
        if (s.rows <= 0 || s.cols <= 0) break;
        const int c = static_cast<int>(std::floor((x - s.x0) / (s.x1 - s.x0) * s.cols));
        const int r = static_cast<int>(std::floor((y - s.y0) / (s.y1 - s.y0) * s.rows));
        if (c < 0 || c >= s.cols || r < 0 || r >= s.rows) break;
        auto place = [](double a0, double a1, int n, int i) {
          const auto [lo, hi] = heatmap_cell_units(a0, a1, n, i);
          return hi.empty() ? lo : lo + "-" + hi;
        };
        out.push_back((s.label.empty() ? std::string() : s.label + ": ") + f.y.label + " " +
                      place(s.y0, s.y1, s.rows, r) + ", " + f.x.label + " " + place(s.x0, s.x1, s.cols, c) + ": " +
                      format_value(s.z[static_cast<size_t>(r) * s.cols + c]));
        break;
      }
      case SeriesKind::Scatter: {
        double best = 12;
        int at = -1;
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
          if (!valid_on(fr.x, s.x[i]) || !valid_on(fr.y, s.y[i])) continue;
          const double d = std::hypot(fr.px(s.x[i]) - px, fr.py(s.y[i]) - py);
          if (d < best) {
            best = d;
            at = static_cast<int>(i);
          }
        }
        if (at >= 0) {
          const std::string pl = static_cast<size_t>(at) < s.point_labels.size() ? " " + s.point_labels[at] : "";
          out.push_back(name + pl + ": x = " + format_value(s.x[at]) + ", y = " + format_value(s.y[at]));
        }
        break;
      }
    }
  }
  return out;
}

}  // namespace kvlens::fig
