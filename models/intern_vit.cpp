#include "models/intern_vit.h"

#include <cmath>

#include "core/errors.h"
#include "models/activations.h"
#include "models/clip.h"

namespace kvlens {

namespace {

constexpr float kQkNormEps = 1e-6f;  // InternVLVisionRMSNorm's default

// A projection with layer scale folded in: rows of W and entries of b times lambda (fp32).
Buffer scaled_matrix(Backend& be, const WeightStore& ws, const std::string& name, const std::string& w, int64_t rows,
                     int64_t cols, const std::vector<float>& lambda) {
  Tensor t = ws.load(w, {rows, cols});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t.data[static_cast<size_t>(r * cols + c)] *= lambda[static_cast<size_t>(r)];
  return be.matrix(name, {{w, Dt::F32, {rows, cols}, t.data.data()}});
}

Buffer scaled_vector(Backend& be, const WeightStore& ws, const std::string& b, int64_t n, const std::vector<float>& lambda) {
  Tensor t = ws.load(b, {n});
  for (int64_t i = 0; i < n; ++i) t.data[static_cast<size_t>(i)] *= lambda[static_cast<size_t>(i)];
  return be.vector({b, Dt::F32, {n}, t.data.data()});
}

}  // namespace

InternVit InternVit::load(const WeightStore& ws, const std::string& p, const InternVitConfig& cfg, int n_layers,
                          std::shared_ptr<Backend> be) {
  InternVit m;
  m.cfg = cfg;
  m.be = be;
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, P = cfg.patch_size, N = static_cast<int64_t>(cfg.grid()) * cfg.grid();
  const bool ln = cfg.norm_type == "layer_norm";
  HostTensor cls = ws.host(p + "embeddings.cls_token", {1, 1, H});
  cls.shape = {1, H};
  m.cls_token = be->vector(cls);
  HostTensor patch = ws.host(p + "embeddings.patch_embeddings.projection.weight", {H, 3, P, P});
  patch.shape = {H, 3 * P * P};
  m.patch_w = be->matrix("vision.patch_embedding", {patch});
  m.patch_b = be->vector(ws.host(p + "embeddings.patch_embeddings.projection.bias", {H}));
  if (cfg.use_absolute_position_embeddings) {
    HostTensor pos = ws.host(p + "embeddings.position_embeddings", {1, N + 1, H});
    pos.shape = {N + 1, H};
    m.position = be->vector(pos);
  }
  for (int l = 0; l < n_layers; ++l) {
    const std::string q = p + "encoder.layer." + std::to_string(l) + ".";
    const std::string n = "vision.l" + std::to_string(l) + ".";
    InternVitLayer L;
    L.n1_w = be->vector(ws.host(q + "layernorm_before.weight", {H}));
    if (ln) L.n1_b = be->vector(ws.host(q + "layernorm_before.bias", {H}));
    L.qkv_w = be->matrix(n + "qkv", {ws.host(q + "attention.q_proj.weight", {H, H}), ws.host(q + "attention.k_proj.weight", {H, H}),
                                     ws.host(q + "attention.v_proj.weight", {H, H})});
    if (cfg.attention_bias) {
      std::vector<float> b;
      for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
        const Tensor t = ws.load(q + "attention." + name + ".bias", {H});
        b.insert(b.end(), t.data.begin(), t.data.end());
      }
      L.qkv_b = be->vector({n + "qkv_bias", Dt::F32, {3 * H}, b.data()});
    }
    if (cfg.use_qk_norm) {
      L.q_norm = be->vector(ws.host(q + "attention.q_norm.weight", {H}));
      L.k_norm = be->vector(ws.host(q + "attention.k_norm.weight", {H}));
    }
    const Tensor l1 = ws.load(q + "lambda_1", {H}), l2 = ws.load(q + "lambda_2", {H});
    L.o_w = scaled_matrix(*be, ws, n + "o", q + "attention.projection_layer.weight", H, H, l1.data);
    L.o_b = scaled_vector(*be, ws, q + "attention.projection_layer.bias", H, l1.data);
    L.n2_w = be->vector(ws.host(q + "layernorm_after.weight", {H}));
    if (ln) L.n2_b = be->vector(ws.host(q + "layernorm_after.bias", {H}));
    L.fc1_w = be->matrix(n + "fc1", {ws.host(q + "mlp.fc1.weight", {I, H})});
    L.fc1_b = be->vector(ws.host(q + "mlp.fc1.bias", {I}));
    L.fc2_w = scaled_matrix(*be, ws, n + "fc2", q + "mlp.fc2.weight", H, I, l2.data);
    L.fc2_b = scaled_vector(*be, ws, q + "mlp.fc2.bias", H, l2.data);
    m.layers.push_back(std::move(L));
    ws.release();
  }
  if (!cfg.use_mean_pooling) {
    m.final_w = be->vector(ws.host(p + "layernorm.weight", {H}));
    m.final_b = be->vector(ws.host(p + "layernorm.bias", {H}));
  }
  activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  return m;
}

Buffer InternVit::forward(const Tensor& px, int feature_layer) const {
  const int S = cfg.image_size, P = cfg.patch_size, G = S / P, N = G * G, T = N + 1;
  const int H = cfg.hidden_size, I = cfg.intermediate_size, NH = cfg.num_attention_heads, D = H / NH;
  if (px.shape != std::vector<int64_t>{3, S, S})
    throw InputError("pixel_values has shape " + px.shape_str() + ", the vision tower needs [3," + std::to_string(S) + "," +
                     std::to_string(S) + "]");
  const int L = cfg.num_hidden_layers;
  const int run = feature_layer < 0 ? L + 1 + feature_layer : feature_layer;  // layers to run
  if (run < 0 || run > static_cast<int>(layers.size())) throw InternalError("InternVit: feature layer beyond the loaded layers");
  const Act act = activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  const Dt mdt = patch_w.dt;
  const float eps = static_cast<float>(cfg.layer_norm_eps);
  const bool ln = cfg.norm_type == "layer_norm";
  const std::vector<float> cols = patch_columns(px, S, P);  // (models/clip.h)
  Buffer colsb = be->alloc("vision.patches", {N, 3 * P * P}, mdt);
  be->upload(cols.data(), colsb);
  Buffer pe = be->alloc("vision.patch_embeds", {N, H}, Dt::F32);
  be->linear(colsb, patch_w, &patch_b, pe, false);
  Buffer h = be->alloc("vision.h", {T, H}, Dt::F32);
  be->copy_block(cls_token, 0, 0, h, 0, 0, 1, H);
  be->copy_block(pe, 0, 0, h, 1, 0, N, H);
  if (!position.empty()) be->add(h, position);
  be->check_finite(h, "vision embeddings");
  const AttnLayout lay = vision_attention_layout(T, NH, D);
  Buffer x = be->alloc("vision.x", {T, H}, mdt);
  Buffer qkv = be->alloc("vision.qkv", {T, 3 * H}, Dt::F32);
  Buffer qk = cfg.use_qk_norm ? be->alloc("vision.qk", {T, H}, Dt::F32) : Buffer{};
  Buffer qk_normed = cfg.use_qk_norm ? be->alloc("vision.qk_normed", {T, H}, Dt::F32) : Buffer{};
  Buffer a = be->alloc("vision.attn_out", {T, H}, mdt);
  Buffer mlp32 = be->alloc("vision.fc1", {T, I}, Dt::F32);
  Buffer mlp = be->alloc("vision.fc1_act", {T, I}, mdt);
  auto norm = [&](const Buffer& w, const Buffer& b, Buffer& out) {
    if (ln) be->layer_norm(h, w, &b, eps, out);
    else be->rms_norm(h, w, eps, out);
  };
  for (int l = 0; l < run; ++l) {
    const InternVitLayer& Ly = layers[static_cast<size_t>(l)];
    norm(Ly.n1_w, Ly.n1_b, x);
    be->linear(x, Ly.qkv_w, Ly.qkv_b.empty() ? nullptr : &Ly.qkv_b, qkv, false);
    if (cfg.use_qk_norm)  // RMSNorm over each token's whole query, then key (before the heads split)
      for (int part = 0; part < 2; ++part) {
        be->copy_block(qkv, 0, part * H, qk, 0, 0, T, H);
        be->rms_norm(qk, part == 0 ? Ly.q_norm : Ly.k_norm, kQkNormEps, qk_normed);
        be->copy_block(qk_normed, 0, 0, qkv, 0, part * H, T, H);
      }
    be->attention(qkv, lay, a, nullptr, nullptr);
    be->linear(a, Ly.o_w, &Ly.o_b, h, true);  // (lambda_1 folded in)
    norm(Ly.n2_w, Ly.n2_b, x);
    be->linear(x, Ly.fc1_w, &Ly.fc1_b, mlp32, false);
    be->bias_act(mlp32, nullptr, act, true, mlp);
    be->linear(mlp, Ly.fc2_w, &Ly.fc2_b, h, true);  // (lambda_2 folded in)
    be->check_finite(h, "vision layer " + std::to_string(l) + " output");
  }
  if (feature_layer == -1 && !final_w.empty()) be->layer_norm(h, final_w, &final_b, eps, h);
  return h;
}

}  // namespace kvlens
