// Figures as plain data, and one layout of them into drawing primitives.
//
// A Figure holds axes (range, label, ticks), series (line, step histogram, bars, heatmap,
// scatter), a legend, a title and annotations (vertical or horizontal markers, shaded bands).
// Builders in app/figures/figures_report.h make them from a run report with pure functions.
//
// draw() lays a figure out at a given pixel size into a list of primitives (polylines, rects,
// circles, text, images) that a renderer executes without deciding anything: Cairo for PNG, SVG
// and PDF (app/figure_cairo), ImDrawList on screen (app/gui/figure_imgui). One description, one
// layout, two renderers: what is exported is what was seen. Text widths come from the renderer's
// font (both use DejaVu Sans).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace kvlens::fig {

struct Color {
  float r = 0, g = 0, b = 0, a = 1;
};
Color palette(int i);        // categorical colours, distinguishable, cycling
Color colormap(double t);    // sequential (viridis), t clamped to [0, 1]
Color with_alpha(Color c, float a);

enum class SeriesKind { Line, StepHistogram, Bars, Heatmap, Scatter };
const char* series_kind_name(SeriesKind k);

struct Series {
  SeriesKind kind = SeriesKind::Line;
  std::string label;  // legend text; empty = not in the legend
  Color color;
  bool dashed = false;
  double line_width = 1.6;
  bool markers = false;  // Line: a dot on every point
  bool fill = false;     // StepHistogram: shade under the steps
  // Line / Scatter: points (x[i], y[i]). StepHistogram: x = bin edges (n + 1), y = counts (n).
  // Bars: x = bar centres, y = heights, each bar_width wide (x units).
  std::vector<double> x, y;
  double bar_width = 0.8;
  std::vector<std::string> point_labels;  // Scatter: drawn beside each point
  // Heatmap: z is rows × cols, row r spanning y in [y0 + r·dy, y0 + (r+1)·dy], column c spanning
  // x in [x0 + c·dx, x0 + (c+1)·dx]. Colours map [z_min, z_max] (log10 when z_log) through
  // colormap(); NaN cells are drawn light grey.
  int rows = 0, cols = 0;
  std::vector<double> z;
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  double z_min = 0, z_max = 1;
  bool z_log = false;
  bool zero_absent = false;  // (z_log) an exact 0 means nothing there: drawn dark grey, not as z_min
  // Heatmap: the cells' opacity, and an image drawn beneath them over the same rectangle
  // (backdrop_w × backdrop_h RGBA pixels, row 0 at y0 as the cells; null: none).
  float alpha = 1;
  int backdrop_w = 0, backdrop_h = 0;
  std::shared_ptr<const std::vector<uint8_t>> backdrop;
};

struct Tick {
  double value = 0;
  std::string label;
};

struct Axis {
  std::string label;
  double min = 0, max = 1;
  bool log = false;       // log10 scale (min, max > 0)
  bool inverted = false;  // y: min at the top (matrix rows downwards)
  // Fixed ticks (layers, categories); empty = round numbers over the visible range.
  std::vector<Tick> ticks;
};

// A line across the plot at x = at (axis 'x': vertical) or y = at (axis 'y': horizontal).
struct Marker {
  char axis = 'x';
  double at = 0;
  std::string label;
  Color color;
  bool dashed = true;
};

// A shaded stripe over [from, to] of one axis.
struct Band {
  char axis = 'x';
  double from = 0, to = 0;
  std::string label;
  Color color;
};

struct Figure {
  std::string id;     // file name stem, e.g. "softmax_mse_by_layer"
  std::string title;
  std::string note;   // one line under the plot (what the numbers are), may be empty
  Axis x, y;
  std::vector<Series> series;
  std::vector<Marker> markers;
  std::vector<Band> bands;
  std::string colorbar;  // label of the heatmap colour bar; empty = none
  bool legend = true;
  // > 0: the plot area keeps (pixels per x unit) / (pixels per y unit) at this ratio on linear
  // axes (1 = a unit as long across as down: square patch grids), narrowed or shortened to fit.
  double aspect = 0;
  // What the figure shows, for its data's columns and file names: one method (empty: each
  // series is one method, or none), one layer and one head (-1: every layer / every head or
  // their mean).
  std::string method;
  int layer = -1, head = -1;
};

// Round-number ticks covering [lo, hi] (about `target` of them); on a log axis, powers of ten.
std::vector<Tick> nice_ticks(double lo, double hi, int target, bool log);
// Position of v along the axis as a fraction of [min, max] (log-aware; not clamped).
double axis_fraction(const Axis& a, double v);
// The value at a fraction along the axis (inverse of axis_fraction).
double axis_value(const Axis& a, double f);
// Shortest readable text of a number ("0.25", "1.2e-05", "3").
std::string format_value(double v);

// ----- layout into primitives -------------------------------------------------------------

struct Point {
  double x = 0, y = 0;
};
struct Rect {
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
  bool contains(double x, double y) const { return x >= x0 && x <= x1 && y >= y0 && y <= y1; }
  double width() const { return x1 - x0; }
  double height() const { return y1 - y0; }
};

struct Prim {
  enum class Type { Polyline, FillRect, StrokeRect, Circle, Text, Image, Clip, Unclip };
  Type type = Type::Polyline;
  Color color;
  std::vector<Point> pts;   // Polyline: the points; Circle: the centre
  double width = 1;         // Polyline / StrokeRect line width; Circle radius
  bool dashed = false;
  Rect rect;                // FillRect, StrokeRect, Image target, Clip
  // Text: drawn at pts[0]; halign -1 left / 0 centre / 1 right of it, valign -1 top / 0 middle /
  // 1 bottom; vertical = rotated 90° anticlockwise (reads bottom to top).
  std::string text;
  double size = 12;
  int halign = -1, valign = -1;
  bool vertical = false;
  // Image: image_w × image_h RGBA pixels stretched over rect, nearest-neighbour. image_key
  // changes whenever the pixels do (renderers may cache textures by it).
  int image_w = 0, image_h = 0;
  std::vector<uint8_t> rgba;
  uint64_t image_key = 0;
};

// Width in pixels of `text` at font size `size` (pixels), as the renderer's font draws it.
using TextWidth = std::function<double(const std::string& text, double size)>;

// How a figure is looked at on screen: the visible x range (zoom and pan; unset = the figure's
// own), the y axis's scale and range, and the series hidden from the plot (by legend label; the
// legend still lists them, greyed).
enum class YScale : uint8_t { AsBuilt, Linear, Log };
// Whether `s` is drawn with the series of `hidden` (by label) hidden: a heatmap or an unlabelled
// series always is.
inline bool series_shown(const Series& s, const std::set<std::string>& hidden) {
  return s.kind == SeriesKind::Heatmap || s.label.empty() || !hidden.count(s.label);
}
struct View {
  bool zoomed = false;
  double x_min = 0, x_max = 0;
  YScale y_scale = YScale::AsBuilt;
  bool y_zoomed = false;
  double y_min = 0, y_max = 0;
  std::set<std::string> hidden;
  bool shows(const Series& s) const { return series_shown(s, hidden); }
  // Back to the figure's own ranges and scale; the hidden series stay hidden.
  void reset_zoom() {
    std::set<std::string> h = std::move(hidden);
    *this = View{};
    hidden = std::move(h);
  }
};
// "as built" / "linear" / "log"; parse_y_scale throws InputError naming `what` otherwise.
const char* y_scale_name(YScale s);
YScale parse_y_scale(const std::string& s, const std::string& what);
// The y axis of a value plot fitted to the values: log10 when `log` and some are positive (from
// the decade below the smallest positive to the decade above the largest), else linear from
// min(0, smallest) to 8 % above the largest.
Axis fit_value_axis(const std::string& label, const std::vector<double>& v, bool log);

struct Frame {
  double width = 0, height = 0;
  Rect plot;   // the plot area, pixels
  Axis x, y;   // the axes as drawn: visible range and ticks
  std::vector<Prim> prims;
  // The legend's series entries as drawn (pixels) with their labels: what a click toggles.
  std::vector<std::pair<Rect, std::string>> legend_series;
  std::set<std::string> hidden;  // the view's hidden series (readout skips them)
  double px(double x) const;  // data → pixels
  double py(double y) const;
  double data_x(double px) const;  // pixels → data
  double data_y(double py) const;
};

// Lays `f` out on a width × height canvas (pixels; the font sizes are pixels too).
Frame draw(const Figure& f, double width, double height, const TextWidth& measure, const View& view = {});

// What is under the pixel (px, py) of a drawn frame: one line per series that has data there
// ("label: x = 3, y = 0.012"); empty when nothing is.
std::vector<std::string> readout(const Figure& f, const Frame& frame, double px, double py);

// One CSV field (RFC 4180): quoted, with its quotes doubled, when it holds a comma, a quote or a
// line break.
std::string csv_field(const std::string& s);

// The plotted data as one tidy CSV table (RFC 4180; what pandas.read_csv loads as is): the
// header figure,series,kind,x,x_hi,y,value,label,method,layer,head, then one row per point of
// every series. x and y are the point (a line, bars or a scatter: label is a scatter point's
// text), a histogram bin is [x, x_hi) with y its count, a heatmap cell is column x, row y with
// its value (heatmap_cell_units: a cell that pools several positions gives its first and last
// column as x and x_hi, and its first row); fields that do not apply are empty. method, layer and head are the figure's
// (Figure::method, layer, head), else the series label names the method; empty when -1.
std::string figure_csv(const Figure& f);

// Cell i of n along a heatmap axis from a0 to a1, in the axis's units: a cell wider than one
// unit (a pooled block of positions) gives the first and last whole unit it spans; a cell one
// unit wide starting at a whole unit gives that unit; any other gives its index i. The second
// is empty unless the cell spans several units.
std::pair<std::string, std::string> heatmap_cell_units(double a0, double a1, int n, int i);

}  // namespace kvlens::fig
