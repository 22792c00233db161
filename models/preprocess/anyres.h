// LLaVA-NeXT's "anyres" image processing, as HF's LlavaNextImageProcessor does it: among the grid
// pinpoints, the resolution that keeps most of the image and wastes least; the image resized into
// it keeping its aspect (PIL bicubic), centred on black and cut into tiles, row by row; before
// them the whole image resized to one tile. Each of these then goes through the CLIP steps
// (resize of the shortest edge, centre crop, rescale, normalize) of PreprocessConfig.
#pragma once
#include <array>
#include <vector>

#include "core/data/image.h"
#include "core/tensor.h"
#include "models/preprocess/clip_image.h"

namespace kvlens {

using Resolution = std::array<int, 2>;  // (height, width), as image_grid_pinpoints lists them

// HF select_best_resolution: the pinpoint whose aspect-preserving downscale of a height × width
// image keeps the most pixels (capped at the image's own), the least wasted area breaking ties,
// the first listed breaking the rest.
Resolution select_best_resolution(int height, int width, const std::vector<Resolution>& pinpoints);
// HF get_patch_output_size: the size (height, width) of the image resized into `target` keeping
// its aspect (the longer relative side fills it; the other rounded up, at most the target's).
Resolution resize_into(int height, int width, Resolution target);

// The processor's output for `img`: [1 + tiles][3][crop_height][crop_width], the whole image first.
// `tile` is the tiles' side in pixels (the processor's crop_size, the tower's image_size).
Tensor anyres_pixel_values(const RGBImage& img, const PreprocessConfig& cfg, const std::vector<Resolution>& pinpoints,
                           int tile);

}  // namespace kvlens
