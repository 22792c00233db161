// A drawn figure (fig::Frame) as an SVG document written element by element: lines, rectangles
// and points as shapes, text as <text> in the font the renderers measure with ("DejaVu Sans"),
// so a figure's words stay editable and searchable in Inkscape or Illustrator and a paper's
// LaTeX toolchain; images (heatmaps, overlays) embedded as PNG.
#pragma once
#include <string>

#include "app/figures/figures.h"

namespace kvlens::fig {

// The font every renderer draws and measures figure text with.
inline constexpr const char* kFigureFont = "DejaVu Sans";

// The SVG document of `frame`: its pixels as user units, one user unit a point.
std::string svg_document(const Frame& frame);

}  // namespace kvlens::fig
