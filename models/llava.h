// LLaVA-1.5 (HF LlavaForConditionalGeneration) and LLaVA-NeXT (LlavaNextForConditionalGeneration,
// its anyres parts in models/llava_next.h), one architecture behind the model interface
// (models/model.h): checkpoint directory → vision tower → projector → sequence assembly →
// decoder prefill → policy → decode loop. The path of one image, kept short and visible:
//   load_image → preprocess → encode_image → prefill → compress (policy) → decode.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/data/image.h"
#include "core/kv_store.h"
#include "core/observer.h"
#include "core/compress/policy.h"
#include "models/clip.h"
#include "models/config.h"
#include "models/decoder_model.h"
#include "models/llama.h"
#include "models/model.h"
#include "models/tokenizer.h"

namespace kvlens {

struct Projector {
  Buffer w1, b1, w2, b2;
};

class LlavaModel final : public DecoderModel {
 public:
  static LlavaModel load(const std::string& dir, const BackendOptions& backend = {});

  const LlavaConfig& config() const { return cfg_; }

  // ---- Model (the decoder's part: DecoderModel) -------------------------------------------------
  VisualLayout visual_layout(int image_width, int image_height) const override;
  Tensor pixel_values(const RGBImage& img) const override;
  ImageFeatures encode_image(const Tensor& pixel_values, const VisualLayout& layout) const override;

 private:
  static LlavaModel load_checked(const std::string& dir, const BackendOptions& backend);
  // The projected features of each image in pixel_values ([images][3][S][S] or [3][S][S]),
  // [images · patches][hidden].
  Buffer project_images(const Tensor& pixel_values) const;

  LlavaConfig cfg_;
  ClipVision vision_;
  Projector proj_;
  Buffer newline_;  // LLaVA-NeXT's image_newline, [1][hidden]
};

}  // namespace kvlens
