#include "models/preprocess/dynamic_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/errors.h"

namespace kvlens {

std::array<int, 2> optimal_tile_grid(int height, int width, int tile, int min_patches, int max_patches) {
  // HF get_all_supported_aspect_ratios: (columns, rows) in column-major order, stably sorted by tile count.
  std::vector<std::array<int, 2>> grids;
  for (int w = 1; w <= max_patches; ++w)
    for (int h = 1; h <= max_patches; ++h)
      if (w * h <= max_patches && w * h >= min_patches) grids.push_back({w, h});
  std::stable_sort(grids.begin(), grids.end(), [](const auto& a, const auto& b) { return a[0] * a[1] < b[0] * b[1]; });
  const double aspect = static_cast<double>(width) / height, area = static_cast<double>(width) * height;
  double best_diff = INFINITY;
  std::array<int, 2> best{1, 1};
  for (const auto& g : grids) {
    const double diff = std::fabs(aspect - static_cast<double>(g[0]) / g[1]);
    if (diff < best_diff) {
      best_diff = diff;
      best = g;
    } else if (diff == best_diff && area > 0.5 * tile * tile * g[0] * g[1]) {
      best = g;
    }
  }
  return best;
}

Tensor tiled_pixel_values(const RGBImage& img, const PreprocessConfig& cfg, const TilingConfig& t) {
  if (img.width <= 0 || img.height <= 0 || img.data.size() != static_cast<size_t>(img.width) * img.height * 3)
    throw InputError((img.source.empty() ? std::string("image") : img.source) + ": not a decoded RGB image");
  std::vector<RGBImage> parts;
  if (!t.crop_to_patches) {
    parts.push_back(img);
  } else {
    const auto [cols, rows] = optimal_tile_grid(img.height, img.width, t.tile, t.min_patches, t.max_patches);
    const RGBImage grid = resize_bicubic(img, cols * t.tile, rows * t.tile);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        RGBImage p;
        p.width = p.height = t.tile;
        p.data.resize(static_cast<size_t>(t.tile) * t.tile * 3);
        for (int y = 0; y < t.tile; ++y)
          std::memcpy(&p.data[static_cast<size_t>(y) * t.tile * 3],
                      &grid.data[(static_cast<size_t>(r * t.tile + y) * grid.width + c * t.tile) * 3],
                      static_cast<size_t>(t.tile) * 3);
        parts.push_back(std::move(p));
      }
    if (parts.size() > 1) parts.push_back(resize_bicubic(img, t.tile, t.tile));  // the thumbnail
  }
  PreprocessConfig each = cfg;
  each.pad_to_square = false;
  std::vector<Tensor> tensors;
  for (const RGBImage& p : parts) tensors.push_back(preprocess(p, each));
  const int64_t C = tensors[0].dim(0), H = tensors[0].dim(1), W = tensors[0].dim(2);
  Tensor out("pixel_values", {static_cast<int64_t>(tensors.size()), C, H, W});
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() != C * H * W) throw InternalError("tiled_pixel_values: tiles of different sizes");
    std::memcpy(out.ptr() + i * C * H * W, tensors[i].data.data(), sizeof(float) * C * H * W);
  }
  return out;
}

}  // namespace kvlens
