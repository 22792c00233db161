// The Image panel's overlays as data: each patch's value for one source (the full cache or a
// method), the scale its colour bar shows, and the veil a patch gets. Overlays carry no hue:
// a patch the measure gives little to is greyed and dimmed, one it gives most to keeps the
// image's own colours, so no patch is tinted like a scene object (the scenes use red, green,
// blue, yellow, purple, orange, white and black).
#pragma once
#include <string>
#include <vector>

#include "app/gui/state.h"

namespace kvlens::gui {

class App;

struct OverlayScale {
  std::string quantity;         // what a patch's value is, in its unit
  double lo = 0, hi = 0;        // the bar spans [lo, hi]; a patch at hi is clear
  bool log2 = false;            // bits: positions by log2(1 + value)
  std::vector<double> levels;   // bits: the values present, ascending (the bar's ticks)
  bool empty() const { return !(hi > lo); }
};

struct OverlayData {
  std::vector<float> values;  // per visual token (overlay_grid says where each lies)
  std::string what;           // a caption: the quantity, the source, the layer (and head, token)
  OverlayScale scale;
};

// The scale of `values` for overlay `kind`: attention and rows merged from 0 to the largest
// value, kept share from 0 to 1, bits from the fewest bits present (0: a patch is evicted) to
// the most, with the levels present.
OverlayScale overlay_scale(Overlay kind, const std::vector<float>& values);
// Where `value` sits on the scale, 0 (lo) to 1 (hi), clamped.
double overlay_position(const OverlayScale& s, double value);
// The veil over a patch of `value`: opacity · (1 − position); 0 leaves the patch as it is.
float overlay_veil(const OverlayScale& s, double value, float opacity);
// A colour (r, g, b in [0, 255]) under a veil: towards a dim grey of its own luminance.
void apply_veil(float veil, unsigned char* rgb);

// The chosen overlay of `source` (-1: the full cache, for attention) at the views' layer, head
// and token; empty values when the source has no results yet.
OverlayData overlay_of(const App& app, int source);
// The grid the Image panel draws overlays on: the finest grid of the image's visual layout
// (LLaVA-NeXT: the tiles', whose rows end with a newline token), else the model's square patch
// grid; no rows when there is none (a text-only model, nothing computed yet).
VisualGrid overlay_grid(const Snapshot& s);
// The sources a patch's hover lists: the full cache (attention only) and every method with results.
std::vector<int> overlay_sources(const App& app);

}  // namespace kvlens::gui
