// Renders figure descriptions (core/figures) with Cairo to PNG, SVG and PDF. The figure is laid
// out by fig::draw with Cairo's DejaVu Sans text widths and drawn into memory through Cairo's
// stream surfaces; files are written only through write_file_atomic.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "app/figures/figures.h"

namespace kvlens::app {

enum class FigureFormat { Png, Svg, Pdf };
const char* figure_format_name(FigureFormat f);  // "png", "svg", "pdf"
// "png,svg,pdf" → formats; throws InputError naming `option` and the bad entry.
std::vector<FigureFormat> parse_figure_formats(const std::string& list, const std::string& option);

// Width in pixels of `text` in DejaVu Sans at `size` pixels.
double cairo_text_width(const std::string& text, double size);

// The figure drawn at width × height (pixels for PNG, points for SVG/PDF); PNG pixels are
// multiplied by `png_scale` for a sharper raster.
std::string render_figure(const fig::Figure& f, FigureFormat format, double width = 720, double height = 450,
                          double png_scale = 2);

// Writes DIR/<id>.<format> for every figure and format, and DIR/<id>.csv with the plotted data
// when `csv`; creates DIR when missing (its parent must exist). Returns the paths written.
// `step`, when set, is called after each figure with the figures done and their total; when it
// returns false the export stops there (every file written so far is whole).
std::vector<std::string> export_figures(const std::vector<fig::Figure>& figures, const std::string& dir,
                                        const std::vector<FigureFormat>& formats, bool csv,
                                        const std::function<bool(size_t done, size_t total)>& step = {});

}  // namespace kvlens::app
