// LLaVA-1.5 glue: checkpoint directory → vision tower → projector → sequence assembly →
// decoder prefill → policy → decode loop. The path of one image, kept short and visible:
//   load_image → preprocess → encode_image → prefill → compress (policy) → decode.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/image.h"
#include "core/kv_store.h"
#include "core/observer.h"
#include "core/policy.h"
#include "models/clip.h"
#include "models/config.h"
#include "models/llama.h"
#include "models/tokenizer.h"

namespace kvlens {

struct Projector {
  Tensor w1, b1, w2, b2;
};

struct GenerateOptions {
  int max_new_tokens = 32;
  bool stop_at_eos = true;
  float temperature = 0.0f;   // 0 = greedy
  float top_p = 1.0f;
  uint64_t seed = 0;
  // Asked before compression (0) and after each generated token (tokens so far); returning
  // false stops decode with kvlens::Cancelled. Lets a caller drop a run a newer one replaced.
  std::function<bool(int tokens_done)> keep_going;
  bool keep_step_logits = false;  // keep the logits of every step in DecodeResult::step_logits
};

// The prompt after prefill at full precision. Kept so that compression + decode can re-run
// (another method, another parameter) without re-running vision and prefill.
struct PrefillState {
  std::vector<int> ids;
  std::vector<SegmentKind> kinds;
  int n_visual = 0;
  KVStore store;
  std::vector<float> logits;  // last prompt position
  PrefillCapture capture;     // per-layer q / scores / probs when kept
  double vision_ms = 0, prefill_ms = 0;
};

struct DecodeResult {
  std::vector<int> generated_ids;
  std::string text;
  std::vector<float> first_logits;     // logits that chose the first generated token
  std::vector<std::vector<float>> step_logits;  // logits that chose each token (keep_step_logits)
  std::vector<float> chosen_probs;     // softmax probability of each chosen token
  KVBytes bytes_after_prefill;         // store bytes right after the policy compressed it
  KVBytes bytes_final;
  double compress_ms = 0, decode_ms = 0;
};

class LlavaModel {
 public:
  static LlavaModel load(const std::string& dir);

  const LlavaConfig& config() const { return cfg_; }
  const Tokenizer& tokenizer() const { return tok_; }
  const PreprocessConfig& preprocess_config() const { return pre_; }
  PreprocessConfig& preprocess_config() { return pre_; }
  const std::string& dir() const { return dir_; }

  Tensor pixel_values(const RGBImage& img) const;
  // pixel values → projected image features [n_visual][text_hidden].
  Tensor encode_image(const Tensor& pixel_values) const;
  // Tokenizes and runs the prompt; `keep_attention` keeps per-layer q/scores/probs (policies
  // that score tokens need them).
  PrefillState prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                       bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const;
  // The same from image features already computed by encode_image (several prompts, one image).
  PrefillState prefill_features(const Tensor& features, const std::string& prompt, const std::string& templ,
                                bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const;
  // Copies the prefill store, lets `policy` compress it (null = full cache), then decodes.
  // `compressed`, when given, receives the store as the policy left it after prefill.
  DecodeResult decode(const PrefillState& st, KVPolicy* policy, const GenerateOptions& opt,
                      const std::vector<AttentionObserver*>& observers = {},
                      KVStore* compressed = nullptr) const;
  // Contexts handed to KVPolicy::on_prefill.
  std::vector<PrefillContext> prefill_contexts(const PrefillState& st) const;

 private:
  static LlavaModel load_checked(const std::string& dir);
  Tensor encode_image_unnamed(const Tensor& pixel_values) const;

  std::string dir_;
  LlavaConfig cfg_;
  Tokenizer tok_;
  PreprocessConfig pre_;
  ClipVision vision_;
  Projector proj_;
  LlamaDecoder text_;
};

}  // namespace kvlens
