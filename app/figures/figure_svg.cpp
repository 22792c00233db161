#include "app/figures/figure_svg.h"

#include <cmath>
#include <cstdio>

#include "core/data/image.h"

namespace kvlens::fig {

namespace {

// DejaVu Sans's ascent and descent as shares of the font size (its hhea metrics, 1901 and 483
// of 2048 units): where a renderer that aligns text by its font's extents puts the baseline.
constexpr double kAscent = 1901.0 / 2048.0, kDescent = 483.0 / 2048.0;

std::string n(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", std::abs(v) < 1e-9 ? 0.0 : v);
  return b;
}

std::string rgb(const Color& c) {
  auto ch = [](float x) { return std::to_string(static_cast<int>(std::lround(std::fmin(1.0f, std::fmax(0.0f, x)) * 255))); };
  return "rgb(" + ch(c.r) + "," + ch(c.g) + "," + ch(c.b) + ")";
}

std::string opacity(const char* attr, const Color& c) {
  return c.a >= 1.0f ? std::string() : std::string(" ") + attr + "=\"" + n(c.a) + "\"";
}

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string base64(const std::string& in) {
  static const char* t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string o;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (static_cast<uint8_t>(in[i]) << 16) | (static_cast<uint8_t>(in[i + 1]) << 8) | static_cast<uint8_t>(in[i + 2]);
    o += t[v >> 18], o += t[(v >> 12) & 63], o += t[(v >> 6) & 63], o += t[v & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t v = static_cast<uint8_t>(in[i]) << 16;
    o += t[v >> 18], o += t[(v >> 12) & 63], o += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t v = (static_cast<uint8_t>(in[i]) << 16) | (static_cast<uint8_t>(in[i + 1]) << 8);
    o += t[v >> 18], o += t[(v >> 12) & 63], o += t[(v >> 6) & 63], o += '=';
  }
  return o;
}

std::string rect_attrs(const Rect& r) {
  return "x=\"" + n(r.x0) + "\" y=\"" + n(r.y0) + "\" width=\"" + n(r.width()) + "\" height=\"" + n(r.height()) + "\"";
}

}  // namespace

std::string svg_document(const Frame& frame) {
  std::string o = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  // One user unit a point, as the PDF: a figure laid out at 720 × 450 is 10 × 6.25 inches.
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" xmlns:xlink=\"http://www.w3.org/1999/xlink\" width=\"" + n(frame.width) +
       "pt\" height=\"" + n(frame.height) + "pt\" viewBox=\"0 0 " + n(frame.width) + " " + n(frame.height) + "\">\n";
  int clips = 0, open = 0;
  for (const Prim& p : frame.prims) {
    switch (p.type) {
      case Prim::Type::Polyline: {
        if (p.pts.size() < 2) break;
        o += "<polyline fill=\"none\" stroke=\"" + rgb(p.color) + "\"" + opacity("stroke-opacity", p.color) +
             " stroke-width=\"" + n(p.width) + "\" stroke-linejoin=\"round\"" +
             (p.dashed ? " stroke-dasharray=\"5,3.5\"" : "") + " points=\"";
        for (size_t i = 0; i < p.pts.size(); ++i) o += (i ? " " : "") + n(p.pts[i].x) + "," + n(p.pts[i].y);
        o += "\"/>\n";
        break;
      }
      case Prim::Type::FillRect:
        o += "<rect " + rect_attrs(p.rect) + " fill=\"" + rgb(p.color) + "\"" + opacity("fill-opacity", p.color) + "/>\n";
        break;
      case Prim::Type::StrokeRect:
        o += "<rect " + rect_attrs(p.rect) + " fill=\"none\" stroke=\"" + rgb(p.color) + "\"" +
             opacity("stroke-opacity", p.color) + " stroke-width=\"" + n(p.width) + "\"/>\n";
        break;
      case Prim::Type::Circle:
        if (p.pts.empty()) break;
        o += "<circle cx=\"" + n(p.pts[0].x) + "\" cy=\"" + n(p.pts[0].y) + "\" r=\"" + n(p.width) + "\" fill=\"" +
             rgb(p.color) + "\"" + opacity("fill-opacity", p.color) + "/>\n";
        break;
      case Prim::Type::Text: {
        if (p.pts.empty() || p.text.empty()) break;
        // Anchored as the raster renderer anchors it: horizontally by the advance, vertically by
        // the font's ascent and descent; rotated about the anchor for vertical text.
        const char* anchor = p.halign < 0 ? "start" : p.halign == 0 ? "middle" : "end";
        const double dy = p.valign < 0 ? kAscent * p.size : p.valign == 0 ? (kAscent - kDescent) / 2 * p.size : -kDescent * p.size;
        const double x = p.pts[0].x, y = p.pts[0].y;
        // (A rotation by −90° about the anchor turns the baseline offset dy into +dy along x.)
        o += "<text x=\"" + n(p.vertical ? x + dy : x) + "\" y=\"" + n(p.vertical ? y : y + dy) + "\" font-family=\"" +
             std::string(kFigureFont) + "\" font-size=\"" + n(p.size) + "\" text-anchor=\"" + anchor + "\" fill=\"" +
             rgb(p.color) + "\"" + opacity("fill-opacity", p.color);
        if (p.vertical) o += " transform=\"rotate(-90 " + n(x + dy) + " " + n(y) + ")\"";
        o += ">" + escape(p.text) + "</text>\n";
        break;
      }
      case Prim::Type::Image: {
        if (p.image_w <= 0 || p.image_h <= 0 || p.rect.width() <= 0 || p.rect.height() <= 0) break;
        const std::string png = encode_png_rgba(p.image_w, p.image_h, p.rgba.data());
        const std::string uri = "data:image/png;base64," + base64(png);
        o += "<image " + rect_attrs(p.rect) + " preserveAspectRatio=\"none\" style=\"image-rendering:pixelated\" href=\"" +
             uri + "\" xlink:href=\"" + uri + "\"/>\n";
        break;
      }
      case Prim::Type::Clip: {
        const std::string id = "clip" + std::to_string(clips++);
        o += "<clipPath id=\"" + id + "\"><rect " + rect_attrs(p.rect) + "/></clipPath>\n<g clip-path=\"url(#" + id + ")\">\n";
        ++open;
        break;
      }
      case Prim::Type::Unclip:
        if (open > 0) o += "</g>\n", --open;
        break;
    }
  }
  for (; open > 0; --open) o += "</g>\n";
  o += "</svg>\n";
  return o;
}

}  // namespace kvlens::fig
