#include "models/llava.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/errors.h"
#include "core/json_file.h"
#include "models/activations.h"
#include "models/llava_next.h"
#include "models/preprocess/anyres.h"

namespace kvlens {

using model_detail::in_model;
using model_detail::ms_since;
using model_detail::need_prefix;

LlavaModel LlavaModel::load(const std::string& dir, const BackendOptions& backend) {
  return model_detail::load_folder(dir, [&] { return load_checked(dir, backend); });
}

LlavaModel LlavaModel::load_checked(const std::string& dir, const BackendOptions& backend) {
  LlavaModel m;
  m.dir_ = dir;
  m.cfg_ = load_llava_config(dir + "/config.json");
  m.tok_ = Tokenizer::load(dir, m.cfg_.image_token_index);
  if (m.tok_.image_token_id() >= m.cfg_.text.vocab_size)
    throw InputError(dir + ": <image> token id " + std::to_string(m.tok_.image_token_id()) +
                     " is outside the text vocabulary");
  const std::string pp = dir + "/preprocessor_config.json";
  const nlohmann::json pj_json = read_json_file_if_present(pp, "preprocessor config");
  m.pre_ = preprocess_config_from_json(pj_json, m.cfg_.vision.image_size);
  if (m.cfg_.anyres()) {
    // LLaVA-NeXT's processor pads a batch's tile counts with do_pad, not the image; it tiles with
    // its own pinpoints, which must be the model's for the token counts to agree.
    m.pre_.pad_to_square = false;
    if (pj_json.is_object() && pj_json.contains("image_grid_pinpoints") &&
        parse_grid_pinpoints(pj_json["image_grid_pinpoints"], pp + ": image_grid_pinpoints") != m.cfg_.grid_pinpoints)
      throw InputError(pp + ": image_grid_pinpoints differ from config.json's; the processor would cut images into "
                            "other tiles than the model unpads");
  }
  if (m.pre_.crop_height != m.cfg_.vision.image_size || m.pre_.crop_width != m.cfg_.vision.image_size)
    throw InputError(pp + ": crop size " + std::to_string(m.pre_.crop_width) + "x" +
                     std::to_string(m.pre_.crop_height) + " differs from vision_config.image_size " +
                     std::to_string(m.cfg_.vision.image_size));

  const WeightStore ws = WeightStore::open_dir(dir);
  const std::string vp = need_prefix(ws,
      {"vision_tower.vision_model.", "model.vision_tower.vision_model.", "vision_tower.", "model.vision_tower."},
      "embeddings.patch_embedding.weight", "vision tower");
  const std::string tp = need_prefix(ws,
      {"language_model.model.", "model.language_model.", "language_model.", "model."},
      "embed_tokens.weight", "language model");
  const std::string pj = need_prefix(ws, {"multi_modal_projector.", "model.multi_modal_projector."},
                                     "linear_1.weight", "projector");
  const std::string lm_head =
      model_detail::first_present(ws, {"model.lm_head.weight", "lm_head.weight", "language_model.lm_head.weight"});
  m.text_cfg_ = m.cfg_.text;
  m.load_decoder(ws, tp, lm_head, m.cfg_.tie_word_embeddings, backend);
  m.vision_ = ClipVision::load(ws, vp, m.cfg_.vision, m.cfg_.encoder_layers_needed(), m.be_);
  const int64_t in = static_cast<int64_t>(m.cfg_.vision.hidden_size) * m.cfg_.vision_feature_layers.size();
  const int64_t H = m.cfg_.text.hidden_size;
  m.proj_.w1 = m.be_->matrix("projector.linear_1", {ws.host(pj + "linear_1.weight", {H, in})});
  m.proj_.w2 = m.be_->matrix("projector.linear_2", {ws.host(pj + "linear_2.weight", {H, H})});
  if (m.cfg_.multimodal_projector_bias) {
    m.proj_.b1 = m.be_->vector(ws.host(pj + "linear_1.bias", {H}));
    m.proj_.b2 = m.be_->vector(ws.host(pj + "linear_2.bias", {H}));
  }
  activation_from_name(m.cfg_.projector_hidden_act, "projector_hidden_act");
  if (m.cfg_.anyres()) {
    const std::string nl = model_detail::first_present(ws, {"image_newline", "model.image_newline"});
    if (nl.empty()) throw InputError(dir + ": no 'image_newline' tensor (LLaVA-NeXT's row-end token)");
    m.newline_ = m.be_->vector(ws.host(nl, {H}));
    m.newline_.shape = {1, H};  // one row, as copy_block reads it
  }
  ModelInfo& f = m.info_;
  f.architecture = m.cfg_.model_type;
  const int side = m.cfg_.vision.image_size / m.cfg_.vision.patch_size;
  if (m.cfg_.anyres()) {
    const int S = m.cfg_.vision.image_size;
    f.family = "LLaVA-NeXT (anyres)";
    f.image_dependent = true;
    f.n_visual = anyres_layout(m.cfg_, S, S).n_tokens;
    f.patch_rows = f.patch_cols = side;  // the base image's grid
    f.tiling = std::to_string(S) + "-px tiles; resolutions";
    for (const auto& r : m.cfg_.grid_pinpoints) f.tiling += " " + std::to_string(r[1]) + "×" + std::to_string(r[0]);
  } else {
    f.family = "LLaVA-1.5";
    f.n_visual = m.cfg_.n_visual_tokens();
    f.patch_rows = f.patch_cols = side;
    f.patch_first = f.n_visual - f.patch_rows * f.patch_cols;
  }
  return m;
}

VisualLayout LlavaModel::visual_layout(int image_width, int image_height) const {
  if (cfg_.anyres()) return anyres_layout(cfg_, image_width, image_height);
  VisualLayout l;
  l.n_tokens = cfg_.n_visual_tokens();
  l.image_width = image_width;
  l.image_height = image_height;
  VisualGrid g;
  g.name = "patches";
  g.rows = g.cols = g.row_stride = info_.patch_rows;
  g.first = info_.patch_first;
  l.grids = {g};
  return l;
}

Tensor LlavaModel::pixel_values(const RGBImage& img) const {
  if (cfg_.anyres()) return anyres_pixel_values(img, pre_, cfg_.grid_pinpoints, cfg_.vision.image_size);
  return preprocess(img, pre_);
}

ImageFeatures LlavaModel::encode_image(const Tensor& px, const VisualLayout& layout) const {
  return in_model(dir_, [&] {
    ImageFeatures r;
    r.layout = layout;
    const int64_t images = px.shape.size() == 4 ? px.shape[0] : 1;
    AnyresGeometry g;
    if (cfg_.anyres()) g = anyres_geometry(cfg_, layout.image_width, layout.image_height);
    const int64_t want = cfg_.anyres() ? 1 + static_cast<int64_t>(g.tile_rows) * g.tile_cols : 1;
    if (images != want)
      throw InputError("pixel_values hold " + std::to_string(images) + " images; an image of " +
                       std::to_string(layout.image_width) + "x" + std::to_string(layout.image_height) + " gives " +
                       std::to_string(want) + " (the whole image and its tiles)");
    Buffer per_image = project_images(px);
    r.features = cfg_.anyres() ? pack_anyres_features(*be_, g, per_image, newline_) : std::move(per_image);
    if (r.features.shape[0] != layout.n_tokens)
      throw InternalError("encode_image: " + std::to_string(r.features.shape[0]) + " features for " +
                          std::to_string(layout.n_tokens) + " visual tokens");
    be_->check_finite(r.features, "multi_modal_projector output");
    be_->finish_checks();
    return r;
  });
}

Buffer LlavaModel::project_images(const Tensor& px) const {
  const int VH = cfg_.vision.hidden_size, H = cfg_.text.hidden_size;
  const int skip = cfg_.vision_feature_select_strategy == "default" ? 1 : 0;
  const int per = cfg_.n_visual_tokens(), L = static_cast<int>(cfg_.feature_layer_indices().size());
  const int64_t images = px.shape.size() == 4 ? px.shape[0] : 1;
  const int64_t N = images * per;
  const Dt mdt = proj_.w1.dt;
  // Selected features of every feature layer, concatenated along the hidden dimension; the
  // images one after the other.
  Buffer feat = be_->alloc("projector.in", {N, static_cast<int64_t>(VH) * L}, Dt::F32);
  for (int64_t i = 0; i < images; ++i) {
    const auto states = vision_.forward(px.shape.size() == 4 ? px.item(i) : px, cfg_.feature_layer_indices());
    for (int s = 0; s < L; ++s)
      be_->copy_block(states[s], skip, 0, feat, i * per, static_cast<int64_t>(s) * VH, per, VH);
  }
  Buffer featm = feat;
  if (mdt != Dt::F32) {
    featm = be_->alloc("projector.in_m", feat.shape, mdt);
    be_->bias_act(feat, nullptr, Act::Relu, false, featm);
  }
  Buffer mid = be_->alloc("projector.mid", {N, H}, Dt::F32);
  be_->linear(featm, proj_.w1, proj_.b1.empty() ? nullptr : &proj_.b1, mid, false);
  Buffer midm = be_->alloc("projector.mid_act", {N, H}, mdt);
  be_->bias_act(mid, nullptr, activation_from_name(cfg_.projector_hidden_act, "projector_hidden_act"), true, midm);
  Buffer out = be_->alloc("image_features", {N, H}, Dt::F32);
  be_->linear(midm, proj_.w2, proj_.b2.empty() ? nullptr : &proj_.b2, out, false);
  return out;
}

}  // namespace kvlens
