// LLaVA-NeXT (HF LlavaNextForConditionalGeneration) beside LLaVA-1.5 (models/llava.cpp), which
// loads it: the same CLIP tower, projector and decoder, with anyres images. The image is cut into
// tiles (models/preprocess/anyres.h); each tile and the whole image go through the tower and the
// projector; the tiles' patch grids are joined into one grid, the rows and columns that only saw
// the black padding are cut away (HF unpad_image), and the learned image_newline token ends each
// row. The visual tokens are the whole image's grid, then the joined grid row by row.
#pragma once
#include <array>
#include <vector>

#include "core/backend.h"
#include "models/config.h"
#include "models/model.h"

namespace kvlens {

// Where an image's tiles and patches fall, from its size alone (the processor's and the model's
// token count come from here).
struct AnyresGeometry {
  int tile_rows = 0, tile_cols = 0;  // tiles of the best resolution
  int side = 0;                      // patches per tile side
  int row0 = 0, col0 = 0;            // the first row and column of the joined grid kept by unpadding
  int rows = 0, cols = 0;            // the joined grid after unpadding
  int base = 0;                      // the whole image's tokens (side²)
  int tokens() const { return base + rows * (cols + 1); }
};

AnyresGeometry anyres_geometry(const LlavaConfig& cfg, int image_width, int image_height);
VisualLayout anyres_layout(const LlavaConfig& cfg, int image_width, int image_height);
// HF pack_image_features: `per_tile` holds the projected features of the whole image and then of
// each tile ([(1 + tiles) · side²][hidden]); `newline` is image_newline ([1][hidden]). Returns
// [layout.n_tokens][hidden].
Buffer pack_anyres_features(Backend& be, const AnyresGeometry& g, const Buffer& per_tile, const Buffer& newline);

}  // namespace kvlens
