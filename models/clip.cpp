#include "models/clip.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"
#include "kernels/cpu/ops.h"
#include "models/activations.h"

namespace kvlens {

ClipVision ClipVision::load(const WeightStore& ws, const std::string& p, const ClipVisionConfig& cfg,
                            int n_layers) {
  ClipVision m;
  m.cfg = cfg;
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, P = cfg.patch_size;
  m.class_embedding = ws.load(p + "embeddings.class_embedding", {H});
  m.patch_embedding = ws.load(p + "embeddings.patch_embedding.weight", {H, 3, P, P});
  m.position_embedding = ws.load(p + "embeddings.position_embedding.weight", {cfg.n_patches() + 1, H});
  m.pre_ln_w = ws.load(p + "pre_layrnorm.weight", {H});
  m.pre_ln_b = ws.load(p + "pre_layrnorm.bias", {H});
  for (int l = 0; l < n_layers; ++l) {
    const std::string q = p + "encoder.layers." + std::to_string(l) + ".";
    ClipLayer L;
    L.ln1_w = ws.load(q + "layer_norm1.weight", {H});
    L.ln1_b = ws.load(q + "layer_norm1.bias", {H});
    L.q_w = ws.load(q + "self_attn.q_proj.weight", {H, H});
    L.q_b = ws.load(q + "self_attn.q_proj.bias", {H});
    L.k_w = ws.load(q + "self_attn.k_proj.weight", {H, H});
    L.k_b = ws.load(q + "self_attn.k_proj.bias", {H});
    L.v_w = ws.load(q + "self_attn.v_proj.weight", {H, H});
    L.v_b = ws.load(q + "self_attn.v_proj.bias", {H});
    L.o_w = ws.load(q + "self_attn.out_proj.weight", {H, H});
    L.o_b = ws.load(q + "self_attn.out_proj.bias", {H});
    L.ln2_w = ws.load(q + "layer_norm2.weight", {H});
    L.ln2_b = ws.load(q + "layer_norm2.bias", {H});
    L.fc1_w = ws.load(q + "mlp.fc1.weight", {I, H});
    L.fc1_b = ws.load(q + "mlp.fc1.bias", {I});
    L.fc2_w = ws.load(q + "mlp.fc2.weight", {H, I});
    L.fc2_b = ws.load(q + "mlp.fc2.bias", {H});
    m.layers.push_back(std::move(L));
  }
  return m;
}

std::vector<Tensor> ClipVision::forward(const Tensor& px, const std::vector<int>& state_indices) const {
  const int S = cfg.image_size, P = cfg.patch_size, G = S / P, N = G * G, T = N + 1;
  const int H = cfg.hidden_size, I = cfg.intermediate_size, NH = cfg.num_attention_heads, D = H / NH;
  if (px.shape != std::vector<int64_t>{3, S, S})
    throw InputError("pixel_values has shape " + px.shape_str() + ", the vision tower needs [3," +
                     std::to_string(S) + "," + std::to_string(S) + "]");
  const cpu::Act act = activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  // Patch embedding as im2col + GEMM: row n holds patch n in (channel, y, x) order, matching
  // the conv weight layout [H][3][P][P].
  std::vector<float> cols(static_cast<size_t>(N) * 3 * P * P);
  for (int gy = 0; gy < G; ++gy)
    for (int gx = 0; gx < G; ++gx) {
      float* r = cols.data() + static_cast<size_t>(gy * G + gx) * 3 * P * P;
      for (int c = 0; c < 3; ++c)
        for (int y = 0; y < P; ++y)
          for (int x = 0; x < P; ++x)
            *r++ = px.data[(static_cast<size_t>(c) * S + gy * P + y) * S + gx * P + x];
    }
  Tensor h("vision.embeddings", {T, H});
  cpu::linear(cols.data(), N, 3 * P * P, patch_embedding.ptr(), H, nullptr, h.ptr() + H);
  std::copy(class_embedding.data.begin(), class_embedding.data.end(), h.data.begin());
  cpu::add(h.ptr(), position_embedding.ptr(), static_cast<int64_t>(T) * H);
  cpu::layer_norm(h.ptr(), h.ptr(), T, H, pre_ln_w.ptr(), pre_ln_b.ptr(), static_cast<float>(cfg.layer_norm_eps));

  std::vector<Tensor> out(state_indices.size());
  auto capture = [&](int idx) {
    for (size_t i = 0; i < state_indices.size(); ++i)
      if (state_indices[i] == idx) {
        out[i] = h;
        out[i].name = "vision.hidden_states." + std::to_string(idx);
      }
  };
  check_finite(h.ptr(), static_cast<int64_t>(T) * H, "vision embeddings (after pre_layrnorm)");
  capture(0);
  const int last = *std::max_element(state_indices.begin(), state_indices.end());
  std::vector<float> x(static_cast<size_t>(T) * H), q(x.size()), k(x.size()), v(x.size()), a(x.size()),
      mlp(static_cast<size_t>(T) * I);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int l = 0; l < last; ++l) {
    const ClipLayer& L = layers.at(l);
    cpu::layer_norm(h.ptr(), x.data(), T, H, L.ln1_w.ptr(), L.ln1_b.ptr(), static_cast<float>(cfg.layer_norm_eps));
    cpu::linear(x.data(), T, H, L.q_w.ptr(), H, L.q_b.ptr(), q.data());
    cpu::linear(x.data(), T, H, L.k_w.ptr(), H, L.k_b.ptr(), k.data());
    cpu::linear(x.data(), T, H, L.v_w.ptr(), H, L.v_b.ptr(), v.data());
#pragma omp parallel for if (cpu::parallel_heads(NH, T, T, D))
    for (int hd = 0; hd < NH; ++hd) {
      cpu::AttnHeadArgs args;
      args.q = q.data() + hd * D; args.q_stride = H;
      args.k = k.data() + hd * D; args.v = v.data() + hd * D; args.kv_stride = H;
      args.out = a.data() + hd * D; args.o_stride = H;
      args.Tq = T; args.Tk = T; args.D = D; args.scale = scale;
      cpu::attention_head(args);
    }
    cpu::linear(a.data(), T, H, L.o_w.ptr(), H, L.o_b.ptr(), x.data());
    cpu::add(h.ptr(), x.data(), static_cast<int64_t>(T) * H);
    cpu::layer_norm(h.ptr(), x.data(), T, H, L.ln2_w.ptr(), L.ln2_b.ptr(), static_cast<float>(cfg.layer_norm_eps));
    cpu::linear(x.data(), T, H, L.fc1_w.ptr(), I, L.fc1_b.ptr(), mlp.data());
    cpu::activate(mlp.data(), static_cast<int64_t>(T) * I, act);
    cpu::linear(mlp.data(), T, I, L.fc2_w.ptr(), H, L.fc2_b.ptr(), x.data());
    cpu::add(h.ptr(), x.data(), static_cast<int64_t>(T) * H);
    check_finite(h.ptr(), static_cast<int64_t>(T) * H, "vision layer " + std::to_string(l) + " output");
    capture(l + 1);
  }
  return out;
}

}  // namespace kvlens
