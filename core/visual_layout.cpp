#include "core/visual_layout.h"

namespace kvlens {

const VisualGrid* VisualLayout::finest() const {
  const VisualGrid* best = nullptr;
  for (const VisualGrid& g : grids)
    if (!best || g.rows * g.cols > best->rows * best->cols) best = &g;
  return best;
}

std::string VisualLayout::describe() const {
  if (grids.empty()) return std::to_string(n_tokens);
  auto dims = [](const VisualGrid& g) { return std::to_string(g.rows) + "×" + std::to_string(g.cols); };
  if (grids.size() == 1) return std::to_string(n_tokens) + " (" + dims(grids[0]) + " patches)";
  std::string s = std::to_string(n_tokens) + " =";
  for (size_t i = 0; i < grids.size(); ++i) {
    const VisualGrid& g = grids[i];
    s += (i ? " + " : " ") + g.name + " " + dims(g);
    if (g.tile_side > 0) {
      const int tr = (g.cut_top * 2 + g.rows) / g.tile_side, tc = (g.cut_left * 2 + g.cols) / g.tile_side;
      s += " (" + std::to_string(tr) + "×" + std::to_string(tc) + " tiles)";
    }
    if (g.row_stride > g.cols) s += " + " + std::to_string(g.rows) + " newlines";
  }
  return s;
}

nlohmann::json patch_grid_json(const VisualGrid& g) {
  nlohmann::json j = {{"rows", g.rows}, {"cols", g.cols}, {"first", g.first}, {"row_stride", g.row_stride}};
  if (g.tile_major) j["tile_major"] = g.tile_side;
  return j;
}

}  // namespace kvlens
