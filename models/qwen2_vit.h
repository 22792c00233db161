// Qwen2-VL's vision tower (HF Qwen2VisionTransformerPretrainedModel): the patch embedding (a
// Conv3d over patch × patch pixels × temporal frames, as a matrix), `depth` pre-norm blocks
// (LayerNorm, attention over every patch of the image with the axial 2-D rope, quick-GELU MLP)
// and the merger: each run of spatial_merge_size² consecutive patches (one merge block, as the
// processor lists them) LayerNorm'd, side by side, through a GELU MLP into one token.
//
// Qwen2.5-VL's tower (Qwen2VitConfig::windowed): RMSNorm, a gated SiLU MLP, and attention within
// windows of window_size pixels in every block but the full-attention ones. As HF does it, the
// merge blocks are put in window order (windows row by row, a window's blocks row by row) before
// the first block, so each window is a run of rows, and the merger's tokens back in grid order.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/tensor.h"
#include "models/config.h"
#include "models/safetensors.h"

namespace kvlens {

struct Qwen2VitBlock {
  // fc1: the MLP's first matrix ([gate | up] for the gated MLP); n1_b, n2_b empty with RMSNorm.
  Buffer n1_w, n1_b, qkv_w, qkv_b, proj_w, proj_b, n2_w, n2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

// Qwen2.5-VL's windows over a rows × cols grid of merge blocks (HF get_vision_window_index): the
// blocks in window order (`order`, grid indices) and the blocks each window holds, in turn.
struct VisionWindows {
  std::vector<int> order, sizes;
};
VisionWindows vision_windows(int rows, int cols, int window_blocks);

struct Qwen2Vit {
  Qwen2VitConfig cfg;
  std::shared_ptr<Backend> be;
  Buffer patch_w;  // [embed][3 · temporal · patch · patch]
  std::vector<Qwen2VitBlock> blocks;
  Buffer ln_q_w, ln_q_b, m1_w, m1_b, m2_w, m2_b;  // the merger

  // prefix: e.g. "model.visual." or "visual.".
  static Qwen2Vit load(const WeightStore& ws, const std::string& prefix, const Qwen2VitConfig& cfg,
                       std::shared_ptr<Backend> be);
  // pixel_values [patches][3 · temporal · patch · patch] of a rows × cols patch grid (the
  // processor's order) → the image's tokens [patches / merge²][hidden], fp32.
  Buffer forward(const Tensor& pixel_values, int rows, int cols) const;
};

}  // namespace kvlens
