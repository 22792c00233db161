#include "models/llava_next.h"

#include <cmath>
#include <string>

#include "core/errors.h"
#include "models/preprocess/anyres.h"

namespace kvlens {

namespace {

// Python's int(round(x, 7)) for the non-negative sizes unpadding computes.
int round7_int(double x) { return static_cast<int>(std::nearbyint(x * 1e7) / 1e7); }

}  // namespace

AnyresGeometry anyres_geometry(const LlavaConfig& cfg, int image_width, int image_height) {
  const int tile = cfg.vision.image_size;
  const Resolution best = select_best_resolution(image_height, image_width, cfg.grid_pinpoints);
  AnyresGeometry g;
  g.side = tile / cfg.vision.patch_size;
  g.base = g.side * g.side;
  g.tile_rows = best[0] / tile;
  g.tile_cols = best[1] / tile;
  // HF unpad_image on the joined grid (rows × cols of patches), from the image's aspect.
  const int ch = g.tile_rows * g.side, cw = g.tile_cols * g.side;
  g.rows = ch;
  g.cols = cw;
  const double original = static_cast<double>(image_width) / image_height, current = static_cast<double>(cw) / ch;
  if (original > current) {
    const int new_h = round7_int(image_height * (static_cast<double>(cw) / image_width));
    g.row0 = (ch - new_h) / 2;
    g.rows = ch - 2 * g.row0;
  } else {
    const int new_w = round7_int(image_width * (static_cast<double>(ch) / image_height));
    g.col0 = (cw - new_w) / 2;
    g.cols = cw - 2 * g.col0;
  }
  // An image thinner than half a patch of the joined grid keeps no row of it (its visual tokens
  // are the whole image's alone) or no column (each row keeps its newline token), as HF counts.
  return g;
}

VisualLayout anyres_layout(const LlavaConfig& cfg, int image_width, int image_height) {
  const AnyresGeometry g = anyres_geometry(cfg, image_width, image_height);
  VisualLayout l;
  l.n_tokens = g.tokens();
  l.image_width = image_width;
  l.image_height = image_height;
  VisualGrid base;
  base.name = "base";
  base.rows = base.cols = base.row_stride = g.side;
  VisualGrid tiles;
  tiles.name = "tiles";
  tiles.first = g.base;
  tiles.rows = g.rows;
  tiles.cols = g.cols;
  tiles.row_stride = g.cols + 1;
  tiles.tile_side = g.side;
  tiles.cut_top = g.row0;
  tiles.cut_left = g.col0;
  l.grids = {base};
  if (g.rows > 0 && g.cols > 0) l.grids.push_back(tiles);
  return l;
}

Buffer pack_anyres_features(Backend& be, const AnyresGeometry& g, const Buffer& per_tile, const Buffer& newline) {
  const int64_t H = per_tile.shape.at(1);
  const int64_t tiles = static_cast<int64_t>(g.tile_rows) * g.tile_cols;
  if (per_tile.shape[0] != (1 + tiles) * g.base)
    throw InternalError("pack_anyres_features: " + std::to_string(per_tile.shape[0]) + " feature rows for " +
                        std::to_string(1 + tiles) + " images of " + std::to_string(g.base) + " patches");
  Buffer out = be.alloc("image_features", {g.tokens(), H}, Dt::F32);
  be.copy_block(per_tile, 0, 0, out, 0, 0, g.base, H);
  int64_t at = g.base;
  for (int r = 0; r < g.rows; ++r) {
    const int R = g.row0 + r, ti = R / g.side, y = R % g.side;
    // The kept columns of this row, a run per tile they cross.
    for (int c = g.col0; c < g.col0 + g.cols;) {
      const int tj = c / g.side, x = c % g.side, run = std::min(g.side - x, g.col0 + g.cols - c);
      const int64_t src = (1 + static_cast<int64_t>(ti) * g.tile_cols + tj) * g.base + static_cast<int64_t>(y) * g.side + x;
      be.copy_block(per_tile, src, 0, out, at, 0, run, H);
      at += run;
      c += run;
    }
    be.copy_block(newline, 0, 0, out, at++, 0, 1, H);
  }
  return out;
}

}  // namespace kvlens
