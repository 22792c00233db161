// Figures on screen: executes the primitives of fig::draw (the same layout the Cairo exports
// use) on an ImDrawList, with a read-out of the data under the pointer, mouse-wheel zoom and
// drag pan of the x axis, Shift + wheel zoom of the y axis, legend entries that hide and show
// their series, a right-click menu for the y scale, and double-click to reset.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include <imgui.h>

#include "app/figures/figures.h"

namespace kvlens::gui {

// OpenGL textures for figure images and the Image panel, keyed by content; textures unused for
// a few seconds are deleted.
class TextureCache {
 public:
  ~TextureCache();
  // A texture of w × h RGBA pixels (nearest-neighbour sampling when `nearest`).
  ImTextureID get(uint64_t key, int w, int h, const uint8_t* rgba, bool nearest = true);
  bool has(uint64_t key) const { return entries_.count(key) > 0; }
  void end_frame();  // frees what was not used recently

 private:
  struct Entry {
    unsigned int tex = 0;
    int last_used = 0;
  };
  std::map<uint64_t, Entry> entries_;
  int frame_ = 0;
};

// Text width in the current ImGui font at `size` pixels (what fig::draw lays out with).
double imgui_text_width(const std::string& text, double size);

// The UI scale figures are drawn at: a figure is laid out at (its size ÷ scale) and drawn
// magnified, so its text grows with the app's fonts. 1 = as laid out.
void set_figure_scale(float scale);
float figure_scale();
// The magnification a figure drawn at `size` (pixels) gets: the UI scale, times the room beyond
// the exports' 720 × 450 (logical pixels) the panel gives it, 1 to 3 (its text grows with the
// panel).
double figure_magnification(ImVec2 size);
// The least height (pixels at UI scale 1) a panel gives a figure: below it a plot's title, legend,
// axis labels and note leave no plot.
constexpr float kMinFigureHeight = 180.0f;
// The least side of the Image panel's picture (UI-scaled; the panel's width where that is less).
constexpr float kMinImageSide = 240.0f;

// Draws `f` as an item of `size` at the cursor. `view` keeps, between frames, the x zoom (wheel,
// drag), the y zoom (Shift + wheel), the y scale (right-click menu) and the series hidden (a click
// on a legend entry); a double-click resets the zoom and scale. `drawn_y` (when given) receives
// the y axis as drawn. Returns true while the figure is hovered.
bool draw_figure(const char* id, const fig::Figure& f, ImVec2 size, fig::View& view, TextureCache& textures,
                 fig::Axis* drawn_y = nullptr);

// Executes laid-out primitives with their origin at `origin` (also used for the screenshot
// checks of exported figures).
void draw_prims(ImDrawList* dl, const std::vector<fig::Prim>& prims, ImVec2 origin, TextureCache& textures);

}  // namespace kvlens::gui
