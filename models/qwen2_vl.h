// Qwen2-VL (HF Qwen2VLForConditionalGeneration) and Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration:
// the same but for its windowed vision tower), one architecture behind the model interface:
// the image at its own resolution (models/preprocess/qwen_patches.h) through the vision tower
// (models/qwen2_vit.h), each 2×2 block of patches one token, then the Qwen2 decoder with M-RoPE:
// an image token's rotary positions are its (temporal, row, column) from the image's first
// position, and the text after it continues from the larger of the grid's sides.
//
// The cache keeps every row at its sequence position (0..T-1, as views and methods count), and
// the decode steps rotate by those positions as any decoder does. That equals HF's rotation by
// the M-RoPE positions (a step at T + s rotated by T + s + rope_deltas): the prefill rotates every
// prompt position by its M-RoPE position minus rope_deltas, and a rotation's scores depend only
// on the difference of the positions, which the shift leaves as it is.
#pragma once
#include <string>
#include <vector>

#include "models/config.h"
#include "models/decoder_model.h"
#include "models/preprocess/qwen_patches.h"
#include "models/qwen2_vit.h"

namespace kvlens {

class Qwen2VLModel final : public DecoderModel {
 public:
  static Qwen2VLModel load(const std::string& dir, const BackendOptions& backend = {});
  const Qwen2VLConfig& config() const { return cfg_; }

  VisualLayout visual_layout(int image_width, int image_height) const override;
  Tensor pixel_values(const RGBImage& img) const override;
  ImageFeatures encode_image(const Tensor& pixel_values, const VisualLayout& layout) const override;

  // HF get_rope_index's positions of a prompt ([3][T]: temporal, height, width) and rope_deltas
  // (the largest position + 1 − T), from its kinds and the image's token grid.
  static std::vector<int32_t> mrope_positions(const std::vector<SegmentKind>& kinds, const VisualLayout& image,
                                              int& rope_delta);

 protected:
  std::vector<int32_t> rope_positions(const PrefillState& st) const override;

 private:
  static Qwen2VLModel load_checked(const std::string& dir, const BackendOptions& backend);

  Qwen2VLConfig cfg_;
  QwenPatchConfig patches_;
  Qwen2Vit vision_;
};

}  // namespace kvlens
