// LLaVA-1.5 / LLaVA-NeXT checkpoint configuration (config.json of model_type "llava" or
// "llava_next"): a CLIP vision tower,
// a 2-layer projector and a Llama decoder; and a text-only decoder's (model_type "llama" or
// "mistral"). Missing keys take HF transformers' defaults for CLIPVisionConfig / LlamaConfig /
// MistralConfig / LlavaConfig.
#pragma once
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/rope.h"

namespace kvlens {

struct ClipVisionConfig {
  int hidden_size = 768;
  int intermediate_size = 3072;
  int num_hidden_layers = 12;
  int num_attention_heads = 12;
  int num_channels = 3;
  int image_size = 224;
  int patch_size = 32;
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;
  int head_dim() const { return hidden_size / num_attention_heads; }
  int n_patches() const { return (image_size / patch_size) * (image_size / patch_size); }
};

struct LlamaConfig {
  std::string model_type = "llama";  // "llama", "mistral" or "qwen2" (their configs' defaults)
  int vocab_size = 32000;
  int hidden_size = 4096;
  int intermediate_size = 11008;
  int num_hidden_layers = 32;
  int num_attention_heads = 32;
  int num_key_value_heads = 32;
  int head_dim = 128;
  std::string hidden_act = "silu";
  int max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  Rope rope;  // rope_theta and the rope_parameters / rope_scaling kvlens reads (default, llama3)
  bool qkv_bias = false, o_bias = false;  // attention_bias sets both; Qwen2 has the first alone
  bool mlp_bias = false;
  bool tie_word_embeddings = false;
  int bos_token_id = 1;
  std::vector<int> eos_token_ids{2};
  // Mistral's sliding_window (0: none). kvlens attends over every cached row, so a context
  // stops at the window: within it the window changes nothing.
  int sliding_window = 0;
  // Positions a sequence may hold: max_position_embeddings, or the sliding window when smaller.
  int max_context() const { return sliding_window > 0 ? std::min(sliding_window, max_position_embeddings) : max_position_embeddings; }
};

struct LlavaConfig {
  std::string model_type = "llava";  // or "llava_next" (anyres tiling, HF LlavaNextForConditionalGeneration)
  ClipVisionConfig vision;
  LlamaConfig text;
  int image_token_index = 32000;
  std::string projector_hidden_act = "gelu";
  bool multimodal_projector_bias = true;
  std::vector<int> vision_feature_layers{-2};  // one or more; negative = from the end
  std::string vision_feature_select_strategy = "default";  // "default" drops CLS, or "full"
  bool tie_word_embeddings = false;
  // LLaVA-NeXT: the (height, width) resolutions an image may be tiled to, each a whole number of
  // vision_config.image_size tiles (image_grid_pinpoints).
  std::vector<std::array<int, 2>> grid_pinpoints;

  bool anyres() const { return model_type == "llava_next"; }
  // Image tokens per image, from the vision config: patches, plus CLS with "full".
  int n_visual_tokens() const;
  // hidden_states index (0 = embeddings after pre_layrnorm) of each feature layer, and the
  // number of encoder layers that must run to produce them.
  std::vector<int> feature_layer_indices() const;
  int encoder_layers_needed() const;
};

// InternViT (HF InternVLVisionConfig, model_type internvl_vision).
struct InternVitConfig {
  int hidden_size = 1024, intermediate_size = 4096, num_hidden_layers = 24, num_attention_heads = 16;
  int image_size = 448, patch_size = 14;
  std::string hidden_act = "gelu";
  std::string norm_type = "layer_norm";  // or "rms_norm"
  double layer_norm_eps = 1e-6;
  bool attention_bias = false, use_qk_norm = false, use_mean_pooling = true, use_absolute_position_embeddings = true;
  int grid() const { return image_size / patch_size; }
};

// InternVL (HF InternVLForConditionalGeneration, model_type internvl): InternViT, pixel shuffle,
// an MLP projector with a LayerNorm, a Qwen2 (or Llama) decoder.
struct InternVLConfig {
  InternVitConfig vision;
  LlamaConfig text;
  int image_token_id = 151667;  // <IMG_CONTEXT>
  double downsample_ratio = 0.5;
  std::string projector_hidden_act = "gelu";
  int vision_feature_layer = -1;  // -1: the tower's last hidden state, after its final norm
  bool tie_word_embeddings = true;
  int shuffled_grid() const { return vision.grid() / 2; }  // tokens per tile side after the pixel shuffle
  int tokens_per_tile() const { return shuffled_grid() * shuffled_grid(); }
};
InternVLConfig parse_internvl_config(const nlohmann::json& j, const std::string& where);

// Qwen2-VL's vision tower (HF Qwen2VLVisionConfig, model_type qwen2_vl_vision): patches of
// patch_size² pixels × temporal_patch_size frames, `depth` pre-norm blocks with the axial 2-D
// rope, and the merger of spatial_merge_size² patches into one token of the decoder's width.
//
// Qwen2.5-VL's (qwen2_5_vl_vision): RMSNorm, a gated MLP, and attention within windows of
// window_size pixels but in the full_attention_blocks (`windowed`).
struct Qwen2VitConfig {
  int depth = 32, embed_dim = 1280, hidden_size = 3584, mlp_ratio = 4, num_heads = 16, in_channels = 3;
  int intermediate_size = 5120;  // the MLP's width (Qwen2-VL: embed_dim · mlp_ratio)
  int patch_size = 14, spatial_merge_size = 2, temporal_patch_size = 2;
  std::string hidden_act = "quick_gelu";
  float rope_theta = 10000.0f;
  bool windowed = false;  // Qwen2.5-VL
  int window_size = 112;
  std::vector<int> full_attention_blocks{7, 15, 23, 31};
  int head_dim() const { return embed_dim / num_heads; }
};

// Qwen2-VL (HF Qwen2VLForConditionalGeneration, model_type qwen2_vl; Qwen2.5-VL, qwen2_5_vl): the vision tower, the
// Qwen2 decoder with M-RoPE (its rope's sections), the vision start / image pad / end tokens.
struct Qwen2VLConfig {
  Qwen2VitConfig vision;
  LlamaConfig text;
  int image_token_id = 151655, vision_start_token_id = 151652, vision_end_token_id = 151653;
  bool tie_word_embeddings = false;
};
Qwen2VLConfig parse_qwen2_vl_config(const nlohmann::json& j, const std::string& where);

LlavaConfig parse_llava_config(const nlohmann::json& j, const std::string& where);
// A list of [height, width] resolutions (LLaVA-NeXT's image_grid_pinpoints); `where` names it.
std::vector<std::array<int, 2>> parse_grid_pinpoints(const nlohmann::json& v, const std::string& where);
LlavaConfig load_llava_config(const std::string& path);
// A text-only decoder's config.json (model_type "llama" or "mistral", HF LlamaForCausalLM /
// MistralForCausalLM): the keys at the top level.
LlamaConfig parse_text_only_config(const nlohmann::json& j, const std::string& where);
LlamaConfig load_text_only_config(const std::string& path);

}  // namespace kvlens
