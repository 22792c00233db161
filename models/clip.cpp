#include "models/clip.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"
#include "models/activations.h"

namespace kvlens {

ClipVision ClipVision::load(const WeightStore& ws, const std::string& p, const ClipVisionConfig& cfg,
                            int n_layers, std::shared_ptr<Backend> be) {
  ClipVision m;
  m.cfg = cfg;
  m.be = be;
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, P = cfg.patch_size;
  HostTensor cls = ws.host(p + "embeddings.class_embedding", {H});
  cls.shape = {1, H};
  m.class_embedding = be->vector(cls);
  HostTensor patch = ws.host(p + "embeddings.patch_embedding.weight", {H, 3, P, P});
  patch.shape = {H, 3 * P * P};
  m.patch_embedding = be->matrix("vision.patch_embedding", {patch});
  m.position_embedding = be->vector(ws.host(p + "embeddings.position_embedding.weight", {cfg.n_patches() + 1, H}));
  m.pre_ln_w = be->vector(ws.host(p + "pre_layrnorm.weight", {H}));
  m.pre_ln_b = be->vector(ws.host(p + "pre_layrnorm.bias", {H}));
  for (int l = 0; l < n_layers; ++l) {
    const std::string q = p + "encoder.layers." + std::to_string(l) + ".";
    const std::string n = "vision.l" + std::to_string(l) + ".";
    ClipLayer L;
    L.ln1_w = be->vector(ws.host(q + "layer_norm1.weight", {H}));
    L.ln1_b = be->vector(ws.host(q + "layer_norm1.bias", {H}));
    L.qkv_w = be->matrix(n + "qkv", {ws.host(q + "self_attn.q_proj.weight", {H, H}),
                                     ws.host(q + "self_attn.k_proj.weight", {H, H}),
                                     ws.host(q + "self_attn.v_proj.weight", {H, H})});
    std::vector<float> b;
    for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
      const Buffer part = be->vector(ws.host(q + "self_attn." + name + ".bias", {H}));
      std::vector<float> host(static_cast<size_t>(H));
      be->download(part, host.data());
      b.insert(b.end(), host.begin(), host.end());
    }
    L.qkv_b = be->vector({n + "qkv_bias", Dt::F32, {3 * H}, b.data()});
    L.o_w = be->matrix(n + "o", {ws.host(q + "self_attn.out_proj.weight", {H, H})});
    L.o_b = be->vector(ws.host(q + "self_attn.out_proj.bias", {H}));
    L.ln2_w = be->vector(ws.host(q + "layer_norm2.weight", {H}));
    L.ln2_b = be->vector(ws.host(q + "layer_norm2.bias", {H}));
    L.fc1_w = be->matrix(n + "fc1", {ws.host(q + "mlp.fc1.weight", {I, H})});
    L.fc1_b = be->vector(ws.host(q + "mlp.fc1.bias", {I}));
    L.fc2_w = be->matrix(n + "fc2", {ws.host(q + "mlp.fc2.weight", {H, I})});
    L.fc2_b = be->vector(ws.host(q + "mlp.fc2.bias", {H}));
    m.layers.push_back(std::move(L));
    ws.release();  // the layer is in the backend's memory: its mapped pages go back
  }
  activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  return m;
}

std::vector<float> patch_columns(const Tensor& px, int S, int P) {
  const int G = S / P;
  std::vector<float> cols(static_cast<size_t>(G) * G * 3 * P * P);
  for (int gy = 0; gy < G; ++gy)
    for (int gx = 0; gx < G; ++gx) {
      float* r = cols.data() + static_cast<size_t>(gy * G + gx) * 3 * P * P;
      for (int c = 0; c < 3; ++c)
        for (int y = 0; y < P; ++y)
          for (int x = 0; x < P; ++x) *r++ = px.data[(static_cast<size_t>(c) * S + gy * P + y) * S + gx * P + x];
    }
  return cols;
}

AttnLayout vision_attention_layout(int T, int heads, int head_dim) {
  AttnLayout lay;
  lay.T = T;
  lay.n_heads = lay.n_kv_heads = heads;
  lay.head_dim = head_dim;
  const int H = heads * head_dim;
  lay.row_stride = 3 * H;
  lay.q_col = 0;
  lay.k_col = H;
  lay.v_col = 2 * H;
  lay.causal = false;
  lay.scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  return lay;
}

std::vector<Buffer> ClipVision::forward(const Tensor& px, const std::vector<int>& state_indices) const {
  const int S = cfg.image_size, P = cfg.patch_size, G = S / P, N = G * G, T = N + 1;
  const int H = cfg.hidden_size, I = cfg.intermediate_size, NH = cfg.num_attention_heads, D = H / NH;
  if (px.shape != std::vector<int64_t>{3, S, S})
    throw InputError("pixel_values has shape " + px.shape_str() + ", the vision tower needs [3," +
                     std::to_string(S) + "," + std::to_string(S) + "]");
  const Act act = activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  const Dt mdt = patch_embedding.dt;
  const float eps = static_cast<float>(cfg.layer_norm_eps);
  // Patch embedding as im2col + matrix product; the columns are built on the host (the
  // hand-off of the preprocessed image) and uploaded once.
  const std::vector<float> cols = patch_columns(px, S, P);
  Buffer colsb = be->alloc("vision.patches", {N, 3 * P * P}, mdt);
  be->upload(cols.data(), colsb);
  Buffer pe = be->alloc("vision.patch_embeds", {N, H}, Dt::F32);
  be->linear(colsb, patch_embedding, nullptr, pe, false);
  Buffer h = be->alloc("vision.h", {T, H}, Dt::F32);
  be->copy_block(class_embedding, 0, 0, h, 0, 0, 1, H);
  be->copy_block(pe, 0, 0, h, 1, 0, N, H);
  be->add(h, position_embedding);
  be->layer_norm(h, pre_ln_w, &pre_ln_b, eps, h);

  std::vector<Buffer> out(state_indices.size());
  auto capture = [&](int idx) {
    for (size_t i = 0; i < state_indices.size(); ++i)
      if (state_indices[i] == idx) {
        out[i] = be->alloc("vision.hidden_states." + std::to_string(idx), {T, H}, Dt::F32);
        be->copy_block(h, 0, 0, out[i], 0, 0, T, H);
      }
  };
  be->check_finite(h, "vision embeddings (after pre_layrnorm)");
  capture(0);
  const int last = *std::max_element(state_indices.begin(), state_indices.end());
  const AttnLayout lay = vision_attention_layout(T, NH, D);
  Buffer x = be->alloc("vision.x", {T, H}, mdt);
  Buffer qkv = be->alloc("vision.qkv", {T, 3 * H}, Dt::F32);
  Buffer a = be->alloc("vision.attn_out", {T, H}, mdt);
  Buffer mlp32 = be->alloc("vision.fc1", {T, I}, Dt::F32);
  Buffer mlp = be->alloc("vision.fc1_act", {T, I}, mdt);
  for (int l = 0; l < last; ++l) {
    const ClipLayer& L = layers.at(l);
    be->layer_norm(h, L.ln1_w, &L.ln1_b, eps, x);
    be->linear(x, L.qkv_w, &L.qkv_b, qkv, false);
    be->attention(qkv, lay, a, nullptr, nullptr);
    be->linear(a, L.o_w, &L.o_b, h, true);
    be->layer_norm(h, L.ln2_w, &L.ln2_b, eps, x);
    be->linear(x, L.fc1_w, &L.fc1_b, mlp32, false);
    be->bias_act(mlp32, nullptr, act, true, mlp);
    be->linear(mlp, L.fc2_w, &L.fc2_b, h, true);
    be->check_finite(h, "vision layer " + std::to_string(l) + " output");
    capture(l + 1);
  }
  return out;
}

}  // namespace kvlens
