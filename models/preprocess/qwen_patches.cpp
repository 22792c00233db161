#include "models/preprocess/qwen_patches.h"

#include <cmath>
#include <string>

#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens {

QwenPatchConfig qwen_patch_config_from_json(const nlohmann::json& j, const std::string& where) {
  QwenPatchConfig c;
  if (!j.is_object()) throw InputError(where + ": not a JSON object");
  nlohmann::json rest = j;  // the keys PreprocessConfig reads (mean, std, rescale, resample)
  for (const char* k : {"size", "min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size",
                        "do_resize", "crop_size", "do_center_crop"})
    rest.erase(k);
  c.pixels = preprocess_config_from_json(rest, 224);
  c.pixels.do_center_crop = false;
  c.pixels.pad_to_square = false;
  auto integer = [&](const nlohmann::json& v, const std::string& key, int lo, int hi) {
    return static_cast<int64_t>(json_int(v, where + ": " + key, lo, hi));
  };
  if (j.contains("size") && j["size"].is_object()) {
    const auto& s = j["size"];
    if (s.contains("shortest_edge")) c.min_pixels = integer(s["shortest_edge"], "size.shortest_edge", 1, 1 << 30);
    if (s.contains("longest_edge")) c.max_pixels = integer(s["longest_edge"], "size.longest_edge", 1, 1 << 30);
  }
  if (j.contains("min_pixels") && !j["min_pixels"].is_null()) c.min_pixels = integer(j["min_pixels"], "min_pixels", 1, 1 << 30);
  if (j.contains("max_pixels") && !j["max_pixels"].is_null()) c.max_pixels = integer(j["max_pixels"], "max_pixels", 1, 1 << 30);
  if (j.contains("patch_size")) c.patch_size = json_int(j["patch_size"], where + ": patch_size", 1, 1024);
  if (j.contains("merge_size")) c.merge_size = json_int(j["merge_size"], where + ": merge_size", 1, 8);
  if (j.contains("temporal_patch_size"))
    c.temporal_patch_size = json_int(j["temporal_patch_size"], where + ": temporal_patch_size", 1, 8);
  if (c.min_pixels > c.max_pixels)
    throw InputError(where + ": min_pixels " + std::to_string(c.min_pixels) + " exceeds max_pixels " + std::to_string(c.max_pixels));
  if (j.contains("do_resize") && j["do_resize"].is_boolean() && !j["do_resize"].get<bool>())
    throw InputError(where + ": do_resize false is not supported (the patch grid needs sides that are multiples of patch_size · merge_size)");
  return c;
}

std::array<int, 2> smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels) {
  if (height <= 0 || width <= 0) throw InputError("smart_resize: an image of " + std::to_string(width) + "x" + std::to_string(height));
  const double h = height, w = width, f = factor;
  if (std::max(h, w) / std::min(h, w) > 200)
    throw InputError("image of " + std::to_string(width) + "x" + std::to_string(height) +
                     ": absolute aspect ratio must be smaller than 200 (Qwen2-VL's processor)");
  // Python's round(): halves to even (the default rounding mode of nearbyint).
  double hb = std::nearbyint(h / f) * f, wb = std::nearbyint(w / f) * f;
  if (hb * wb > static_cast<double>(max_pixels)) {
    const double beta = std::sqrt(h * w / static_cast<double>(max_pixels));
    hb = std::max(f, std::floor(h / beta / f) * f);
    wb = std::max(f, std::floor(w / beta / f) * f);
  } else if (hb * wb < static_cast<double>(min_pixels)) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (h * w));
    hb = std::ceil(h * beta / f) * f;
    wb = std::ceil(w * beta / f) * f;
  }
  if (hb > 1 << 16 || wb > 1 << 16)
    throw InputError("image of " + std::to_string(width) + "x" + std::to_string(height) + " resizes to " +
                     format_number(wb) + "x" + format_number(hb) + " pixels, beyond what kvlens takes (65536 a side)");
  return {static_cast<int>(hb), static_cast<int>(wb)};
}

std::array<int, 2> qwen_patch_grid(int height, int width, const QwenPatchConfig& c) {
  const auto [h, w] = smart_resize(height, width, c.patch_size * c.merge_size, c.min_pixels, c.max_pixels);
  return {h / c.patch_size, w / c.patch_size};
}

Tensor qwen_pixel_values(const RGBImage& img, const QwenPatchConfig& c) {
  const auto [h, w] = smart_resize(img.height, img.width, c.patch_size * c.merge_size, c.min_pixels, c.max_pixels);
  PreprocessConfig pc = c.pixels;
  pc.do_resize = true;
  pc.resize_height = h;
  pc.resize_width = w;
  const Tensor px = preprocess(img, pc);  // [3][h][w]
  const int P = c.patch_size, M = c.merge_size, Tp = c.temporal_patch_size, gh = h / P, gw = w / P;
  const int64_t per = 3LL * Tp * P * P;
  Tensor out("pixel_values", {static_cast<int64_t>(gh) * gw, per});
  // Patch order: merge blocks row by row, the block's patches row by row; within a patch the
  // channel, the frame (the same pixels each), the row and the column.
  int64_t n = 0;
  for (int bh = 0; bh < gh / M; ++bh)
    for (int bw = 0; bw < gw / M; ++bw)
      for (int mh = 0; mh < M; ++mh)
        for (int mw = 0; mw < M; ++mw, ++n) {
          const int y0 = (bh * M + mh) * P, x0 = (bw * M + mw) * P;
          float* dst = out.ptr() + n * per;
          for (int ch = 0; ch < 3; ++ch)
            for (int t = 0; t < Tp; ++t)
              for (int y = 0; y < P; ++y)
                for (int x = 0; x < P; ++x)
                  *dst++ = px.data[(static_cast<size_t>(ch) * h + y0 + y) * w + x0 + x];
        }
  return out;
}

}  // namespace kvlens
