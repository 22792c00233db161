// Many compression methods on one shared prefill: the full-cache reference, then each method's
// compression + decode, with every diagnostic against the reference. `kvlens run`,
// `kvlens calibrate` and the demo use this.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/lab/references.h"
#include "core/diagnostics/diagnostics.h"
#include "core/compress/method.h"
#include "models/model.h"

namespace kvlens {

// What every run of the lab generates with: the prompt in its template, how many tokens, and the
// storage of uncompressed KV rows of every decode cache (the reference's included). The options
// of one image's experiment and of a dataset's evaluation extend it.
struct GenerationSetup {
  std::string prompt = kDefaultPrompt;
  std::string templ = kDefaultTemplate;
  int max_new_tokens = kDefaultMaxNewTokens;
  RowStorage kv_storage = RowStorage::Fp16;
};

struct ExperimentOptions : GenerationSetup {
  int diag_steps = 4;              // decode steps whose attention the diagnostics compare
  double sparsity_p = 0.01;        // ThresholdFilter: keep A_ij >= p · max_j A_ij
  double hit_budget = 0.1;         // CacheHitRate k = budget · prompt length
  int hit_window = 32;             // queries of the sliding-window scoring strategy
  std::vector<int> hit_steps{0, 2, 4, 8};
  int hist_bins = 40;
  // Keep query × key attention (mean over heads) of the prompt and the first diag_steps decode
  // steps, for the attention heatmaps (the report's "attention" section), pooled to at most
  // attention_bins × attention_bins blocks of the prompt (core/attention_reduce.h: a block's mean
  // over its causal entries) and attention_bins key blocks for each decode step's row: computed
  // where the capture is, and only the blocks cross to the host.
  bool attention_maps = false;
  int attention_bins = 256;
  // The backend memory the run may use beyond the loaded weights, in bytes (0 = what the backend
  // has free); a run whose plan needs more is refused before it starts (app/lab/memory_plan.h).
  int64_t memory_limit = 0;
  // Handed to every decode (GenerateOptions::keep_going): returning false cancels the run.
  std::function<bool(int tokens_done)> keep_going;
};

struct MethodRun {
  Params params;
  std::string label;  // display name from a session or the app ("" = the short spec)
  DecodeResult result;
  std::vector<LayerDiagnostics> layers;
  FirstDivergence divergence;
  double mean_softmax_mse = 0, mean_kl = 0, mean_output_error = 0;
  double compression_vs_fp16 = 0;  // fp16 bytes of the full prompt cache / bytes after compression
  // With ExperimentOptions::attention_maps: per layer, the decode rows [steps][Experiment::
  // attention_cols] of this method's attention (mean over heads, by key position, pooled into the
  // map's key blocks).
  std::vector<std::vector<float>> decode_attention;
};

// The reference ("full") decodes the uncompressed cache with opt.kv_storage rows (fp16 by
// default, like the papers' full cache); its caption and ids are what `same_as_full` and the
// first divergence compare against. The diagnostics compare attention against the exact
// (fp32) prefill rows, prefill.store.
struct Experiment {
  PrefillState prefill;
  DecodeResult full;
  std::unique_ptr<DecodeRecorder> full_recorder;
  HitRates hit_rates;
  std::vector<double> sparsity_prefill, sparsity_decode_full;
  KVBytes full_fp16_bytes;  // the full prompt cache stored as fp16
  std::vector<MethodRun> runs;
  // With ExperimentOptions::attention_maps: per layer, the full cache's attention (mean over
  // heads) over the n = prompt + attention_steps key positions pooled into attention_cols key
  // blocks: attention_rows rows of pooled prompt queries, then one row per decode step
  // ([attention_rows + attention_steps][attention_cols]; AttentionReduction::map's blocks).
  int attention_steps = 0, attention_rows = 0, attention_cols = 0;
  std::vector<std::vector<float>> attention;
  // The image's reference captions (find_image_references; null: none): each caption's CIDEr-D
  // goes into the report.
  std::shared_ptr<const ImageReferences> references;

  PrefillView view() const;
};
// The diagnostics' view of a prefill that kept its attention (Experiment::view's).
PrefillView prefill_view(const PrefillState& prefill);

// The template a run gives `model`: `templ`; where it was left at LLaVA's default, the
// checkpoint's chat template rendered for one user turn (Tokenizer::chat_prompt) when it ships
// one, else for a text-only model (which takes no image) the prompt alone ("{prompt}").
std::string model_template(const Model& model, const std::string& templ);
// A text-only prompt's span that its template marks (what the methods treat as visual tokens):
// its first token, its token count (0: none marked) and its text.
struct PromptSpan {
  int first = 0, n = 0;
  std::string text;
};
PromptSpan prompt_span(const Model& model, const PrefillState& st);

// Prefill once (attention kept) and decode with the full cache. `observers` also watch the
// full-cache decode.
Experiment start_experiment(const Model& model, const RGBImage& img, const ExperimentOptions& opt,
                            const std::vector<AttentionObserver*>& observers = {});
// The same from a prefill already made (with keep_attention) of opt.prompt.
Experiment start_experiment(const Model& model, PrefillState prefill, const ExperimentOptions& opt,
                            const std::vector<AttentionObserver*>& observers = {});
// Compress the shared prefill with one method, decode, and compare against the reference.
// `observers` also watch this method's decode.
MethodRun run_method(const Model& model, const Experiment& ex, const Params& params,
                     const ExperimentOptions& opt, const std::vector<AttentionObserver*>& observers = {});

// The report of `kvlens run --report`: the reference and each run in `ex.runs` (or in `runs`).
nlohmann::json experiment_json(const Model& model, const Experiment& ex, const ExperimentOptions& opt);
nlohmann::json experiment_json(const Model& model, const Experiment& ex,
                               const std::vector<const MethodRun*>& runs, const ExperimentOptions& opt);
// Its two parts: everything but the methods ("methods" an empty list), and one method's entry;
// experiment_json appends the second to the first for each run. The desktop app builds each
// part once and assembles reports from them.
nlohmann::json experiment_base_json(const Model& model, const Experiment& ex, const ExperimentOptions& opt);
nlohmann::json method_run_json(const Model& model, const Experiment& ex, const MethodRun& r);
// A map of rows × cols attention probabilities as the report holds it: each value to 1e-6, a
// positive one at least 1e-6 (0 stays for no attention at all: keys not held, or after the query).
nlohmann::json attention_rows(const std::vector<float>& m, int rows, int cols);

// CalibQuant τ1/τ2 grid search by mean softmax MSE against the full cache.
struct CalibrationPoint {
  double tau1 = 0, tau2 = 0, mse = 0, kl = 0;
  bool same_caption = false;
};
// The CalibQuant spec a τ1/τ2 grid starts from; refused (InputError naming it) unless it is a
// calibquant spec that calibrates.
Params calibrating_base(const std::string& base_spec);

std::vector<CalibrationPoint> calibrate_grid(const Model& model, const Experiment& ex,
                                             const std::string& base_spec, const std::vector<double>& taus,
                                             const ExperimentOptions& opt);

}  // namespace kvlens
