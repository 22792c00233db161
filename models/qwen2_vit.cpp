#include "models/qwen2_vit.h"

#include <cmath>

#include "core/errors.h"
#include "models/activations.h"
#include "models/clip.h"

namespace kvlens {

namespace {

constexpr float kNormEps = 1e-6f;  // the blocks' and the merger's LayerNorm(eps=1e-6)

}  // namespace

Qwen2Vit Qwen2Vit::load(const WeightStore& ws, const std::string& p, const Qwen2VitConfig& cfg, std::shared_ptr<Backend> be) {
  Qwen2Vit m;
  m.cfg = cfg;
  m.be = be;
  const int64_t E = cfg.embed_dim, I = static_cast<int64_t>(cfg.embed_dim) * cfg.mlp_ratio, P = cfg.patch_size,
                Tp = cfg.temporal_patch_size, M2 = static_cast<int64_t>(cfg.spatial_merge_size) * cfg.spatial_merge_size,
                H = cfg.hidden_size;
  HostTensor patch = ws.host(p + "patch_embed.proj.weight", {E, cfg.in_channels, Tp, P, P});
  patch.shape = {E, cfg.in_channels * Tp * P * P};
  m.patch_w = be->matrix("vision.patch_embed", {patch});
  for (int l = 0; l < cfg.depth; ++l) {
    const std::string q = p + "blocks." + std::to_string(l) + ".", n = "vision.b" + std::to_string(l) + ".";
    Qwen2VitBlock B;
    B.n1_w = be->vector(ws.host(q + "norm1.weight", {E}));
    B.n1_b = be->vector(ws.host(q + "norm1.bias", {E}));
    B.qkv_w = be->matrix(n + "qkv", {ws.host(q + "attn.qkv.weight", {3 * E, E})});
    B.qkv_b = be->vector(ws.host(q + "attn.qkv.bias", {3 * E}));
    B.proj_w = be->matrix(n + "proj", {ws.host(q + "attn.proj.weight", {E, E})});
    B.proj_b = be->vector(ws.host(q + "attn.proj.bias", {E}));
    B.n2_w = be->vector(ws.host(q + "norm2.weight", {E}));
    B.n2_b = be->vector(ws.host(q + "norm2.bias", {E}));
    B.fc1_w = be->matrix(n + "fc1", {ws.host(q + "mlp.fc1.weight", {I, E})});
    B.fc1_b = be->vector(ws.host(q + "mlp.fc1.bias", {I}));
    B.fc2_w = be->matrix(n + "fc2", {ws.host(q + "mlp.fc2.weight", {E, I})});
    B.fc2_b = be->vector(ws.host(q + "mlp.fc2.bias", {E}));
    m.blocks.push_back(std::move(B));
    ws.release();
  }
  m.ln_q_w = be->vector(ws.host(p + "merger.ln_q.weight", {E}));
  m.ln_q_b = be->vector(ws.host(p + "merger.ln_q.bias", {E}));
  m.m1_w = be->matrix("vision.merger.fc1", {ws.host(p + "merger.mlp.0.weight", {M2 * E, M2 * E})});
  m.m1_b = be->vector(ws.host(p + "merger.mlp.0.bias", {M2 * E}));
  m.m2_w = be->matrix("vision.merger.fc2", {ws.host(p + "merger.mlp.2.weight", {H, M2 * E})});
  m.m2_b = be->vector(ws.host(p + "merger.mlp.2.bias", {H}));
  activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  return m;
}

Buffer Qwen2Vit::forward(const Tensor& px, int rows, int cols) const {
  const int M = cfg.spatial_merge_size, E = cfg.embed_dim, NH = cfg.num_heads, D = cfg.head_dim();
  const int64_t I = static_cast<int64_t>(E) * cfg.mlp_ratio, per = patch_w.shape.at(1);
  const int N = rows * cols;
  if (rows % M || cols % M || px.shape != std::vector<int64_t>{N, per})
    throw InputError("pixel_values has shape " + px.shape_str() + "; a " + std::to_string(rows) + "x" + std::to_string(cols) +
                     " patch grid needs [" + std::to_string(N) + "," + std::to_string(per) + "] with both sides multiples of " +
                     std::to_string(M));
  const Act act = activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  const Dt mdt = patch_w.dt;
  Buffer patches = be->alloc("vision.patches", {N, per}, mdt);
  be->upload(px.data.data(), patches);
  Buffer h = be->alloc("vision.h", {N, E}, Dt::F32);
  be->linear(patches, patch_w, nullptr, h, false);
  // The axial rope's positions: row 0 each patch's grid row, row 1 its column (merge blocks in turn).
  std::vector<int32_t> pos(2 * static_cast<size_t>(N));
  int n = 0;
  for (int bh = 0; bh < rows / M; ++bh)
    for (int bw = 0; bw < cols / M; ++bw)
      for (int mh = 0; mh < M; ++mh)
        for (int mw = 0; mw < M; ++mw, ++n) {
          pos[static_cast<size_t>(n)] = bh * M + mh;
          pos[static_cast<size_t>(N + n)] = bw * M + mw;
        }
  Buffer posb = be->alloc("vision.rope_positions", {2, N}, Dt::I32);
  be->upload(pos.data(), posb);
  Rope rope(cfg.rope_theta);
  rope.type = "axial";
  rope.sections = {D / 4, D / 4};
  const AttnLayout lay = vision_attention_layout(N, NH, D);
  Buffer x = be->alloc("vision.x", {N, E}, mdt);
  Buffer qkv = be->alloc("vision.qkv", {N, 3 * E}, Dt::F32);
  Buffer a = be->alloc("vision.attn_out", {N, E}, mdt);
  Buffer mlp32 = be->alloc("vision.fc1", {N, I}, Dt::F32);
  Buffer mlp = be->alloc("vision.fc1_act", {N, I}, mdt);
  for (size_t l = 0; l < blocks.size(); ++l) {
    const Qwen2VitBlock& B = blocks[l];
    be->layer_norm(h, B.n1_w, &B.n1_b, kNormEps, x);
    be->linear(x, B.qkv_w, &B.qkv_b, qkv, false);
    be->rope(qkv, lay, posb, rope);
    be->attention(qkv, lay, a, nullptr, nullptr);
    be->linear(a, B.proj_w, &B.proj_b, h, true);
    be->layer_norm(h, B.n2_w, &B.n2_b, kNormEps, x);
    be->linear(x, B.fc1_w, &B.fc1_b, mlp32, false);
    be->bias_act(mlp32, nullptr, act, true, mlp);
    be->linear(mlp, B.fc2_w, &B.fc2_b, h, true);
    be->check_finite(h, "vision block " + std::to_string(l) + " output");
  }
  // The merger: a merge block's patches are consecutive rows, so [N][E] read as [N / M²][M² · E].
  const int64_t T = N / (M * M), W = static_cast<int64_t>(M) * M * E;
  Buffer q = be->alloc("vision.merger.ln", {N, E}, mdt);
  be->layer_norm(h, ln_q_w, &ln_q_b, kNormEps, q);
  Buffer qm = q;
  qm.shape = {T, W};
  Buffer mid = be->alloc("vision.merger.mid", {T, W}, Dt::F32);
  be->linear(qm, m1_w, &m1_b, mid, false);
  Buffer mida = be->alloc("vision.merger.mid_act", {T, W}, mdt);
  be->bias_act(mid, nullptr, Act::Gelu, true, mida);
  Buffer out = be->alloc("vision.merger.out", {T, static_cast<int64_t>(cfg.hidden_size)}, Dt::F32);
  be->linear(mida, m2_w, &m2_b, out, false);
  return out;
}

}  // namespace kvlens
