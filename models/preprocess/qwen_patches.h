// Qwen2-VL's image processor, as HF's Qwen2VLImageProcessor does it: the image resized (PIL
// bicubic) to the nearest size whose sides are multiples of patch_size · merge_size and whose
// area lies within [min_pixels, max_pixels] (smart_resize), rescaled and normalized, then cut
// into patch_size² patches listed merge block by merge block (the 2×2 patches that become one
// token are consecutive), each repeated over temporal_patch_size frames: pixel_values
// [patches][channels · temporal · patch · patch].
#pragma once
#include <array>

#include <nlohmann/json.hpp>

#include "core/data/image.h"
#include "core/tensor.h"
#include "models/preprocess/clip_image.h"

namespace kvlens {

struct QwenPatchConfig {
  int patch_size = 14, merge_size = 2, temporal_patch_size = 2;
  int64_t min_pixels = 56 * 56, max_pixels = 28 * 28 * 1280;
  PreprocessConfig pixels;  // rescale and normalize (its resize and crop are not used)
};

// preprocessor_config.json's keys (size {shortest_edge, longest_edge} or min_pixels / max_pixels,
// patch_size, merge_size, temporal_patch_size, and the rescale / normalize keys); `where` names
// the file in messages.
QwenPatchConfig qwen_patch_config_from_json(const nlohmann::json& j, const std::string& where);

// (height, width) after HF's smart_resize; InputError for an aspect ratio beyond 200.
std::array<int, 2> smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels);
// The patch grid (rows, columns) of a height × width image.
std::array<int, 2> qwen_patch_grid(int height, int width, const QwenPatchConfig& c);
Tensor qwen_pixel_values(const RGBImage& img, const QwenPatchConfig& c);

}  // namespace kvlens
