// Images: decode with stb_image to 8-bit RGB, CLIP/LLaVA preprocessing (optional pad to square
// with the mean colour, PIL-compatible bicubic resize of the shortest edge, center crop,
// rescale, normalize), and PNG writing.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace kvlens {

struct RGBImage {
  int width = 0, height = 0;
  std::vector<uint8_t> data;  // [height][width][3]
  std::string source;         // the file it was decoded from, for messages ("" = made in memory)
};

// Largest image accepted, in pixels (width × height); larger ones are refused with a clear
// InputError before any pixel is decoded.
constexpr int64_t kMaxImagePixels = 64LL * 1024 * 1024;

// Decodes JPEG with libjpeg-turbo (PIL's decoder: the same pixels, CMYK converted as PIL does;
// stb_image when kvlens is built without libjpeg), and PNG, BMP (also top-down), GIF (first
// frame) and 8-bit PNM with stb_image: grey, grey+alpha, RGB, RGBA
// and 16-bit inputs become 8-bit RGB (alpha is dropped, as PIL's convert("RGB") does; 16-bit
// samples keep their high byte, v >> 8, which is what PIL does for 16-bit RGB/RGBA PNGs; PIL
// clips 16-bit grey to 255 instead). Throws InputError naming `path` (or `name`) for missing,
// unreadable, empty, non-image or oversized files; the size is checked from the header first.
RGBImage load_image(const std::string& path);
// `max_pixels` lowers the size limit (the fuzzer uses it to stay fast).
RGBImage decode_image(const uint8_t* bytes, size_t n, const std::string& name,
                      int64_t max_pixels = kMaxImagePixels);
// PNG bytes of `img` (stb_image_write), and the same written through the atomic writer.
std::string encode_png(const RGBImage& img);
void write_png(const std::string& path, const RGBImage& img);  // throws InputError

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
