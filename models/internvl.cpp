#include "models/internvl.h"

#include <algorithm>

#include "core/errors.h"
#include "core/json_file.h"
#include "core/numbers.h"
#include "models/activations.h"

namespace kvlens {

using model_detail::first_present;
using model_detail::in_model;
using model_detail::need_prefix;

namespace {

constexpr float kProjectorLnEps = 1e-5f;  // nn.LayerNorm's default

}  // namespace

InternVLModel InternVLModel::load(const std::string& dir, const BackendOptions& backend) {
  return model_detail::load_folder(dir, [&] { return load_checked(dir, backend); });
}

InternVLModel InternVLModel::load_checked(const std::string& dir, const BackendOptions& backend) {
  InternVLModel m;
  m.dir_ = dir;
  const std::string cp = dir + "/config.json";
  m.cfg_ = parse_internvl_config(read_json_file(cp, "config"), cp);
  m.tok_ = model_detail::image_tokenizer(dir, m.cfg_.image_token_id);
  const int S = m.cfg_.vision.image_size;
  const std::string pp = dir + "/preprocessor_config.json";
  const nlohmann::json pj = read_json_file_if_present(pp, "preprocessor config");
  m.pre_ = preprocess_config_from_json(pj, S);
  m.pre_.pad_to_square = false;
  if (m.pre_.resize_height > 0 && (m.pre_.resize_height != S || m.pre_.resize_width != S))
    throw InputError(pp + ": size " + std::to_string(m.pre_.resize_width) + "x" + std::to_string(m.pre_.resize_height) +
                     " differs from vision_config.image_size " + std::to_string(S));
  m.tiling_.tile = S;
  if (pj.contains("crop_to_patches") && !pj["crop_to_patches"].is_null()) {
    if (!pj["crop_to_patches"].is_boolean()) throw InputError(pp + ": 'crop_to_patches' must be true or false");
    m.tiling_.crop_to_patches = pj["crop_to_patches"].get<bool>();
  }
  if (pj.contains("min_patches")) m.tiling_.min_patches = json_int(pj["min_patches"], pp + ": min_patches", 1, 64);
  if (pj.contains("max_patches")) m.tiling_.max_patches = json_int(pj["max_patches"], pp + ": max_patches", 1, 64);
  if (m.tiling_.min_patches > m.tiling_.max_patches)
    throw InputError(pp + ": min_patches " + std::to_string(m.tiling_.min_patches) + " exceeds max_patches " +
                     std::to_string(m.tiling_.max_patches));

  const WeightStore ws = WeightStore::open_dir(dir);
  const std::string vp = need_prefix(ws, {"vision_tower.", "model.vision_tower."}, "embeddings.cls_token", "vision tower");
  const std::string tp = need_prefix(ws, {"language_model.model.", "model.language_model.", "language_model.", "model."},
                                     "embed_tokens.weight", "language model");
  const std::string pj_ = need_prefix(ws, {"multi_modal_projector.", "model.multi_modal_projector."}, "layer_norm.weight",
                                      "projector");
  const std::string lm_head = first_present(ws, {"lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight"});
  if (lm_head.empty() && !m.cfg_.tie_word_embeddings)
    throw InputError(dir + ": no lm_head weight, and config.json does not tie the word embeddings");
  m.text_cfg_ = m.cfg_.text;
  m.load_decoder(ws, tp, lm_head, m.cfg_.tie_word_embeddings, backend);
  const int L = m.cfg_.vision.num_hidden_layers, fl = m.cfg_.vision_feature_layer;
  m.vision_ = InternVit::load(ws, vp, m.cfg_.vision, fl < 0 ? L + 1 + fl : fl, m.be_);
  const int64_t C4 = 4 * static_cast<int64_t>(m.cfg_.vision.hidden_size), H = m.cfg_.text.hidden_size;
  m.ln_w_ = m.be_->vector(ws.host(pj_ + "layer_norm.weight", {C4}));
  m.ln_b_ = m.be_->vector(ws.host(pj_ + "layer_norm.bias", {C4}));
  m.w1_ = m.be_->matrix("projector.linear_1", {ws.host(pj_ + "linear_1.weight", {H, C4})});
  m.b1_ = m.be_->vector(ws.host(pj_ + "linear_1.bias", {H}));
  m.w2_ = m.be_->matrix("projector.linear_2", {ws.host(pj_ + "linear_2.weight", {H, H})});
  m.b2_ = m.be_->vector(ws.host(pj_ + "linear_2.bias", {H}));
  activation_from_name(m.cfg_.projector_hidden_act, "projector_hidden_act");
  ModelInfo& f = m.info_;
  f.architecture = "internvl";
  f.family = "InternVL (dynamic tiles)";
  f.image_dependent = true;
  f.n_visual = m.cfg_.tokens_per_tile();  // a square image: one tile, no thumbnail
  f.patch_rows = f.patch_cols = m.cfg_.shuffled_grid();
  f.tiling = std::to_string(S) + "-px tiles; " + std::to_string(m.tiling_.min_patches) + " to " +
             std::to_string(m.tiling_.max_patches) + " and a thumbnail";
  return m;
}

VisualLayout InternVLModel::visual_layout(int image_width, int image_height) const {
  const int g = cfg_.shuffled_grid(), per = cfg_.tokens_per_tile();
  int cols = 1, rows = 1;
  if (tiling_.crop_to_patches) {
    const auto grid = optimal_tile_grid(image_height, image_width, tiling_.tile, tiling_.min_patches, tiling_.max_patches);
    cols = grid[0];
    rows = grid[1];
  }
  const int tiles = cols * rows;
  VisualLayout l;
  l.image_width = image_width;
  l.image_height = image_height;
  VisualGrid t;
  t.name = tiles > 1 ? "tiles" : "patches";
  t.rows = rows * g;
  t.cols = cols * g;
  t.row_stride = t.cols;
  if (tiles > 1) {
    t.tile_side = g;
    t.tile_major = true;
  }
  l.grids = {t};
  l.n_tokens = tiles * per;
  if (tiles > 1) {  // the thumbnail, after the tiles
    VisualGrid th;
    th.name = "thumbnail";
    th.first = tiles * per;
    th.rows = th.cols = th.row_stride = g;
    l.grids.push_back(th);
    l.n_tokens += per;
  }
  return l;
}

Tensor InternVLModel::pixel_values(const RGBImage& img) const { return tiled_pixel_values(img, pre_, tiling_); }

std::vector<int> InternVLModel::prompt_ids(const std::string& prompt, const std::string& templ,
                                           const VisualLayout& image) const {
  const size_t at = templ.find("<image>");
  if (at == std::string::npos) throw InputError("prompt template '" + templ + "' has no <image> marker");
  // InternVLProcessor writes the image as <img>, its context tokens, </img>.
  std::string t = templ;
  t.replace(at, 7, "<img><image></img>");
  return tok_.encode_prompt(t, prompt, image.n_tokens);
}

ImageFeatures InternVLModel::encode_image(const Tensor& px, const VisualLayout& layout) const {
  return in_model(dir_, [&] {
    const int64_t images = px.shape.size() == 4 ? px.shape[0] : 1;
    const int per = cfg_.tokens_per_tile(), g = cfg_.shuffled_grid(), G = cfg_.vision.grid();
    if (images * per != layout.n_tokens)
      throw InputError("pixel_values hold " + std::to_string(images) + " tiles; an image of " +
                       std::to_string(layout.image_width) + "x" + std::to_string(layout.image_height) + " gives " +
                       std::to_string(layout.n_tokens / per) + " (its tiles and thumbnail)");
    const int64_t C = cfg_.vision.hidden_size, C4 = 4 * C, H = cfg_.text.hidden_size, N = images * per;
    const Dt mdt = w1_.dt;
    // Each tile through the tower, its patches pixel-shuffled: token (i, j) of the g × g grid
    // holds patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1) side by side (HF pixel_shuffle).
    // (`G` even, checked with the config.)
    Buffer shuffled = be_->alloc("projector.in", {N, C4}, Dt::F32);
    for (int64_t t = 0; t < images; ++t) {
      const Buffer hidden = vision_.forward(px.shape.size() == 4 ? px.item(t) : px, cfg_.vision_feature_layer);
      // Patch row 2i + a seen as g pairs of patches (rows of 2C): column block b of pair j is
      // patch (2i + a, 2j + b), block k = 2a + b of token (i, j). Four copies a token row.
      const int64_t e = dt_size(hidden.dt);
      for (int i = 0; i < g; ++i)
        for (int a = 0; a < 2; ++a) {
          Buffer pairs = hidden;
          pairs.data = hidden.as<char>() + (1 + static_cast<int64_t>(2 * i + a) * G) * C * e;
          pairs.shape = {g, 2 * C};
          for (int b = 0; b < 2; ++b) be_->copy_block(pairs, 0, b * C, shuffled, t * per + i * g, (2 * a + b) * C, g, C);
        }
    }
    Buffer normed = be_->alloc("projector.ln", {N, C4}, mdt);
    be_->layer_norm(shuffled, ln_w_, &ln_b_, kProjectorLnEps, normed);
    Buffer mid = be_->alloc("projector.mid", {N, H}, Dt::F32);
    be_->linear(normed, w1_, &b1_, mid, false);
    Buffer midm = be_->alloc("projector.mid_act", {N, H}, mdt);
    be_->bias_act(mid, nullptr, activation_from_name(cfg_.projector_hidden_act, "projector_hidden_act"), true, midm);
    ImageFeatures r;
    r.layout = layout;
    r.features = be_->alloc("image_features", {N, H}, Dt::F32);
    be_->linear(midm, w2_, &b2_, r.features, false);
    be_->check_finite(r.features, "multi_modal_projector output");
    be_->finish_checks();
    return r;
  });
}

}  // namespace kvlens
