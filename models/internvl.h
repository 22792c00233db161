// InternVL (HF InternVLForConditionalGeneration, the "-hf" checkpoints), one architecture behind
// the model interface: the image cut into 448-px tiles and a thumbnail (models/preprocess/
// dynamic_tiles.h), each through InternViT (models/intern_vit.h), its patches pixel-shuffled 2×2
// into a quarter as many tokens of four times the width, a LayerNorm + MLP projector, then the
// Qwen2 (or Llama) decoder. The prompt's <image> becomes <img>, one <IMG_CONTEXT> per visual
// token, </img>, as InternVLProcessor writes it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "models/config.h"
#include "models/decoder_model.h"
#include "models/intern_vit.h"
#include "models/preprocess/dynamic_tiles.h"

namespace kvlens {

class InternVLModel final : public DecoderModel {
 public:
  static InternVLModel load(const std::string& dir, const BackendOptions& backend = {});
  const InternVLConfig& config() const { return cfg_; }

  VisualLayout visual_layout(int image_width, int image_height) const override;
  std::vector<int> prompt_ids(const std::string& prompt, const std::string& templ,
                              const VisualLayout& image) const override;
  Tensor pixel_values(const RGBImage& img) const override;
  ImageFeatures encode_image(const Tensor& pixel_values, const VisualLayout& layout) const override;

 private:
  static InternVLModel load_checked(const std::string& dir, const BackendOptions& backend);

  InternVLConfig cfg_;
  TilingConfig tiling_;
  InternVit vision_;
  Buffer ln_w_, ln_b_, w1_, b1_, w2_, b2_;  // the projector
};

}  // namespace kvlens
