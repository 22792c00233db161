#include "models/llava.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/errors.h"
#include "core/json_file.h"
#include "models/activations.h"

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
  m.pre_ = preprocess_config_from_json(
      file_exists(pp) ? read_json_file(pp, "preprocessor config") : nlohmann::json::object(),
      m.cfg_.vision.image_size);
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
  ModelInfo& f = m.info_;
  f.architecture = "llava";
  f.n_visual = m.cfg_.n_visual_tokens();
  f.patch_rows = f.patch_cols = m.cfg_.vision.image_size / m.cfg_.vision.patch_size;
  f.patch_first = f.n_visual - f.patch_rows * f.patch_cols;
  return m;
}

Tensor LlavaModel::pixel_values(const RGBImage& img) const { return preprocess(img, pre_); }

std::vector<int> LlavaModel::prompt_ids(const std::string& prompt, const std::string& templ) const {
  if (templ.find("<image>") == std::string::npos)
    throw InputError("prompt template '" + templ + "' has no <image> marker");
  return tok_.encode_prompt(templ, prompt, cfg_.n_visual_tokens());
}

Buffer LlavaModel::encode_image(const Tensor& px) const {
  return in_model(dir_, [&] { return encode_image_unnamed(px); });
}

Buffer LlavaModel::encode_image_unnamed(const Tensor& px) const {
  const auto states = vision_.forward(px, cfg_.feature_layer_indices());
  const int VH = cfg_.vision.hidden_size, H = cfg_.text.hidden_size;
  const int skip = cfg_.vision_feature_select_strategy == "default" ? 1 : 0;
  const int N = cfg_.n_visual_tokens(), L = static_cast<int>(states.size());
  const Dt mdt = proj_.w1.dt;
  // Selected features of every feature layer, concatenated along the hidden dimension.
  Buffer feat = be_->alloc("projector.in", {N, static_cast<int64_t>(VH) * L}, Dt::F32);
  for (int s = 0; s < L; ++s) be_->copy_block(states[s], skip, 0, feat, 0, static_cast<int64_t>(s) * VH, N, VH);
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
  be_->check_finite(out, "multi_modal_projector output");
  be_->finish_checks();
  return out;
}

PrefillState LlavaModel::prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                                 bool keep_attention, const std::vector<AttentionObserver*>& observers) const {
  const auto t0 = std::chrono::steady_clock::now();
  const Tensor px = pixel_values(img);
  const double preprocess_ms = ms_since(t0);
  const auto t1 = std::chrono::steady_clock::now();
  const Buffer feats = encode_image(px);
  be_->synchronize();
  const double vision_ms = ms_since(t1);
  PrefillState st = prefill_features(feats, prompt, templ, keep_attention, observers);
  st.preprocess_ms = preprocess_ms;
  st.vision_ms = vision_ms;
  return st;
}

PrefillState LlavaModel::prefill_features(const Buffer& feats, const std::string& prompt, const std::string& templ,
                                          bool keep_attention, const std::vector<AttentionObserver*>& observers) const {
  PrefillState st;
  const auto t1 = std::chrono::steady_clock::now();
  st.n_visual = cfg_.n_visual_tokens();
  st.ids = prompt_ids(prompt, templ);
  const int T = static_cast<int>(st.ids.size());
  check_prompt_length(T, st.n_visual);
  const int H = cfg_.text.hidden_size, img_id = tok_.image_token_id();
  if (feats.shape != std::vector<int64_t>{st.n_visual, H})
    throw InputError("image features have shape " + feats.shape_str() + ", the model needs [" +
                     std::to_string(st.n_visual) + "," + std::to_string(H) + "]");
  const auto n_image_ids = std::count(st.ids.begin(), st.ids.end(), img_id);
  if (n_image_ids != st.n_visual)
    throw InputError("prompt holds " + std::to_string(n_image_ids) + " image tokens, the image gives " +
                     std::to_string(st.n_visual) + " features (one <image> marker is expected, in the template)");
  // Text tokens through the embedding table, then each run of image tokens replaced by the
  // next image features.
  st.kinds.resize(T);
  std::vector<int> text_ids(st.ids);
  int seen = 0;
  for (int t = 0; t < T; ++t) {
    if (st.ids[t] == img_id) {
      st.kinds[t] = SegmentKind::Visual;
      ++seen;
    } else {
      st.kinds[t] = seen ? SegmentKind::PostVisionText : SegmentKind::System;
    }
  }
  Buffer x = text_.embed_tokens(text_ids);
  x.name = "prompt_embeds";
  int used = 0;
  for (int t = 0; t < T;) {
    if (st.ids[t] != img_id) {
      ++t;
      continue;
    }
    int e = t;
    while (e < T && st.ids[e] == img_id) ++e;
    be_->copy_block(feats, used, 0, x, t, 0, e - t, H);
    used += e - t;
    t = e;
  }
  prefill_embedded(st, std::move(x), keep_attention, observers);
  st.prefill_ms = ms_since(t1);
  return st;
}

}  // namespace kvlens
