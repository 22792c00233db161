// LLaVA-1.5 (HF LlavaForConditionalGeneration), one architecture behind the model interface
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
#include "models/llama.h"
#include "models/model.h"
#include "models/tokenizer.h"

namespace kvlens {

struct Projector {
  Buffer w1, b1, w2, b2;
};

class LlavaModel final : public Model {
 public:
  static LlavaModel load(const std::string& dir, const BackendOptions& backend = {});

  const LlavaConfig& config() const { return cfg_; }

  // ---- Model -----------------------------------------------------------------------------------
  const ModelInfo& info() const override { return info_; }
  const std::string& dir() const override { return dir_; }
  const Tokenizer& tokenizer() const override { return tok_; }
  const PreprocessConfig& preprocess_config() const override { return pre_; }
  PreprocessConfig& preprocess_config() override { return pre_; }
  Backend& backend() const override { return *be_; }
  int64_t decode_weight_bytes() const override;
  std::vector<int> prompt_ids(const std::string& prompt, const std::string& templ) const override;
  Tensor pixel_values(const RGBImage& img) const override;
  Buffer encode_image(const Tensor& pixel_values) const override;
  PrefillState prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                       bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const override;
  PrefillState prefill_features(const Buffer& features, const std::string& prompt, const std::string& templ,
                                bool keep_attention,
                                const std::vector<AttentionObserver*>& observers = {}) const override;
  DecodeResult decode(const PrefillState& st, KVPolicy* policy, const GenerateOptions& opt,
                      const std::vector<AttentionObserver*>& observers = {},
                      KVStore* compressed = nullptr) const override;
  std::vector<PrefillContext> prefill_contexts(const PrefillState& st) const override;

 private:
  static LlavaModel load_checked(const std::string& dir, const BackendOptions& backend);
  Buffer encode_image_unnamed(const Tensor& pixel_values) const;

  std::string dir_;
  std::shared_ptr<Backend> be_;
  LlavaConfig cfg_;
  ModelInfo info_;
  Tokenizer tok_;
  PreprocessConfig pre_;
  ClipVision vision_;
  Projector proj_;
  LlamaDecoder text_;
};

}  // namespace kvlens
