// The report figures over the patch grid: each layer's and head's attention of one generated
// token as small multiples, and a method's token fate over the image.
#include <algorithm>
#include <cmath>
#include <memory>

#include "app/figures/figures_report.h"
#include "app/figures/report_json.h"
#include "core/visual_layout.h"

namespace kvlens::fig {

using namespace report_json;

Figure patch_multiples_figure(const std::vector<std::vector<std::vector<float>>>& att, int rows, int cols, bool mean,
                              const std::string& who, int token) {
  if (rows < 1 || cols < 1) throw InputError("small multiples: a patch grid of " + std::to_string(rows) + " × " +
                                             std::to_string(cols));
  const int L = static_cast<int>(att.size());
  int H = 0;
  for (const auto& l : att) H = std::max(H, static_cast<int>(l.size()));
  const int tiles_x = H + (mean ? 1 : 0), n = rows * cols;
  Series s;
  s.kind = SeriesKind::Heatmap;
  s.cols = tiles_x * (cols + 1) - 1;
  s.rows = L * (rows + 1) - 1;
  s.z.assign(static_cast<size_t>(std::max(0, s.rows)) * std::max(0, s.cols), std::nan(""));
  double zmax = 0;
  auto tile = [&](int l, int t, const std::vector<double>& v) {
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const double x = v[static_cast<size_t>(r) * cols + c];
        s.z[static_cast<size_t>(l * (rows + 1) + r) * s.cols + t * (cols + 1) + c] = x;
        if (std::isfinite(x)) zmax = std::max(zmax, x);
      }
  };
  for (int l = 0; l < L; ++l) {
    std::vector<double> sum(static_cast<size_t>(n), 0.0);
    int heads = 0;
    for (int h = 0; h < static_cast<int>(att[l].size()); ++h) {
      const std::vector<float>& a = att[l][h];
      if (a.empty()) continue;
      if (a.size() != static_cast<size_t>(n))
        throw InputError("small multiples: layer " + std::to_string(l) + " head " + std::to_string(h) + " holds " +
                         std::to_string(a.size()) + " values, the patch grid " + std::to_string(n));
      const std::vector<double> v(a.begin(), a.end());
      tile(l, h, v);
      for (int i = 0; i < n; ++i) sum[static_cast<size_t>(i)] += v[static_cast<size_t>(i)];
      ++heads;
    }
    if (mean && heads > 0) {
      for (double& x : sum) x /= heads;
      tile(l, H, sum);
    }
  }
  // One cell is 1 / (cols + 1) of a unit across (1 / (rows + 1) down): tile t spans [t, t + cols / (cols + 1)].
  s.x0 = 0;
  s.x1 = s.cols / (cols + 1.0);
  s.y0 = 0;
  s.y1 = s.rows / (rows + 1.0);
  // Log colours over three decades below the largest value: a head's few strong patches and the
  // rest both stay visible.
  s.z_log = true;
  s.z_max = zmax > 0 ? zmax : 1;
  s.z_min = s.z_max * 1e-3;
  Figure f;
  f.id = "attention_patches_" + slug(who) + "_t" + std::to_string(token);
  f.method = who;
  f.title = "Attention of generated token " + std::to_string(token) + " over the patches: " + who;
  f.note = "one tile per layer (rows) and head (columns)" + std::string(mean ? ", the last column the mean of heads" : "") +
           "; one colour scale (log, three decades)";
  f.series.push_back(s);
  f.colorbar = "attention probability (log)";
  f.aspect = (cols + 1.0) / (rows + 1.0);  // square patches
  matrix_axes(f, "head", s.x1, "layer", s.y1);
  const int step_x = std::max(1, tiles_x / 16), step_y = std::max(1, L / 16);
  const double cx = cols / (2.0 * (cols + 1)), cy = rows / (2.0 * (rows + 1));
  for (int h = 0; h < H; h += step_x) f.x.ticks.push_back({h + cx, std::to_string(h)});
  if (mean) f.x.ticks.push_back({H + cx, "mean"});
  for (int l = 0; l < L; l += step_y) f.y.ticks.push_back({l + cy, std::to_string(l)});
  return f;
}

namespace {

// `img` box-filtered to w × h RGBA pixels (opaque).
std::shared_ptr<const std::vector<uint8_t>> backdrop_pixels(const RGBImage& img, int w, int h) {
  auto out = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(w) * h * 4, 255);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      const int y0 = y * img.height / h, y1 = std::max(y0 + 1, (y + 1) * img.height / h);
      const int x0 = x * img.width / w, x1 = std::max(x0 + 1, (x + 1) * img.width / w);
      for (int c = 0; c < 3; ++c) {
        int64_t sum = 0;
        for (int yy = y0; yy < y1; ++yy)
          for (int xx = x0; xx < x1; ++xx) sum += img.data[(static_cast<size_t>(yy) * img.width + xx) * 3 + c];
        (*out)[(static_cast<size_t>(y) * w + x) * 4 + c] =
            static_cast<uint8_t>((sum + (y1 - y0) * (x1 - x0) / 2) / ((y1 - y0) * (x1 - x0)));
      }
    }
  return out;
}

}  // namespace

Figure token_fate_figure(const nlohmann::json& report, int method, int layer, const std::string& field,
                         const RGBImage* image) {
  const J grid = root(report).at("patch_grid");
  // The grid as the report gives it (core/visual_layout.h: patch_grid_json), read strictly.
  VisualGrid g;
  g.rows = grid.at("rows").integer();
  g.cols = grid.at("cols").integer();
  g.first = grid.at("first").integer();
  g.row_stride = grid.has("row_stride") ? grid.at("row_stride").integer() : g.cols;
  g.tile_side = grid.has("tile_major") ? grid.at("tile_major").integer() : 0;
  g.tile_major = g.tile_side > 0;
  const int R = g.rows, C = g.cols, first = g.first, stride = g.row_stride, tile = g.tile_side;
  if (tile < 0 || (tile > 0 && (R % tile || C % tile)))
    throw InputError(grid.where + ".tile_major " + std::to_string(tile) + " does not divide the " + std::to_string(R) + "×" +
                     std::to_string(C) + " grid");
  const J m = method_at(report, method);
  const J fate = layer_at(m, layer).at("token_fate");
  if (field != "kept" && field != "bits" && field != "merged")
    throw InputError("token fate field must be kept, bits or merged, got '" + field + "'");
  const std::vector<double> v = fate.at(field).nums();
  const int64_t need = R < 1 || C < 1 ? 0 : static_cast<int64_t>(g.token(R - 1, C - 1)) + 1;  // (its last token)
  if (R < 1 || C < 1 || first < 0 || stride < C || v.size() < static_cast<size_t>(need))
    throw InputError(fate.where + "." + field + " holds " + std::to_string(v.size()) + " values, the patch grid needs " +
                     std::to_string(need));
  Series s;
  s.kind = SeriesKind::Heatmap;
  s.rows = R;
  s.cols = C;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s.z.push_back(v[static_cast<size_t>(g.token(r, c))]);
  s.x0 = s.y0 = 0;
  s.x1 = C;
  s.y1 = R;
  s.z_min = 0;
  double zmax = 0;
  for (double z : s.z) zmax = std::max(zmax, z);
  s.z_max = field == "kept" ? 1.0 : field == "bits" ? std::max(zmax, 1.0) : std::max(zmax, 1.0);
  const bool over_image = image && image->width > 0 && image->height > 0 &&
                          image->data.size() == static_cast<size_t>(image->width) * image->height * 3;
  if (over_image) {
    s.alpha = 0.6f;
    s.backdrop_w = std::min(image->width, 12 * C);
    s.backdrop_h = std::min(image->height, 12 * R);
    s.backdrop = backdrop_pixels(*image, s.backdrop_w, s.backdrop_h);
  }
  Figure f;
  f.id = "token_fate_" + field + "_" + method_id(report, method) + "_l" + std::to_string(layer);
  f.method = method_labels(report)[method];
  f.layer = layer;
  const char* what = field == "kept" ? "share of KV heads keeping each patch"
                     : field == "bits" ? "mean bits of each patch's kept rows"
                                       : "mean evicted rows merged into each patch";
  f.title = "Token fate, " + method_labels(report)[method] + ", layer " + std::to_string(layer);
  f.note = over_image ? std::string(what) + ", over the image as the model sees it" : what;
  f.series.push_back(s);
  f.colorbar = field == "kept" ? "kept share" : field == "bits" ? "bits (0 = evicted)" : "rows merged";
  f.aspect = 1;  // square patches, as the image's
  matrix_axes(f, "patch column", C, "patch row", R);
  for (int c = 0; c < C; c += std::max(1, C / 7)) f.x.ticks.push_back({c + 0.5, std::to_string(c)});
  for (int r = 0; r < R; r += std::max(1, R / 7)) f.y.ticks.push_back({r + 0.5, std::to_string(r)});
  f.legend = false;
  return f;
}

}  // namespace kvlens::fig
