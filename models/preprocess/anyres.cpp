#include "models/preprocess/anyres.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/errors.h"

namespace kvlens {

Resolution select_best_resolution(int height, int width, const std::vector<Resolution>& pinpoints) {
  if (pinpoints.empty()) throw InternalError("select_best_resolution: no pinpoints");
  if (height <= 0 || width <= 0)
    throw InputError("anyres: an image of " + std::to_string(width) + "x" + std::to_string(height) +
                     " pixels has no area");
  Resolution best = pinpoints.front();
  int64_t best_effective = 0, best_wasted = 0;
  bool first = true;
  const int64_t area = static_cast<int64_t>(width) * height;
  for (const Resolution& r : pinpoints) {
    // In doubles, as Python computes it; the products are truncated as int() does.
    const double scale = std::min(static_cast<double>(r[1]) / width, static_cast<double>(r[0]) / height);
    const int64_t dw = static_cast<int64_t>(width * scale), dh = static_cast<int64_t>(height * scale);
    const int64_t effective = std::min(dw * dh, area);
    const int64_t wasted = static_cast<int64_t>(r[0]) * r[1] - effective;
    if (first || effective > best_effective || (effective == best_effective && wasted < best_wasted)) {
      best = r;
      best_effective = effective;
      best_wasted = wasted;
      first = false;
    }
  }
  return best;
}

Resolution resize_into(int height, int width, Resolution target) {
  const double scale_w = static_cast<double>(target[1]) / width, scale_h = static_cast<double>(target[0]) / height;
  if (scale_w < scale_h)
    return {std::min(static_cast<int>(std::ceil(height * scale_w)), target[0]), target[1]};
  return {target[0], std::min(static_cast<int>(std::ceil(width * scale_h)), target[1])};
}

namespace {

// `img` centred on a black canvas of size `to` (offsets floor((to - size) / 2)), as np.pad.
RGBImage pad_centred(const RGBImage& img, Resolution to) {
  RGBImage out;
  out.height = to[0];
  out.width = to[1];
  out.data.assign(static_cast<size_t>(out.width) * out.height * 3, 0);
  const int oy = (to[0] - img.height) / 2, ox = (to[1] - img.width) / 2;
  for (int y = 0; y < img.height; ++y)
    std::memcpy(&out.data[(static_cast<size_t>(y + oy) * out.width + ox) * 3],
                &img.data[static_cast<size_t>(y) * img.width * 3], static_cast<size_t>(img.width) * 3);
  return out;
}

RGBImage crop(const RGBImage& img, int x0, int y0, int w, int h) {
  RGBImage out;
  out.width = w;
  out.height = h;
  out.data.resize(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    std::memcpy(&out.data[static_cast<size_t>(y) * w * 3], &img.data[(static_cast<size_t>(y + y0) * img.width + x0) * 3],
                static_cast<size_t>(w) * 3);
  return out;
}

}  // namespace

Tensor anyres_pixel_values(const RGBImage& img, const PreprocessConfig& cfg, const std::vector<Resolution>& pinpoints,
                           int tile) {
  if (img.width <= 0 || img.height <= 0 || img.data.size() != static_cast<size_t>(img.width) * img.height * 3)
    throw InputError((img.source.empty() ? std::string("image") : img.source) + ": not a decoded RGB image");
  const Resolution best = select_best_resolution(img.height, img.width, pinpoints);
  const Resolution fit = resize_into(img.height, img.width, best);
  const RGBImage canvas = pad_centred(resize_bicubic(img, fit[1], fit[0]), best);
  // The whole image at the processor's size (its shortest_edge, or height × width), then each tile.
  const int bh = cfg.resize_height > 0 ? cfg.resize_height : cfg.shortest_edge;
  const int bw = cfg.resize_width > 0 ? cfg.resize_width : cfg.shortest_edge;
  std::vector<RGBImage> parts{resize_bicubic(img, bw, bh)};
  for (int y = 0; y < best[0]; y += tile)
    for (int x = 0; x < best[1]; x += tile) parts.push_back(crop(canvas, x, y, tile, tile));
  PreprocessConfig each = cfg;
  each.pad_to_square = false;  // (LLaVA-NeXT's do_pad pads a batch's tile counts, not the image)
  std::vector<Tensor> tensors;
  for (const RGBImage& p : parts) tensors.push_back(preprocess(p, each));
  const int64_t C = tensors[0].dim(0), H = tensors[0].dim(1), W = tensors[0].dim(2);
  Tensor out("pixel_values", {static_cast<int64_t>(tensors.size()), C, H, W});
  for (size_t i = 0; i < tensors.size(); ++i)
    std::memcpy(out.ptr() + i * C * H * W, tensors[i].data.data(), sizeof(float) * C * H * W);
  return out;
}

}  // namespace kvlens
