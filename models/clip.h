// CLIP vision transformer (HF CLIPVisionModel): class + patch + position embeddings,
// pre_layrnorm, pre-LN encoder layers, built on the backend interface. Produces the hidden
// states LLaVA selects features from.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/tensor.h"
#include "models/config.h"
#include "models/safetensors.h"

namespace kvlens {

// The S × S image's P × P patches as the rows of an im2col matrix [patches][3·P·P], each in
// (channel, y, x) order as a conv weight [hidden][3][P][P] lays its rows: a patch embedding is
// then one matrix product (CLIP, InternViT).
std::vector<float> patch_columns(const Tensor& pixel_values, int S, int P);
// A vision tower's attention: T tokens, every one seeing every other, q | k | v of `heads` heads
// side by side in each row of the fused projection.
AttnLayout vision_attention_layout(int T, int heads, int head_dim);

struct ClipLayer {
  Buffer ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

struct ClipVision {
  ClipVisionConfig cfg;
  std::shared_ptr<Backend> be;
  Buffer class_embedding;     // fp32 [1][hidden]
  Buffer patch_embedding;     // [hidden][3·P·P] (the conv weight [hidden][3][P][P] as rows)
  Buffer position_embedding;  // fp32 [n_patches + 1][hidden]
  Buffer pre_ln_w, pre_ln_b;
  std::vector<ClipLayer> layers;  // only the layers LLaVA's feature selection needs

  // prefix: e.g. "vision_tower.vision_model."
  static ClipVision load(const WeightStore& ws, const std::string& prefix, const ClipVisionConfig& cfg,
                         int n_layers, std::shared_ptr<Backend> be);
  // pixel_values [3][S][S] → hidden states at each requested index (0 = embeddings after
  // pre_layrnorm), each fp32 [n_patches + 1][hidden] in the backend's memory.
  std::vector<Buffer> forward(const Tensor& pixel_values, const std::vector<int>& state_indices) const;
};

}  // namespace kvlens
