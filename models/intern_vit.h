// InternViT (HF InternVLVisionModel): a class token and patch embeddings with absolute positions,
// pre-norm layers (LayerNorm or RMSNorm) with optional q/k biases and q/k RMSNorm, layer scale
// (lambda_1, lambda_2, folded into the output projections when loaded), and a final LayerNorm
// unless the model mean-pools. InternVL reads one of its hidden states for the pixel shuffle.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/tensor.h"
#include "models/config.h"
#include "models/safetensors.h"

namespace kvlens {

struct InternVitLayer {
  Buffer n1_w, n1_b, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, n2_w, n2_b, fc1_w, fc1_b, fc2_w, fc2_b;
};

struct InternVit {
  InternVitConfig cfg;
  std::shared_ptr<Backend> be;
  Buffer cls_token;        // fp32 [1][hidden]
  Buffer patch_w, patch_b;  // [hidden][3·P·P] (the conv weight as rows), [hidden]
  Buffer position;         // fp32 [patches + 1][hidden] (empty without absolute positions)
  Buffer final_w, final_b;  // the final LayerNorm (empty when the model mean-pools)
  std::vector<InternVitLayer> layers;

  // prefix: e.g. "vision_tower."; layers: how many to load (those the feature layer needs).
  static InternVit load(const WeightStore& ws, const std::string& prefix, const InternVitConfig& cfg, int layers,
                        std::shared_ptr<Backend> be);
  // pixel_values [3][S][S] → the hidden state HF's vision_feature_layer names ([patches + 1][hidden],
  // fp32): -1 the last one after the final norm, k ≥ 0 the k-th of hidden_states (0: embeddings).
  Buffer forward(const Tensor& pixel_values, int feature_layer) const;
};

}  // namespace kvlens
