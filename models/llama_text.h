// Text-only decoders (HF LlamaForCausalLM and MistralForCausalLM, config model_type "llama" or
// "mistral"), one architecture behind the model interface (models/model.h): the prompt through
// the template and the tokenizer, the decoder's prefill and the decode loop of DecoderModel. No
// image: the prompt has no visual tokens, and a template with an <image> marker is refused.
#pragma once
#include <string>
#include <vector>

#include "models/decoder_model.h"

namespace kvlens {

// The template a text-only prompt takes when none is given: the prompt alone (after BOS).
constexpr const char* kTextOnlyTemplate = "{prompt}";

class LlamaTextModel final : public DecoderModel {
 public:
  static LlamaTextModel load(const std::string& dir, const BackendOptions& backend = {});

  std::vector<int> prompt_ids(const std::string& prompt, const std::string& templ) const override;
  // A text-only model has no image processor or tower: these refuse (InputError).
  Tensor pixel_values(const RGBImage& img) const override;
  Buffer encode_image(const Tensor& pixel_values) const override;
  // `img` must be empty (RGBImage{}): the model takes no image.
  PrefillState prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                       bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const override;
  // `features` must be empty (no rows).
  PrefillState prefill_features(const Buffer& features, const std::string& prompt, const std::string& templ,
                                bool keep_attention,
                                const std::vector<AttentionObserver*>& observers = {}) const override;

 private:
  static LlamaTextModel load_checked(const std::string& dir, const BackendOptions& backend);
};

}  // namespace kvlens
