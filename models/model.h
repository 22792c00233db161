// The model interface: everything outside models/ talks to a Model, never to an architecture.
// A Model turns an image and a prompt into a prefilled KV cache (vision tower, projector,
// sequence assembly, decoder prefill) and decodes from it with a compression policy at the one
// hook point; its facts (layers, heads, visual tokens, patch grid) are what views need. Each
// architecture is one file behind it (models/llava.cpp: LLaVA-1.5 and, with
// models/llava_next.cpp, LLaVA-NeXT; models/llama_text.cpp: text-only Llama / Mistral), listed in the table of
// architectures that load_model reads (models/model.cpp).
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
#include "core/prefill_attention.h"
#include "core/visual_layout.h"
#include "core/compress/policy.h"
#include "models/preprocess/clip_image.h"
#include "models/tokenizer.h"

namespace kvlens {

// What prefill may keep per layer for policies and diagnostics.
// What prefill keeps of the prompt's attention when asked: each layer's post-RoPE queries (host,
// for methods that score with them) and the attention, recomputed a layer at a time on demand
// from the queries, keys and values the backend keeps (core/prefill_attention.h).
struct PrefillCapture {
  bool keep = false;
  std::shared_ptr<const PrefillAttention> attention;  // each layer's q, k, v in the backend's memory
};

// An image through the vision tower and projector: one row per visual token.
struct ImageFeatures {
  Buffer features;      // [n_tokens][text hidden], fp32, in the backend's memory
  VisualLayout layout;  // where each row lies on the image
};

// New tokens a caption may take where the user gives no number: enough for the embedded models'
// longest captions (37 tokens and EOS for kvlens-scenes-14m).
constexpr int kDefaultMaxNewTokens = 48;

struct GenerateOptions {
  int max_new_tokens = kDefaultMaxNewTokens;
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
  VisualLayout layout;  // where the visual tokens lie on the image (no grids for a text-only prompt)
  // The host store: its layout always, and its rows when `store_rows` (always on the CPU; on a
  // device backend when prefill was observed). Otherwise every segment is layout_only: the rows
  // are in the device cache, and a decode fetches them only when something on the host reads
  // them (a policy that quantizes or merges, an observer that reads keys and values).
  KVStore store;
  bool store_rows = true;
  std::shared_ptr<const DeviceKV> device;  // the device cache (null on the CPU backend)
  std::vector<float> logits;  // last prompt position
  PrefillCapture capture;     // per-layer queries and the prompt's attention, when kept
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
  double handover_ms = 0;  // of decode_ms: events handed to observers after the steps ran (put off, recorded)
  bool chained = false;                // the loop chained its steps, all or those past the last observed one (GenerateOptions::chain_steps)
};

// What the views and reports need to know of a model, whatever its architecture.
struct ModelInfo {
  std::string architecture;  // the table's name for it ("llava", "llava_next", "llama", "mistral")
  std::string family;        // in words: "LLaVA-1.5", "LLaVA-NeXT (anyres)", "Llama (text)"
  int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, hidden = 0, intermediate = 0, vocab = 0;
  // Image tokens of an image: always this many for LLaVA-1.5; for a model whose count depends on
  // the image (LLaVA-NeXT's anyres) the count of a square image, `image_dependent` set, and
  // Model::visual_layout gives an image's own.
  int n_visual = 0;
  bool image_dependent = false;
  std::string tiling;        // how images are cut, in words ("" when they are not)
  int matrix_bytes = 4;      // bytes per value of the decoder's matrices and their inputs (2: fp16 / bf16)
  // The visual tokens' patch grid: rows × cols patches; the first `patch_first` visual tokens
  // (a CLS token, say) are not on it.
  int patch_rows = 0, patch_cols = 0, patch_first = 0;
  // A text-only model (Llama, Mistral) has no visual tokens and takes no image.
  bool takes_image() const { return n_visual > 0; }
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelInfo& info() const = 0;
  virtual const std::string& dir() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  virtual const PreprocessConfig& preprocess_config() const = 0;
  virtual PreprocessConfig& preprocess_config() = 0;
  virtual Backend& backend() const = 0;
  // Bytes of language-model weights one decode step reads: every layer's matrices, norms and
  // biases, the final norm, lm_head and one embedding row (the decode roofline's denominator).
  virtual int64_t decode_weight_bytes() const = 0;

  // Where the visual tokens of an image of this size lie, and how many there are (no grids and
  // no tokens for a text-only model).
  virtual VisualLayout visual_layout(int image_width, int image_height) const = 0;
  // The prompt's token ids as prefill will assemble them (the template, the prompt and one id per
  // visual token of `image`), without running anything.
  virtual std::vector<int> prompt_ids(const std::string& prompt, const std::string& templ,
                                      const VisualLayout& image) const = 0;
  // The image as the vision tower takes it (the architecture's processor): [3][S][S], or
  // [tiles][3][S][S] for a model that cuts the image into tiles (the base image first).
  virtual Tensor pixel_values(const RGBImage& img) const = 0;
  // pixel values of an image laid out as `layout` says → projected image features.
  virtual ImageFeatures encode_image(const Tensor& pixel_values, const VisualLayout& layout) const = 0;
  // Tokenizes and runs the prompt; `keep_attention` keeps per-layer q/scores/probs (policies
  // that score tokens need them).
  virtual PrefillState prefill(const RGBImage& img, const std::string& prompt, const std::string& templ,
                               bool keep_attention, const std::vector<AttentionObserver*>& observers = {}) const = 0;
  // The same from image features already computed by encode_image (several prompts, one image).
  virtual PrefillState prefill_features(const ImageFeatures& features, const std::string& prompt, const std::string& templ,
                                        bool keep_attention,
                                        const std::vector<AttentionObserver*>& observers = {}) const = 0;
  // Copies the prefill store, stores its rows as opt.kv_storage says (or as the policy asks),
  // lets `policy` compress it (null = full cache), then decodes.
  // `compressed`, when given, receives the layout of the store as the policy left it after
  // prefill (KVStore::without_rows: segments, positions, row annotations and bytes; no rows).
  virtual DecodeResult decode(const PrefillState& st, KVPolicy* policy, const GenerateOptions& opt,
                              const std::vector<AttentionObserver*>& observers = {},
                              KVStore* compressed = nullptr) const = 0;
  // Contexts handed to KVPolicy::on_prefill, without a device cache (decode adds its own copy of
  // the prefill's as PrefillContext::device).
  virtual std::vector<PrefillContext> prefill_contexts(const PrefillState& st) const = 0;
};

// Loads the checkpoint folder `dir` (HF layout: config.json, safetensors, tokenizer, processor
// config) as the architecture its config.json names, on the backend asked for. Throws
// InputError naming the file and what was expected.
std::unique_ptr<Model> load_model(const std::string& dir, const BackendOptions& backend = {});

}  // namespace kvlens
