#include "app/figures/figure_cairo.h"

#include <cairo-pdf.h>
#include <cairo.h>
#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>

#include "core/errors.h"
#include "core/files.h"
#include "app/figures/figure_svg.h"

namespace kvlens::app {

namespace {

using fig::Prim;

const char* kFont = fig::kFigureFont;

cairo_status_t append(void* closure, const unsigned char* data, unsigned int n) {
  static_cast<std::string*>(closure)->append(reinterpret_cast<const char*>(data), n);
  return CAIRO_STATUS_SUCCESS;
}

void set_font(cairo_t* cr, double size) {
  cairo_select_font_face(cr, kFont, CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
  cairo_set_font_size(cr, size);
}

void set_color(cairo_t* cr, const fig::Color& c) { cairo_set_source_rgba(cr, c.r, c.g, c.b, c.a); }

void draw_text(cairo_t* cr, const Prim& p) {
  set_font(cr, p.size);
  cairo_text_extents_t te;
  cairo_font_extents_t fe;
  cairo_text_extents(cr, p.text.c_str(), &te);
  cairo_font_extents(cr, &fe);
  const double w = te.x_advance;
  const double dx = p.halign < 0 ? 0 : p.halign == 0 ? -w / 2 : -w;
  const double dy = p.valign < 0 ? fe.ascent : p.valign == 0 ? (fe.ascent - fe.descent) / 2 : -fe.descent;
  cairo_save(cr);
  cairo_translate(cr, p.pts[0].x, p.pts[0].y);
  if (p.vertical) cairo_rotate(cr, -M_PI / 2);
  set_color(cr, p.color);
  cairo_move_to(cr, dx, dy);
  cairo_show_text(cr, p.text.c_str());
  cairo_restore(cr);
}

void draw_image(cairo_t* cr, const Prim& p) {
  if (p.image_w <= 0 || p.image_h <= 0 || p.rect.width() <= 0 || p.rect.height() <= 0) return;
  cairo_surface_t* img = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, p.image_w, p.image_h);
  cairo_surface_flush(img);
  unsigned char* data = cairo_image_surface_get_data(img);
  const int stride = cairo_image_surface_get_stride(img);
  for (int y = 0; y < p.image_h; ++y)
    for (int x = 0; x < p.image_w; ++x) {
      const uint8_t* s = &p.rgba[(static_cast<size_t>(y) * p.image_w + x) * 4];
      const uint32_t a = s[3];
      // Cairo's ARGB32: premultiplied, native-endian 32-bit words.
      const uint32_t px = (a << 24) | ((s[0] * a / 255) << 16) | ((s[1] * a / 255) << 8) | (s[2] * a / 255);
      std::memcpy(data + static_cast<size_t>(y) * stride + x * 4, &px, 4);
    }
  cairo_surface_mark_dirty(img);
  cairo_save(cr);
  cairo_translate(cr, p.rect.x0, p.rect.y0);
  cairo_scale(cr, p.rect.width() / p.image_w, p.rect.height() / p.image_h);
  cairo_set_source_surface(cr, img, 0, 0);
  cairo_pattern_set_filter(cairo_get_source(cr), CAIRO_FILTER_NEAREST);
  cairo_rectangle(cr, 0, 0, p.image_w, p.image_h);
  cairo_fill(cr);
  cairo_restore(cr);
  cairo_surface_destroy(img);
}

void execute(cairo_t* cr, const std::vector<Prim>& prims) {
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  cairo_set_line_cap(cr, CAIRO_LINE_CAP_BUTT);
  for (const Prim& p : prims) {
    switch (p.type) {
      case Prim::Type::Polyline: {
        if (p.pts.size() < 2) break;
        set_color(cr, p.color);
        cairo_set_line_width(cr, p.width);
        const double dash[] = {5.0, 3.5};
        cairo_set_dash(cr, dash, p.dashed ? 2 : 0, 0);
        cairo_move_to(cr, p.pts[0].x, p.pts[0].y);
        for (size_t i = 1; i < p.pts.size(); ++i) cairo_line_to(cr, p.pts[i].x, p.pts[i].y);
        cairo_stroke(cr);
        cairo_set_dash(cr, nullptr, 0, 0);
        break;
      }
      case Prim::Type::FillRect:
        set_color(cr, p.color);
        cairo_rectangle(cr, p.rect.x0, p.rect.y0, p.rect.width(), p.rect.height());
        cairo_fill(cr);
        break;
      case Prim::Type::StrokeRect:
        set_color(cr, p.color);
        cairo_set_line_width(cr, p.width);
        cairo_rectangle(cr, p.rect.x0, p.rect.y0, p.rect.width(), p.rect.height());
        cairo_stroke(cr);
        break;
      case Prim::Type::Circle:
        set_color(cr, p.color);
        cairo_new_sub_path(cr);
        cairo_arc(cr, p.pts[0].x, p.pts[0].y, p.width, 0, 2 * M_PI);
        cairo_fill(cr);
        break;
      case Prim::Type::Text:
        draw_text(cr, p);
        break;
      case Prim::Type::Image:
        draw_image(cr, p);
        break;
      case Prim::Type::Clip:
        cairo_save(cr);
        cairo_rectangle(cr, p.rect.x0, p.rect.y0, p.rect.width(), p.rect.height());
        cairo_clip(cr);
        break;
      case Prim::Type::Unclip:
        cairo_restore(cr);
        break;
    }
  }
}

// A one-pixel surface whose context measures text.
struct Measurer {
  cairo_surface_t* s = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, 1, 1);
  cairo_t* cr = cairo_create(s);
  ~Measurer() {
    cairo_destroy(cr);
    cairo_surface_destroy(s);
  }
};

void check(cairo_status_t st, const std::string& what) {
  if (st != CAIRO_STATUS_SUCCESS) throw InputError(what + ": cairo failed (" + cairo_status_to_string(st) + ")");
}

}  // namespace

const char* figure_format_name(FigureFormat f) {
  switch (f) {
    case FigureFormat::Png: return "png";
    case FigureFormat::Svg: return "svg";
    case FigureFormat::Pdf: return "pdf";
  }
  return "?";
}

std::vector<FigureFormat> parse_figure_formats(const std::string& list, const std::string& option) {
  std::vector<FigureFormat> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, end - start);
    if (item == "png") out.push_back(FigureFormat::Png);
    else if (item == "svg") out.push_back(FigureFormat::Svg);
    else if (item == "pdf") out.push_back(FigureFormat::Pdf);
    else throw InputError(option + " takes a comma-separated list of png, svg, pdf, got '" + item + "'");
    start = end + 1;
  }
  return out;
}

double cairo_text_width(const std::string& text, double size) {
  thread_local Measurer m;
  set_font(m.cr, size);
  cairo_text_extents_t te;
  cairo_text_extents(m.cr, text.c_str(), &te);
  return te.x_advance;
}

std::string render_figure(const fig::Figure& f, FigureFormat format, double width, double height, double png_scale) {
  const fig::Frame frame = fig::draw(f, width, height, cairo_text_width);
  // SVG element by element (text as <text>), laid out with Cairo's text measures.
  if (format == FigureFormat::Svg) return fig::svg_document(frame);
  std::string out;
  cairo_surface_t* surface = nullptr;
  switch (format) {
    case FigureFormat::Png:
      surface = cairo_image_surface_create(CAIRO_FORMAT_ARGB32, static_cast<int>(std::lround(width * png_scale)),
                                           static_cast<int>(std::lround(height * png_scale)));
      break;
    case FigureFormat::Svg:
      break;  // written above
    case FigureFormat::Pdf:
      surface = cairo_pdf_surface_create_for_stream(append, &out, width, height);
      break;
  }
  std::unique_ptr<cairo_surface_t, void (*)(cairo_surface_t*)> hold(surface, cairo_surface_destroy);
  check(cairo_surface_status(surface), "figure " + f.id);
  cairo_t* cr = cairo_create(surface);
  if (format == FigureFormat::Png) cairo_scale(cr, png_scale, png_scale);
  execute(cr, frame.prims);
  const cairo_status_t st = cairo_status(cr);
  cairo_destroy(cr);
  check(st, "figure " + f.id);
  if (format == FigureFormat::Png) check(cairo_surface_write_to_png_stream(surface, append, &out), "figure " + f.id);
  cairo_surface_finish(surface);
  check(cairo_surface_status(surface), "figure " + f.id);
  return out;
}

std::vector<std::string> export_figures(const std::vector<fig::Figure>& figures, const std::string& dir,
                                        const std::vector<FigureFormat>& formats, bool csv,
                                        const std::function<bool(size_t done, size_t total)>& step) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    if (::mkdir(dir.c_str(), 0777) != 0)
      throw InputError(dir + ": cannot create the figures folder (" + std::strerror(errno) + ")");
  } else if (!S_ISDIR(st.st_mode)) {
    throw InputError(dir + ": not a folder, expected the folder to write figures into");
  }
  std::vector<std::string> written;
  for (const fig::Figure& f : figures) {
    for (FigureFormat fmt : formats) {
      const std::string path = dir + "/" + f.id + "." + figure_format_name(fmt);
      write_file_atomic(path, render_figure(f, fmt), "figure");
      written.push_back(path);
    }
    if (csv) {
      const std::string path = dir + "/" + f.id + ".csv";
      write_file_atomic(path, fig::figure_csv(f), "figure data");
      written.push_back(path);
    }
    if (step && !step(static_cast<size_t>(&f - figures.data()) + 1, figures.size())) break;
  }
  return written;
}

}  // namespace kvlens::app
