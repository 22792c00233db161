// The recompute thread of the desktop app (and of `kvlens bench session`, which drives it without a
// window). The UI hands it the whole wanted setup (model,
// image, prompt, options, the enabled method instances with their parameters); the worker loads
// the model, runs vision + prefill + the full-cache decode once per model/image/prompt and keeps
// that prefill, then re-runs compression + decode only for instances whose parameters changed,
// the most recently edited first. A newer setup cancels a run it no longer wants (between
// decode steps, by comparing the run's inputs with the newest setup). Results come back as
// immutable snapshots; the UI never runs the model.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/diagnostics/diagnostics.h"
#include "core/data/image.h"
#include "models/preprocess/clip_image.h"
#include "core/compress/method.h"
#include "app/lab/experiment.h"

namespace kvlens {

struct Setup {
  std::string model_dir;   // resolved path
  std::string image_path;  // resolved path
  BackendOptions backend;  // where the model runs (a change reloads the model)
  ExperimentOptions opt;   // prompt, template, options incl. kv_storage (keep_going is the worker's)
  struct Method {
    int id = 0;
    Params params;
    std::string label;
  };
  std::vector<Method> methods;  // enabled instances, in display order
  std::vector<int> priority;    // instance ids, most recently edited first
};

struct ModelFacts {
  std::string dir, hash;
  std::string backend;  // the backend it runs on ("cpu" / "cuda")
  std::string family, tiling;  // ModelInfo's: "LLaVA-NeXT (anyres)", how images are cut ("" when not)
  int layers = 0, heads = 0, kv_heads = 0, head_dim = 0, visual_tokens = 0, patch_rows = 0, patch_first = 0;
  bool image_dependent = false;  // visual tokens depend on the image (visual_tokens: a square image's)
  int64_t full_fp16_bytes = 0;  // per prompt, once a prefill ran
  double load_ms = 0;
};

// One image + prompt through vision, prefill and the full-cache decode.
struct BaseResult {
  std::string key;  // the inputs it was computed from
  std::shared_ptr<const Experiment> ex;
  std::shared_ptr<const VisualAttentionRecorder> patches;  // full cache, every decode step
  RGBImage shown;                                           // the preprocessed image, as the tower sees it
  std::vector<std::string> pieces;                          // full cache's generated tokens as text
  std::string image_hash;
  int first_visual = 0;
  double ms = 0;
  std::shared_ptr<const nlohmann::json> json;  // experiment_base_json, built once
};

struct RunResult {
  int id = 0;
  std::string spec;  // Params::spec() it was computed with
  std::string label;
  std::shared_ptr<const MethodRun> run;
  std::shared_ptr<const VisualAttentionRecorder> patches;
  std::vector<std::string> pieces;
  double ms = 0;  // compression + decode + diagnostics
  double run_ms = 0, json_ms = 0;  // of which run_method, and its report entry (method_run_json)
  std::shared_ptr<const nlohmann::json> json;  // method_run_json (without label), built once
};

struct Snapshot {
  uint64_t serial = 0;         // grows with every snapshot
  uint64_t setup_version = 0;  // the newest setup the worker had seen
  bool busy = false;           // work left for that setup
  std::string stage;           // what runs now ("prefill", "calibquant", ...)
  std::shared_ptr<const ModelFacts> model;
  std::string model_error;
  std::shared_ptr<const BaseResult> base;
  std::string base_error;
  std::vector<RunResult> runs;                 // computed instances of the setup, in its order
  std::map<int, std::string> run_errors;       // instance id → message
  std::shared_ptr<const nlohmann::json> report;  // experiment_json of base + runs
  double report_ms = 0;                          // assembling the latest report
  int runs_done = 0, runs_cancelled = 0;         // since the worker started
};

struct Progress {
  int tokens_done = 0, tokens_total = 0;
  bool busy = false;
};

// Objects kept alive until no one else holds them, then freed by sweep, never by a snapshot's
// last holder (the app's UI thread). An object that holds host memory alone (a method's run, its
// report) goes to a thread of the list's own to be freed: freeing a 7B run's report takes tens
// of milliseconds, which the next edit would otherwise wait for. Any other (a prefill, which
// holds device memory) is freed by the thread that sweeps, in order with its device work.
class Retired {
 public:
  Retired();
  ~Retired();  // frees what it holds, then stops its thread
  Retired(const Retired&) = delete;
  Retired& operator=(const Retired&) = delete;
  void add(std::shared_ptr<const void> p, bool host_only = false) {
    if (p) held_.push_back({std::move(p), host_only});
  }
  void sweep();  // frees (or hands to the freeing thread) every object this list alone holds
  bool empty() const { return held_.empty(); }
  size_t size() const { return held_.size(); }
  // Waits until every object handed to the freeing thread is freed.
  void drain();

 private:
  std::vector<std::pair<std::shared_ptr<const void>, bool>> held_;  // {object, host memory alone}
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<const void>> freeing_;  // handed over, not yet freed
  bool stop_ = false, busy_ = false;
  std::thread thread_;
};

class Worker {
 public:
  // The worker's OpenMP loops run on as many threads as the creating thread's do.
  Worker();
  ~Worker();
  // The threads the worker's OpenMP loops run on (0 until its thread has started).
  int loop_threads() const { return loop_threads_.load(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Replaces the wanted setup; returns its version.
  uint64_t submit(Setup s);
  // The newest snapshot (never null after construction).
  std::shared_ptr<const Snapshot> latest() const;
  Progress progress() const;
  // Called on the worker thread after every snapshot (the app wakes its event loop with it).
  void set_on_publish(std::function<void()> f);

 private:
  void loop();
  void publish(bool busy, const std::string& stage);
  bool base_wanted(const std::string& key);
  bool run_wanted(int id, const std::string& spec, const std::string& base_key);
  void build_report(const Setup& s);
  void retire(const RunResult& r);  // what replacing or dropping a run lets go
  void drop_runs();                  // runs_ retired and cleared

  mutable std::mutex mu_;
  std::condition_variable cv_;
  Setup want_;
  uint64_t want_version_ = 0, idle_version_ = 0;
  bool stop_ = false;
  std::shared_ptr<const Snapshot> published_;
  std::function<void()> on_publish_;
  uint64_t serial_ = 0;
  std::atomic<int> tokens_done_{0}, tokens_total_{0};
  std::atomic<bool> busy_{false};

  // Worker-thread state (published through snapshots only).
  std::shared_ptr<const Model> model_;
  std::shared_ptr<const ModelFacts> facts_;
  std::string model_key_, model_error_;
  std::shared_ptr<const BaseResult> base_;
  std::string base_key_, base_error_;
  std::map<int, RunResult> runs_;
  std::map<int, std::pair<std::string, std::string>> run_errors_;  // id → (spec, message)
  std::shared_ptr<const nlohmann::json> report_;
  // What report_ was built from (build_report keeps an unchanged one): its parts, held, and the
  // instances' ids and labels.
  std::vector<std::shared_ptr<const void>> report_parts_;
  std::string report_labels_;
  double report_ms_ = 0;
  std::atomic<int> loop_threads_{0};  // (loop_threads)
  // What the worker replaced and a snapshot may still hold (a report, a run, a prefill): freed
  // once the snapshots that held it are gone, by the worker's sweep (a prefill) or the list's
  // own thread (the rest, host memory alone).
  Retired retired_;
  std::vector<RunResult> ordered_;
  uint64_t computing_version_ = 0;
  int runs_done_ = 0, runs_cancelled_ = 0;

  std::thread thread_;
};

// The key of everything a prefill depends on.
std::string base_key(const Setup& s);
// The preprocessed image (pixel values mapped back to 8-bit RGB): what the vision tower sees.
RGBImage shown_image(const Tensor& pixel_values, const PreprocessConfig& cfg);
// The image the views draw the patch grid over: what the tower sees (shown_image), or for a model
// that tiles the image (LLaVA-NeXT, whose finest grid covers the image itself after unpadding)
// the image, its longer side brought to at most 672 pixels.
RGBImage image_for_views(const Model& model, const RGBImage& img);

}  // namespace kvlens
