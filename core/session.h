// A session: what a researcher set up (model, image, prompt, methods with their parameters,
// diagnostic options) as JSON, so it can be saved, shared and reopened. Method parameters are
// validated by the same schema as CLI specs.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/method.h"

namespace kvlens {

// The session schema this kvlens writes and the newest it reads.
constexpr int kSessionVersion = 1;
// Ranges of the run options, shared by sessions and the command line.
constexpr int kMaxNewTokensLimit = 4096;
constexpr int kMaxDiagSteps = 256;
constexpr double kMinHitBudget = 1e-4;

struct Session {
  std::string name, description;
  std::string model, image;            // empty = the embedded defaults
  std::string prompt, templ;           // empty = the defaults
  int max_new_tokens = 32;
  std::string kv_storage = "fp16";     // dense rows of the decode cache: "fp16" | "fp32"
  int diag_steps = 4;
  double sparsity_p = 0.01;
  double hit_budget = 0.1;
  std::vector<Params> methods;
};

// Each method is a spec string ("calibquant:bits=1") or an object {"method": ..., "params": {...}}.
// Throws InputError naming `where` and the offending key or method parameter.
Session session_from_json(const nlohmann::json& j, const std::string& where);
Session load_session(const std::string& path);
nlohmann::json session_to_json(const Session& s);
void save_session(const std::string& path, const Session& s);

}  // namespace kvlens
