// A figure's data as one tidy CSV table (figure_csv): one header, a row a point.
#include <cstdio>
#include <string>

#include "app/figures/figures.h"

namespace kvlens::fig {

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\r\n") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

namespace {
std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
}  // namespace

std::string figure_csv(const Figure& f) {
  std::string o = "figure,series,kind,x,x_hi,y,value,label,method,layer,head\n";
  const std::string tail = "," + csv_field(f.method) + "," + (f.layer >= 0 ? std::to_string(f.layer) : "") + "," +
                           (f.head >= 0 ? std::to_string(f.head) : "") + "\n";
  for (const Series& s : f.series) {
    // figure, series, kind, then the point's fields
    const std::string head = csv_field(f.id) + "," + csv_field(s.label) + "," + series_kind_name(s.kind) + ",";
    auto row = [&](const std::string& x, const std::string& x_hi, const std::string& y, const std::string& value,
                   const std::string& label) {
      o += head + x + "," + x_hi + "," + y + "," + value + "," + csv_field(label) + tail;
    };
    switch (s.kind) {
      case SeriesKind::Line:
      case SeriesKind::Bars:
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) row(num(s.x[i]), "", num(s.y[i]), "", "");
        break;
      case SeriesKind::Scatter:
        for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i)
          row(num(s.x[i]), "", num(s.y[i]), "", i < s.point_labels.size() ? s.point_labels[i] : "");
        break;
      case SeriesKind::StepHistogram:
        for (size_t i = 0; i + 1 < s.x.size() && i < s.y.size(); ++i) row(num(s.x[i]), num(s.x[i + 1]), num(s.y[i]), "", "");
        break;
      case SeriesKind::Heatmap:
        for (int r = 0; r < s.rows; ++r) {
          const std::string y = heatmap_cell_units(s.y0, s.y1, s.rows, r).first;
          for (int c = 0; c < s.cols; ++c) {
            const auto [x, x_hi] = heatmap_cell_units(s.x0, s.x1, s.cols, c);
            row(x, x_hi, y, num(s.z[static_cast<size_t>(r) * s.cols + c]), "");
          }
        }
        break;
    }
  }
  return o;
}

}  // namespace kvlens::fig
