// A session: what a researcher set up (model, image, prompt, methods with their parameters,
// diagnostic options) as JSON, so it can be saved, shared and reopened. Method parameters are
// validated by the same schema as CLI specs. The desktop app and `kvlens run --session` share
// it: version 2 adds content hashes of the model and image, a label and an enabled flag per
// method, the app's selected views and a summary of the results (version 1 files still read).
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/lab/experiment.h"
#include "core/compress/method.h"

namespace kvlens {

// The session schema this kvlens writes and the newest it reads.
constexpr int kSessionVersion = 2;
// Ranges of the run options, shared by sessions and the command line.
constexpr int kMaxNewTokensLimit = 4096;
constexpr int kMaxDiagSteps = 256;
constexpr double kMinHitBudget = 1e-4;

// The run options a session holds: what `kvlens run --session / --save-session` and the
// desktop app's inputs share (the app's Inputs extend it).
struct SessionRun {
  std::string prompt, templ;           // empty = the defaults
  int max_new_tokens = kDefaultMaxNewTokens;
  std::string kv_storage = "fp16";     // dense rows of the decode cache: "fp16" | "fp32"
  int diag_steps = 4;
  double sparsity_p = 0.01;
  double hit_budget = 0.1;
};
// The run options of `o`, as a session saves them.
SessionRun session_run_of(const ExperimentOptions& o);
// `r` applied to `o` (an empty prompt or template leaves o's); throws InputError naming
// kv_storage when it is neither fp16 nor fp32.
void apply_session_run(const SessionRun& r, ExperimentOptions& o);

struct Session : SessionRun {
  std::string name, description;
  std::string model, image;            // empty = the embedded defaults
  std::vector<Params> methods;
  // Per method (same length as methods, or empty = every method enabled, unlabelled): a display
  // name for tables and legends ("" = its short spec), and whether it runs.
  std::vector<std::string> labels;
  std::vector<bool> enabled;
  // Content hashes (file_content_hash / folder_content_hash) of the model folder and image when
  // saved; empty = not recorded. Opening compares them with the files as they are now.
  std::string model_hash, image_hash;
  // What the desktop app shows (its own keys, read by the app) and a summary of the results at
  // save time (full caption; per method caption, bytes, softmax MSE). JSON objects, or null.
  nlohmann::json views, results;

  bool method_enabled(size_t i) const { return i >= enabled.size() || enabled[i]; }
  std::string method_label(size_t i) const { return i < labels.size() ? labels[i] : std::string(); }
};

// Each method is a spec string ("calibquant:bits=1") or an object {"method": ..., "params": {...}}.
// Throws InputError naming `where` and the offending key or method parameter.
Session session_from_json(const nlohmann::json& j, const std::string& where);
Session load_session(const std::string& path);
nlohmann::json session_to_json(const Session& s);
void save_session(const std::string& path, const Session& s);

}  // namespace kvlens
