// InternVL's dynamic tiling, as HF's GotOcr2ImageProcessor (crop_to_patches) does it: among the
// grids of min_patches .. max_patches tiles, the one whose aspect is closest to the image's (ties
// go to more tiles while the image's area exceeds half the grid's); the image resized to the grid
// (PIL bicubic, aspect not kept) and cut into tiles row by row; after them, where there is more
// than one tile, the whole image resized to one tile (the thumbnail). Each then goes through
// PreprocessConfig's resize, rescale and normalize.
#pragma once
#include <array>

#include "core/data/image.h"
#include "core/tensor.h"
#include "models/preprocess/clip_image.h"

namespace kvlens {

struct TilingConfig {
  bool crop_to_patches = true;
  int min_patches = 1, max_patches = 12;
  int tile = 448;  // the tower's image size
};

// (columns, rows) of the chosen grid for a height × width image (HF get_optimal_tiled_canvas).
std::array<int, 2> optimal_tile_grid(int height, int width, int tile, int min_patches, int max_patches);
// [tiles (+ thumbnail)][3][tile][tile]; one tile when crop_to_patches is off.
Tensor tiled_pixel_values(const RGBImage& img, const PreprocessConfig& cfg, const TilingConfig& t);

}  // namespace kvlens
