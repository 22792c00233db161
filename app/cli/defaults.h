// Where the embedded default model and sample image live.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "core/errors.h"

namespace kvlens::app {

// The embedded models under assets/models, each with the sample image it captions (under
// assets/images); the first is the default.
struct EmbeddedModel {
  std::string name, sample_image;
};
inline const std::vector<EmbeddedModel>& embedded_models() {
  static const std::vector<EmbeddedModel> models = {{"kvlens-scenes-14m", "rich_000.png"},
                                                    {"kvlens-scenes-6m", "scene_000.png"}};
  return models;
}
inline std::string embedded_model_dir(const std::string& name) {
  return std::string(KVLENS_SOURCE_DIR) + "/assets/models/" + name;
}
// The embedded model's folder for its bare name (when no such path exists where kvlens runs),
// else "".
inline std::string embedded_dir_named(const std::string& arg) {
  std::error_code ec;
  if (arg.find('/') == std::string::npos && !std::filesystem::exists(arg, ec))
    for (const EmbeddedModel& m : embedded_models())
      if (arg == m.name) return embedded_model_dir(m.name);
  return "";
}
// The environment variable that names the model a command or the app runs where --model is not
// given (a folder or an embedded model's name).
inline constexpr const char* kModelVariable = "KVLENS_MODEL";
// The model folder used where --model is not given: KVLENS_MODEL's when set, else the first
// embedded model's.
inline std::string default_model_dir() {
  const char* env = std::getenv(kModelVariable);
  if (!env || !*env) return embedded_model_dir(embedded_models().front().name);
  const std::string named = embedded_dir_named(env);
  return named.empty() ? env : named;
}
// What is wrong with KVLENS_MODEL ("" when it is unset or names a folder or an embedded model).
inline std::string model_variable_error() {
  const char* env = std::getenv(kModelVariable);
  std::error_code ec;
  if (!env || !*env || std::filesystem::is_directory(default_model_dir(), ec)) return "";
  std::string names;
  for (const EmbeddedModel& m : embedded_models()) names += (names.empty() ? "" : ", ") + m.name;
  return std::string(kModelVariable) + "='" + env + "' names no model folder and no embedded model (" + names + ")";
}
// The model folder a --model argument names: the default when empty (InputError when
// KVLENS_MODEL is set wrong); an embedded model's folder for its bare name (when no such path
// exists where kvlens runs); else the argument itself.
inline std::string model_dir_of(const std::string& arg) {
  if (arg.empty()) {
    const std::string e = model_variable_error();
    if (!e.empty()) throw InputError(e);
    return default_model_dir();
  }
  const std::string named = embedded_dir_named(arg);
  return named.empty() ? arg : named;
}
// The image a command or the app reads where --image is not given: the sample image of the
// embedded model whose folder `model_dir` is, else the default model's.
inline std::string default_image_for(const std::string& model_dir) {
  const std::string images = std::string(KVLENS_SOURCE_DIR) + "/assets/images/";
  std::error_code ec;
  for (const EmbeddedModel& m : embedded_models())
    if (std::filesystem::equivalent(model_dir, embedded_model_dir(m.name), ec)) return images + m.sample_image;
  return images + embedded_models().front().sample_image;
}
// Pythons asked for pycocoevalcap's METEOR jar: the one on PATH, then the tests' virtual
// environment that setup.sh --tests creates where the system Python is externally managed.
inline std::vector<std::string> meteor_pythons() {
  return {"python3", std::string(KVLENS_SOURCE_DIR) + "/.deps/venv/bin/python3"};
}

}  // namespace kvlens::app
