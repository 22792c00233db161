// CLIP / LLaVA-1.5 image preprocessing, as HF's CLIPImageProcessor does it: optional pad to
// square with the mean colour, PIL-compatible bicubic resize of the shortest edge, center crop,
// rescale, normalize; and the processor config that sets it.
#pragma once
#include <array>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "core/data/image.h"
#include "core/tensor.h"

namespace kvlens {

struct PreprocessConfig {
  bool do_resize = true;
  int shortest_edge = 224;             // resize target of the shortest edge
  int resize_height = 0, resize_width = 0;  // when both > 0: resize to exactly this size
                                            // (HF size {"height", "width"}) instead
  bool do_center_crop = true;
  int crop_height = 224, crop_width = 224;
  bool do_rescale = true;
  float rescale_factor = 1.0f / 255.0f;
  bool do_normalize = true;
  std::array<float, 3> mean{0.48145466f, 0.4578275f, 0.40821073f};  // OpenAI CLIP
  std::array<float, 3> std{0.26862954f, 0.26130258f, 0.27577711f};
  bool pad_to_square = false;          // LLaVA-1.5: pad with the mean colour before resizing
};

// CLIP defaults for `image_size`, overridden by the keys of an HF preprocessor_config.json
// (size / crop_size as int or dict, do_*, rescale_factor, image_mean, image_std, resample (must
// be 3, bicubic), and do_pad / pad_to_square / image_aspect_ratio == "pad" for LLaVA padding).
// Throws InputError naming the key for bad values.
PreprocessConfig preprocess_config_from_json(const nlohmann::json& j, int image_size);

// PIL-compatible (Image.resize with BICUBIC, antialiased when shrinking) resize to w × h:
// bit-exact with Pillow 13, whose pass order it follows (Pillow ≤ 12 always resized
// horizontally first, which differs only when the height shrinks by more than twice the width).
RGBImage resize_bicubic(const RGBImage& img, int w, int h);
// The window [x0, x0 + cw) × [y0, y0 + ch) of resize_bicubic(img, w, h), computed without
// the rest (bit-exact with cropping the full resize).
RGBImage resize_bicubic_window(const RGBImage& img, int w, int h, int x0, int y0, int cw, int ch);
// Centers `img` on a square canvas of the given colour (LLaVA expand2square: offset
// ((side - w) / 2, (side - h) / 2)).
RGBImage pad_to_square(const RGBImage& img, std::array<uint8_t, 3> colour);
// w × h crop around the centre, as the PIL-based CLIPImageProcessor: start (size - crop) / 2;
// where the crop is larger than the image, the image sits at ceil((crop - size) / 2) on zeros.
RGBImage center_crop(const RGBImage& img, int w, int h);
// Full pipeline; returns "pixel_values" [3][crop_height][crop_width] (the resized size when
// do_center_crop is off).
Tensor preprocess(const RGBImage& img, const PreprocessConfig& cfg);

}  // namespace kvlens
