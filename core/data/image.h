// Images: decode (libjpeg-turbo, stb_image) to 8-bit RGB, and PNG writing. The towers'
// preprocessing is models/preprocess.
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
// InputError naming `what` unless img is a non-empty RGB image of width·height·3 bytes.
void check_image(const RGBImage& img, const char* what);
// PNG bytes of `img` (stb_image_write), and the same written through the atomic writer.
std::string encode_png(const RGBImage& img);
// PNG bytes of w × h RGBA pixels (rgba: [h][w][4], not premultiplied).
std::string encode_png_rgba(int w, int h, const uint8_t* rgba);
void write_png(const std::string& path, const RGBImage& img);  // throws InputError

}  // namespace kvlens
