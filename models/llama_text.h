// Text-only decoders (HF LlamaForCausalLM and MistralForCausalLM, config model_type "llama" or
// "mistral"), one architecture behind the model interface (models/model.h): the prompt through
// the template and the tokenizer, the decoder's prefill and the decode loop of DecoderModel. No
// image, and a template with an <image> marker is refused. What the methods treat as the visual
// segment (CalibQuant's quantized tokens, VL-Cache's post-vision queries, the token fate) is a
// span of the prompt the template marks with <span> … </span> (ZipCache's and KIVI's setting of
// a chosen context span): the text before it, the span and the text after it are tokenized each
// on its own, as LLaVA's chunks around <image> are, and become the system, visual and post-vision
// segments. Without the markers the whole prompt is one system segment, tokenized at once.
#pragma once
#include <string>
#include <vector>

#include "models/decoder_model.h"

namespace kvlens {

// The template a text-only prompt takes when none is given: the prompt alone (after BOS).
constexpr const char* kTextOnlyTemplate = "{prompt}";

// A text-only prompt's ids and where its marked span lies (n = 0: no span).
struct TextPrompt {
  std::vector<int> ids;
  int span_first = 0, span_n = 0;
};

class LlamaTextModel final : public DecoderModel {
 public:
  static LlamaTextModel load(const std::string& dir, const BackendOptions& backend = {});

  VisualLayout visual_layout(int, int) const override { return {}; }  // (no visual tokens)
  std::vector<int> prompt_ids(const std::string& prompt, const std::string& templ,
                              const VisualLayout& image) const override;
  TextPrompt tokenize(const std::string& prompt, const std::string& templ) const;
  // A text-only model has no image processor or tower: these refuse (InputError).
  Tensor pixel_values(const RGBImage& img) const override;
  ImageFeatures encode_image(const Tensor& pixel_values, const VisualLayout& layout) const override;
  // `img` must be empty (RGBImage{}): the model takes no image.
  PrefillState prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                       bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const override;
  // `features` must be empty (no rows).
  PrefillState prefill_features(const ImageFeatures& features, const std::string& prompt, const std::string& templ,
                                bool keep_attention,
                                const std::vector<AttentionObserver*>& observers = {}) const override;

 private:
  static LlamaTextModel load_checked(const std::string& dir, const BackendOptions& backend);
};

}  // namespace kvlens
