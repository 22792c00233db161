#include "models/qwen2_vit.h"

#include <algorithm>
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
  const int64_t E = cfg.embed_dim, I = cfg.intermediate_size, P = cfg.patch_size,
                Tp = cfg.temporal_patch_size, M2 = static_cast<int64_t>(cfg.spatial_merge_size) * cfg.spatial_merge_size,
                H = cfg.hidden_size;
  HostTensor patch = ws.host(p + "patch_embed.proj.weight", {E, cfg.in_channels, Tp, P, P});
  patch.shape = {E, cfg.in_channels * Tp * P * P};
  m.patch_w = be->matrix("vision.patch_embed", {patch});
  const bool rms = cfg.windowed;  // Qwen2.5-VL: RMSNorm (no bias), the gated MLP
  for (int l = 0; l < cfg.depth; ++l) {
    const std::string q = p + "blocks." + std::to_string(l) + ".", n = "vision.b" + std::to_string(l) + ".";
    Qwen2VitBlock B;
    B.n1_w = be->vector(ws.host(q + "norm1.weight", {E}));
    if (!rms) B.n1_b = be->vector(ws.host(q + "norm1.bias", {E}));
    B.qkv_w = be->matrix(n + "qkv", {ws.host(q + "attn.qkv.weight", {3 * E, E})});
    B.qkv_b = be->vector(ws.host(q + "attn.qkv.bias", {3 * E}));
    B.proj_w = be->matrix(n + "proj", {ws.host(q + "attn.proj.weight", {E, E})});
    B.proj_b = be->vector(ws.host(q + "attn.proj.bias", {E}));
    B.n2_w = be->vector(ws.host(q + "norm2.weight", {E}));
    if (!rms) B.n2_b = be->vector(ws.host(q + "norm2.bias", {E}));
    if (rms) {
      B.fc1_w = be->matrix(n + "gate_up", {ws.host(q + "mlp.gate_proj.weight", {I, E}), ws.host(q + "mlp.up_proj.weight", {I, E})});
      const Tensor gb = ws.load(q + "mlp.gate_proj.bias", {I}), ub = ws.load(q + "mlp.up_proj.bias", {I});
      std::vector<float> b(gb.data);
      b.insert(b.end(), ub.data.begin(), ub.data.end());
      B.fc1_b = be->vector({n + "gate_up_bias", Dt::F32, {2 * I}, b.data()});
      B.fc2_w = be->matrix(n + "down", {ws.host(q + "mlp.down_proj.weight", {E, I})});
      B.fc2_b = be->vector(ws.host(q + "mlp.down_proj.bias", {E}));
    } else {
      B.fc1_w = be->matrix(n + "fc1", {ws.host(q + "mlp.fc1.weight", {I, E})});
      B.fc1_b = be->vector(ws.host(q + "mlp.fc1.bias", {I}));
      B.fc2_w = be->matrix(n + "fc2", {ws.host(q + "mlp.fc2.weight", {E, I})});
      B.fc2_b = be->vector(ws.host(q + "mlp.fc2.bias", {E}));
    }
    m.blocks.push_back(std::move(B));
    ws.release();
  }
  m.ln_q_w = be->vector(ws.host(p + "merger.ln_q.weight", {E}));
  if (!rms) m.ln_q_b = be->vector(ws.host(p + "merger.ln_q.bias", {E}));
  m.m1_w = be->matrix("vision.merger.fc1", {ws.host(p + "merger.mlp.0.weight", {M2 * E, M2 * E})});
  m.m1_b = be->vector(ws.host(p + "merger.mlp.0.bias", {M2 * E}));
  m.m2_w = be->matrix("vision.merger.fc2", {ws.host(p + "merger.mlp.2.weight", {H, M2 * E})});
  m.m2_b = be->vector(ws.host(p + "merger.mlp.2.bias", {H}));
  activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  return m;
}

VisionWindows vision_windows(int rows, int cols, int w) {
  VisionWindows v;
  for (int wr = 0; wr * w < rows; ++wr)
    for (int wc = 0; wc * w < cols; ++wc) {
      int n = 0;
      for (int r = wr * w; r < std::min(rows, (wr + 1) * w); ++r)
        for (int c = wc * w; c < std::min(cols, (wc + 1) * w); ++c, ++n) v.order.push_back(r * cols + c);
      v.sizes.push_back(n);
    }
  return v;
}

Buffer Qwen2Vit::forward(const Tensor& px, int rows, int cols) const {
  const int M = cfg.spatial_merge_size, M2 = M * M, E = cfg.embed_dim, NH = cfg.num_heads, D = cfg.head_dim();
  const int64_t I = cfg.intermediate_size, per = patch_w.shape.at(1);
  const int N = rows * cols;
  if (rows % M || cols % M || px.shape != std::vector<int64_t>{N, per})
    throw InputError("pixel_values has shape " + px.shape_str() + "; a " + std::to_string(rows) + "x" + std::to_string(cols) +
                     " patch grid needs [" + std::to_string(N) + "," + std::to_string(per) + "] with both sides multiples of " +
                     std::to_string(M));
  const Act act = activation_from_name(cfg.hidden_act, "vision_config.hidden_act");
  const Dt mdt = patch_w.dt;
  const bool rms = cfg.windowed;
  // The merge blocks in the order the blocks see them: the processor's (grid order), or by window.
  const int BR = rows / M, BC = cols / M;
  VisionWindows win;
  if (cfg.windowed) {
    win = vision_windows(BR, BC, cfg.window_size / (M * cfg.patch_size));
  } else {
    win.order.resize(static_cast<size_t>(BR) * BC);
    for (size_t i = 0; i < win.order.size(); ++i) win.order[i] = static_cast<int>(i);
    win.sizes = {BR * BC};
  }
  // The patches in that order (the processor's own without windows), and the axial rope's
  // positions: row 0 each patch's grid row, row 1 its column.
  std::vector<float> reordered(cfg.windowed ? static_cast<size_t>(N) * per : 0);
  std::vector<int32_t> pos(2 * static_cast<size_t>(N));
  for (int k = 0; k < BR * BC; ++k) {
    const int b = win.order[static_cast<size_t>(k)], bh = b / BC, bw = b % BC;
    if (cfg.windowed)
      std::copy_n(px.data.data() + static_cast<size_t>(b) * M2 * per, static_cast<size_t>(M2) * per,
                  reordered.data() + static_cast<size_t>(k) * M2 * per);
    for (int j = 0; j < M2; ++j) {
      pos[static_cast<size_t>(k * M2 + j)] = bh * M + j / M;
      pos[static_cast<size_t>(N + k * M2 + j)] = bw * M + j % M;
    }
  }
  Buffer patches = be->alloc("vision.patches", {N, per}, mdt);
  be->upload(cfg.windowed ? reordered.data() : px.data.data(), patches);
  Buffer h = be->alloc("vision.h", {N, E}, Dt::F32);
  be->linear(patches, patch_w, nullptr, h, false);
  Buffer posb = be->alloc("vision.rope_positions", {2, N}, Dt::I32);
  be->upload(pos.data(), posb);
  Rope rope(cfg.rope_theta);
  rope.type = "axial";
  rope.sections = {D / 4, D / 4};
  const AttnLayout lay = vision_attention_layout(N, NH, D);
  Buffer x = be->alloc("vision.x", {N, E}, mdt);
  Buffer qkv = be->alloc("vision.qkv", {N, 3 * E}, Dt::F32);
  Buffer a = be->alloc("vision.attn_out", {N, E}, mdt);
  Buffer mlp32 = be->alloc("vision.fc1", {N, rms ? 2 * I : I}, Dt::F32);
  Buffer mlp = be->alloc("vision.fc1_act", {N, I}, mdt);
  auto norm = [&](const Buffer& w, const Buffer& b, Buffer& out) {
    if (rms) be->rms_norm(h, w, kNormEps, out);
    else be->layer_norm(h, w, &b, kNormEps, out);
  };
  for (size_t l = 0; l < blocks.size(); ++l) {
    const Qwen2VitBlock& B = blocks[l];
    norm(B.n1_w, B.n1_b, x);
    be->linear(x, B.qkv_w, &B.qkv_b, qkv, false);
    be->rope(qkv, lay, posb, rope);
    const bool full = !cfg.windowed || std::find(cfg.full_attention_blocks.begin(), cfg.full_attention_blocks.end(),
                                                 static_cast<int>(l)) != cfg.full_attention_blocks.end();
    if (full) {
      be->attention(qkv, lay, a, nullptr, nullptr);
    } else {  // each window's rows among themselves
      int64_t r0 = 0;
      for (int n : win.sizes) {
        const int64_t len = static_cast<int64_t>(n) * M2;
        Buffer aw = a.row_view(r0, len);
        be->attention(qkv.row_view(r0, len), vision_attention_layout(static_cast<int>(len), NH, D), aw, nullptr, nullptr);
        r0 += len;
      }
    }
    be->linear(a, B.proj_w, &B.proj_b, h, true);
    norm(B.n2_w, B.n2_b, x);
    be->linear(x, B.fc1_w, &B.fc1_b, mlp32, false);
    if (rms) be->gated_act(mlp32, act, mlp);
    else be->bias_act(mlp32, nullptr, act, true, mlp);
    be->linear(mlp, B.fc2_w, &B.fc2_b, h, true);
    be->check_finite(h, "vision block " + std::to_string(l) + " output");
  }
  // The merger: a merge block's patches are consecutive rows, so [N][E] read as [N / M²][M² · E].
  const int64_t T = N / M2, W = static_cast<int64_t>(M2) * E, HO = cfg.hidden_size;
  Buffer q = be->alloc("vision.merger.ln", {N, E}, mdt);
  norm(ln_q_w, ln_q_b, q);
  Buffer qm = q;
  qm.shape = {T, W};
  Buffer mid = be->alloc("vision.merger.mid", {T, W}, Dt::F32);
  be->linear(qm, m1_w, &m1_b, mid, false);
  Buffer mida = be->alloc("vision.merger.mid_act", {T, W}, mdt);
  be->bias_act(mid, nullptr, Act::Gelu, true, mida);
  Buffer out = be->alloc("vision.merger.out", {T, HO}, Dt::F32);
  be->linear(mida, m2_w, &m2_b, out, false);
  if (!cfg.windowed) return out;
  // Back to grid order: a window's blocks of one grid row are consecutive there too.
  Buffer grid = be->alloc("vision.merger.grid_order", {T, HO}, Dt::F32);
  for (int64_t k = 0; k < T;) {
    int64_t n = 1;
    while (k + n < T && win.order[static_cast<size_t>(k + n)] == win.order[static_cast<size_t>(k)] + n &&
           win.order[static_cast<size_t>(k)] / BC == win.order[static_cast<size_t>(k + n)] / BC)
      ++n;
    be->copy_block(out, k, 0, grid, win.order[static_cast<size_t>(k)], 0, n, HO);
    k += n;
  }
  return grid;
}

}  // namespace kvlens
