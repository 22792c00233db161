// LLaVA-1.5 glue: checkpoint directory → vision tower → projector → sequence assembly →
// decoder prefill → policy → decode loop. The path of one image, kept short and visible:
//   load_image → preprocess → encode_image → prefill → compress (policy) → decode.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
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
  Buffer w1, b1, w2, b2;
};

struct GenerateOptions {
  int max_new_tokens = 32;
  bool stop_at_eos = true;
  float temperature = 0.0f;   // 0 = greedy
  float top_p = 1.0f;
  uint64_t seed = 0;
  // Storage of the decode cache's dense rows (a policy may ask for another, KVPolicy::
  // row_storage): fp16 rounds the prefill rows and every new row to half precision, as the
  // papers' full cache and the GPU backend store them; fp32 keeps them exact. The prefill
  // snapshot (PrefillState::store) stays exact either way.
  RowStorage kv_storage = RowStorage::Fp16;
  // Asked before compression (0) and after each generated token (tokens so far); returning
  // false stops decode with kvlens::Cancelled. Lets a caller drop a run a newer one replaced.
  std::function<bool(int tokens_done)> keep_going;
  bool keep_step_logits = false;  // keep the logits of every step in DecodeResult::step_logits
  // Greedy decode with no policy and no observer on a backend that chains steps
  // (Backend::chains_steps) launches each step before the previous one's logits are back, so
  // the host's work between steps overlaps the device's; the results are the same either way
  // (the device's greedy token is checked against the host's). At most one step past the
  // caption's end (an EOS nobody could foresee) runs and is discarded.
  bool chain_steps = true;
};

// The prompt after prefill at full precision. Kept so that compression + decode can re-run
// (another method, another parameter) without re-running vision and prefill.
struct PrefillState {
  std::vector<int> ids;
  std::vector<SegmentKind> kinds;
  int n_visual = 0;
  // The host store: structure and rows when `store_rows` (always on the CPU; on a device
  // backend when attention was kept or observed), otherwise empty.
  KVStore store;
  bool store_rows = true;
  std::shared_ptr<const DeviceKV> device;  // the device cache (null on the CPU backend)
  std::vector<float> logits;  // last prompt position
  PrefillCapture capture;     // per-layer q / scores / probs when kept
  double preprocess_ms = 0;  // image decode-to-tensor on the host (resize, crop, normalize)
  double vision_ms = 0, prefill_ms = 0;  // vision tower + projector; language-model prefill
};

struct DecodeResult {
  std::vector<int> generated_ids;
  std::string text;
  std::vector<float> first_logits;     // logits that chose the first generated token
  std::vector<std::vector<float>> step_logits;  // logits that chose each token (keep_step_logits)
  std::vector<float> chosen_probs;     // softmax probability of each chosen token
  KVBytes bytes_after_prefill;         // cache bytes right after the policy compressed it
  KVBytes bytes_final;                 // (on a device backend: the device cache's bytes)
  double compress_ms = 0, decode_ms = 0;
  bool chained = false;                // the loop chained its steps (GenerateOptions::chain_steps)
};

class LlavaModel {
 public:
  static LlavaModel load(const std::string& dir, const BackendOptions& backend = {});

  const LlavaConfig& config() const { return cfg_; }
  const Tokenizer& tokenizer() const { return tok_; }
  const PreprocessConfig& preprocess_config() const { return pre_; }
  PreprocessConfig& preprocess_config() { return pre_; }
  const std::string& dir() const { return dir_; }
  Backend& backend() const { return *be_; }
  // Bytes of language-model weights one decode step reads: every layer's matrices, norms and
  // biases, the final norm, lm_head and one embedding row (the decode roofline's denominator).
  int64_t decode_weight_bytes() const;

  Tensor pixel_values(const RGBImage& img) const;
  // pixel values → projected image features [n_visual][text_hidden] (fp32, backend memory).
  Buffer encode_image(const Tensor& pixel_values) const;
  // Tokenizes and runs the prompt; `keep_attention` keeps per-layer q/scores/probs (policies
  // that score tokens need them).
  PrefillState prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                       bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const;
  // The same from image features already computed by encode_image (several prompts, one image).
  PrefillState prefill_features(const Buffer& features, const std::string& prompt, const std::string& templ,
                                bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const;
  // Copies the prefill store, stores its rows as opt.kv_storage says (or as the policy asks),
  // lets `policy` compress it (null = full cache), then decodes.
  // `compressed`, when given, receives the store as the policy left it after prefill.
  DecodeResult decode(const PrefillState& st, KVPolicy* policy, const GenerateOptions& opt,
                      const std::vector<AttentionObserver*>& observers = {},
                      KVStore* compressed = nullptr) const;
  // Contexts handed to KVPolicy::on_prefill.
  std::vector<PrefillContext> prefill_contexts(const PrefillState& st) const;

 private:
  static LlavaModel load_checked(const std::string& dir, const BackendOptions& backend);
  Buffer encode_image_unnamed(const Tensor& pixel_values) const;

  std::string dir_;
  std::shared_ptr<Backend> be_;
  LlavaConfig cfg_;
  Tokenizer tok_;
  PreprocessConfig pre_;
  ClipVision vision_;
  Projector proj_;
  LlamaDecoder text_;
};

}  // namespace kvlens
