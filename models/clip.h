// CLIP vision transformer (HF CLIPVisionModel): class + patch + position embeddings,
// pre_layrnorm, pre-LN encoder layers. Produces the hidden states LLaVA selects features from.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"
#include "models/config.h"
#include "models/safetensors.h"

namespace kvlens {

struct ClipLayer {
  Tensor ln1_w, ln1_b, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

struct ClipVision {
  ClipVisionConfig cfg;
  Tensor class_embedding, patch_embedding, position_embedding, pre_ln_w, pre_ln_b;
  std::vector<ClipLayer> layers;  // only the layers LLaVA's feature selection needs

  // prefix: e.g. "vision_tower.vision_model."
  static ClipVision load(const WeightStore& ws, const std::string& prefix, const ClipVisionConfig& cfg,
                         int n_layers);
  // pixel_values [3][S][S] → hidden states at each requested index (0 = embeddings after
  // pre_layrnorm), each [n_patches + 1][hidden].
  std::vector<Tensor> forward(const Tensor& pixel_values, const std::vector<int>& state_indices) const;
};

}  // namespace kvlens
