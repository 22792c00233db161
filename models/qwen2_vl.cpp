#include "models/qwen2_vl.h"

#include <algorithm>

#include "core/errors.h"
#include "core/json_file.h"

namespace kvlens {

using model_detail::first_present;
using model_detail::in_model;
using model_detail::need_prefix;

Qwen2VLModel Qwen2VLModel::load(const std::string& dir, const BackendOptions& backend) {
  return model_detail::load_folder(dir, [&] { return load_checked(dir, backend); });
}

Qwen2VLModel Qwen2VLModel::load_checked(const std::string& dir, const BackendOptions& backend) {
  Qwen2VLModel m;
  m.dir_ = dir;
  const std::string cp = dir + "/config.json";
  m.cfg_ = parse_qwen2_vl_config(read_json_file(cp, "config"), cp);
  m.tok_ = model_detail::image_tokenizer(dir, m.cfg_.image_token_id);
  const std::string pp = dir + "/preprocessor_config.json";
  const nlohmann::json pj = read_json_file_if_present(pp, "preprocessor config");
  m.patches_ = qwen_patch_config_from_json(pj, pp);
  m.pre_ = m.patches_.pixels;
  const Qwen2VitConfig& v = m.cfg_.vision;
  if (m.patches_.patch_size != v.patch_size || m.patches_.merge_size != v.spatial_merge_size ||
      m.patches_.temporal_patch_size != v.temporal_patch_size)
    throw InputError(pp + ": patch_size " + std::to_string(m.patches_.patch_size) + ", merge_size " +
                     std::to_string(m.patches_.merge_size) + ", temporal_patch_size " +
                     std::to_string(m.patches_.temporal_patch_size) + " differ from vision_config's " +
                     std::to_string(v.patch_size) + ", " + std::to_string(v.spatial_merge_size) + ", " +
                     std::to_string(v.temporal_patch_size));

  const WeightStore ws = WeightStore::open_dir(dir);
  const std::string vp = need_prefix(ws, {"model.visual.", "visual."}, "patch_embed.proj.weight", "vision tower");
  const std::string tp = need_prefix(ws, {"model.language_model.", "model."}, "embed_tokens.weight", "language model");
  const std::string lm_head = first_present(ws, {"lm_head.weight", "model.lm_head.weight"});
  if (lm_head.empty() && !m.cfg_.tie_word_embeddings)
    throw InputError(dir + ": no lm_head weight, and config.json does not tie the word embeddings");
  m.text_cfg_ = m.cfg_.text;
  m.load_decoder(ws, tp, lm_head, m.cfg_.tie_word_embeddings, backend);
  m.vision_ = Qwen2Vit::load(ws, vp, v, m.be_);
  ModelInfo& f = m.info_;
  f.architecture = v.windowed ? "qwen2_5_vl" : "qwen2_vl";
  f.family = v.windowed ? "Qwen2.5-VL (native resolution)" : "Qwen2-VL (native resolution)";
  f.image_dependent = true;
  const VisualLayout square = m.visual_layout(448, 448);  // (the count of a square image)
  f.n_visual = square.n_tokens;
  f.patch_rows = square.grids.front().rows;
  f.patch_cols = square.grids.front().cols;
  // (the Model panel shows the part before the first ';')
  f.tiling = std::to_string(v.spatial_merge_size) + "×" + std::to_string(v.spatial_merge_size) + " of " +
             std::to_string(v.patch_size) + "-px patches" +
             (v.windowed ? "; " + std::to_string(v.window_size) + "-px windows" : std::string()) + "; " +
             std::to_string(m.patches_.min_pixels) + " to " + std::to_string(m.patches_.max_pixels) + " pixels";
  return m;
}

VisualLayout Qwen2VLModel::visual_layout(int image_width, int image_height) const {
  const auto [gh, gw] = qwen_patch_grid(image_height, image_width, patches_);
  const int M = cfg_.vision.spatial_merge_size;
  VisualLayout l;
  l.image_width = image_width;
  l.image_height = image_height;
  VisualGrid g;
  g.name = "patches";
  g.rows = gh / M;
  g.cols = gw / M;
  g.row_stride = g.cols;
  l.grids = {g};
  l.n_tokens = g.rows * g.cols;
  return l;
}

Tensor Qwen2VLModel::pixel_values(const RGBImage& img) const { return qwen_pixel_values(img, patches_); }

ImageFeatures Qwen2VLModel::encode_image(const Tensor& px, const VisualLayout& layout) const {
  return in_model(dir_, [&] {
    if (layout.grids.size() != 1) throw InternalError("qwen2_vl: an image layout of one grid expected");
    const int M = cfg_.vision.spatial_merge_size, rows = layout.grids[0].rows * M, cols = layout.grids[0].cols * M;
    ImageFeatures r;
    r.layout = layout;
    r.features = vision_.forward(px, rows, cols);
    be_->check_finite(r.features, "vision merger output");
    be_->finish_checks();
    return r;
  });
}

std::vector<int32_t> Qwen2VLModel::mrope_positions(const std::vector<SegmentKind>& kinds, const VisualLayout& image,
                                                   int& rope_delta) {
  const int T = static_cast<int>(kinds.size());
  std::vector<int32_t> p(3 * static_cast<size_t>(T));
  int next = 0, max_pos = -1;
  for (int i = 0; i < T;) {
    if (kinds[static_cast<size_t>(i)] != SegmentKind::Visual) {
      for (int r = 0; r < 3; ++r) p[static_cast<size_t>(r * T + i)] = next;
      max_pos = std::max(max_pos, next++);
      ++i;
      continue;
    }
    int n = 0;
    while (i + n < T && kinds[static_cast<size_t>(i + n)] == SegmentKind::Visual) ++n;
    if (image.grids.size() != 1 || n != image.n_tokens || n != image.grids[0].rows * image.grids[0].cols)
      throw InternalError("qwen2_vl: a run of " + std::to_string(n) + " image tokens for an image of " +
                          std::to_string(image.n_tokens));
    const int cols = image.grids[0].cols, rows = image.grids[0].rows;
    for (int k = 0; k < n; ++k) {
      const size_t at = static_cast<size_t>(i + k);
      p[at] = next;
      p[T + at] = next + k / cols;
      p[2 * static_cast<size_t>(T) + at] = next + k % cols;
      max_pos = std::max({max_pos, next + k / cols, next + k % cols});
    }
    next += std::max(rows, cols);
    i += n;
  }
  rope_delta = max_pos + 1 - T;
  return p;
}

std::vector<int32_t> Qwen2VLModel::rope_positions(const PrefillState& st) const {
  if (st.n_visual == 0) return {};  // a prompt without an image: positions 0..T-1
  int delta = 0;
  std::vector<int32_t> p = mrope_positions(st.kinds, st.layout, delta);
  for (int32_t& x : p) x -= delta;  // (the text after the image then sits at its sequence position)
  return p;
}

}  // namespace kvlens
