// Where an image's visual tokens lie on it: grids of patches in the order the tokens come, a data
// format the models write (models/: LLaVA-1.5, LLaVA-NeXT's tiles and newline tokens, InternVL's
// tiles stored tile by tile) and the views and figures read, from the report's JSON too.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlens {

// Where an image's visual tokens lie: grids of patches in the order the tokens come. Every grid
// covers the whole image the tower saw (the image drawn under the views); LLaVA-NeXT has two, the
// base image's and the tiles' (unpadded, with a newline token ending each row).
struct VisualGrid {
  std::string name;    // "patches" (the one grid of LLaVA-1.5), "base", "tiles"
  int first = 0;       // the grid's first token, counted among the visual tokens
  int rows = 0, cols = 0;
  int row_stride = 0;  // tokens from one row's start to the next: cols, or cols + 1 with a newline token
  // Tiles: patches per tile side (0: the grid is not tiled) and the patches unpadding cut from
  // the joined grid's top and left (anyres), so tile borders lie at k · tile_side − cut.
  int tile_side = 0, cut_top = 0, cut_left = 0;
  // Tokens stored tile by tile (InternVL: each tile's tile_side² tokens row by row, the tiles
  // row by row) rather than row by row across the joined grid.
  bool tile_major = false;
  // The visual token (counted among the visual tokens) of patch (r, c).
  int token(int r, int c) const {
    if (!tile_major) return first + r * row_stride + c;
    const int ts = tile_side, per_row = cols / ts;
    return first + ((r / ts) * per_row + c / ts) * ts * ts + (r % ts) * ts + c % ts;
  }
};

struct VisualLayout {
  int n_tokens = 0;                       // visual tokens of the image (0: no image)
  int image_width = 0, image_height = 0;  // the image before preprocessing
  std::vector<VisualGrid> grids;
  // The grid drawn by default: the finest (most patches).
  const VisualGrid* finest() const;
  // Text for views: "576 (24×24 patches)", "2,928 (base 24×24 + tiles 48×48 in 2×2 tiles, 48 newlines)".
  std::string describe() const;
};

// The report's patch_grid of a grid: rows, cols, first, row_stride, and tile_major (its tile side)
// where tokens come tile by tile.
nlohmann::json patch_grid_json(const VisualGrid& g);

}  // namespace kvlens
