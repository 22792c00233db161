// What every architecture behind the model interface shares once its prompt is embedded: the
// Llama decoder with its config and tokenizer, the prefill of an embedded prompt into a KV cache,
// and the decode loop (policy at its hook point, observers, chained steps). An architecture
// (models/llava.cpp: LLaVA-1.5; models/llama_text.cpp: text-only Llama and Mistral) loads its
// checkpoint into these members and assembles the prompt's embeddings.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/backend.h"
#include "core/errors.h"
#include "models/config.h"
#include "models/llama.h"
#include "models/model.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"

namespace kvlens {

class DecoderModel : public Model {
 public:
  const ModelInfo& info() const override { return info_; }
  const std::string& dir() const override { return dir_; }
  const Tokenizer& tokenizer() const override { return tok_; }
  const PreprocessConfig& preprocess_config() const override { return pre_; }
  PreprocessConfig& preprocess_config() override { return pre_; }
  Backend& backend() const override { return *be_; }
  int64_t decode_weight_bytes() const override;
  DecodeResult decode(const PrefillState& st, KVPolicy* policy, const GenerateOptions& opt,
                      const std::vector<AttentionObserver*>& observers = {},
                      KVStore* compressed = nullptr) const override;
  std::vector<PrefillContext> prefill_contexts(const PrefillState& st) const override;
  // An image model's prefill (LLaVA, InternVL): prefill_image and prefill_image_tokens over the
  // architecture's visual_layout, pixel_values, encode_image and prompt_ids. (A text-only model
  // has its own.)
  PrefillState prefill(const RGBImage& img, const std::string& prompt, const std::string& templ, bool keep_attention,
                       const std::vector<AttentionObserver*>& observers = {}) const override;
  PrefillState prefill_features(const ImageFeatures& features, const std::string& prompt, const std::string& templ,
                                bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const override;
  // The template's <image> as the image's tokens (LLaVA, Qwen2-VL; InternVL wraps it first).
  std::vector<int> prompt_ids(const std::string& prompt, const std::string& templ,
                              const VisualLayout& image) const override;

 protected:
  // The embedded prompt `x` ([ids][hidden], fp32) through the decoder into st's KV cache: st
  // holds the ids, kinds and n_visual; prefill fills its store, device cache, logits and capture.
  void prefill_embedded(PrefillState& st, Buffer x, bool keep_attention,
                        const std::vector<AttentionObserver*>& observers) const;
  // An image model's prefill: the image through visual_layout, pixel_values and encode_image,
  // then prefill_features (with the preprocess and vision times).
  PrefillState prefill_image(const RGBImage& img, const std::string& prompt, const std::string& templ, bool keep_attention,
                             const std::vector<AttentionObserver*>& observers) const;
  // The prompt `ids` with each run of the image token replaced by the next rows of the image's
  // features, through the decoder (kinds: system before the image, visual, post-vision text).
  PrefillState prefill_image_tokens(const ImageFeatures& image, std::vector<int> ids, bool keep_attention,
                                    const std::vector<AttentionObserver*>& observers) const;
  // The decoder's rotary positions of st's prompt, [text_cfg_.rope.rows()][T] (empty: 0..T-1):
  // Qwen2-VL's M-RoPE gives the image's tokens their height and width.
  virtual std::vector<int32_t> rope_positions(const PrefillState& st) const { return {}; }
  // The prompt's length checked against the positions a sequence may hold.
  void check_prompt_length(int T, int n_visual) const;
  // Loads the decoder's weights under prefix `tp` (lm_head named `lm_head`, or tied) and fills
  // info_'s decoder facts; the backend must have every op the decoder needs.
  void load_decoder(const WeightStore& ws, const std::string& tp, const std::string& lm_head, bool tied,
                    const BackendOptions& backend);

  std::string dir_;
  std::shared_ptr<Backend> be_;
  LlamaConfig text_cfg_;
  ModelInfo info_;
  Tokenizer tok_;
  PreprocessConfig pre_;
  LlamaDecoder text_;
};

namespace model_detail {

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Runs f, naming the model folder in a non-finite activation's message.
template <class F>
auto in_model(const std::string& dir, F f) -> decltype(f()) {
  try {
    return f();
  } catch (const NonFiniteError& e) {
    throw NonFiniteError(dir + ": " + e.what());
  }
}

// The first of `prefixes` under which `probe` exists; InputError naming every name tried when
// none does.
std::string need_prefix(const WeightStore& ws, const std::vector<std::string>& prefixes, const std::string& probe,
                        const std::string& what);
// The first of `names` the checkpoint holds, or "".
std::string first_present(const WeightStore& ws, const std::vector<std::string>& names);

void check_model_dir(const std::string& dir);  // InputError unless `dir` is a directory
// The tokenizer of model folder `dir`, whose image token must be config.json's image_token_id
// (InputError naming both where added_tokens.json or the tokenizer says otherwise).
Tokenizer image_tokenizer(const std::string& dir, int image_token_id);
// An architecture's loader run on model folder `dir`: InputError when the folder is missing, and
// a JSON value of the wrong type in one of its files said as an InputError naming the folder.
template <class F>
auto load_folder(const std::string& dir, F load) -> decltype(load()) {
  check_model_dir(dir);
  try {
    return load();
  } catch (const nlohmann::json::exception& e) {
    throw InputError(dir + ": a JSON file holds a value of the wrong type (" + e.what() + ")");
  }
}

}  // namespace model_detail

}  // namespace kvlens
