// Where the embedded default model and sample image live.
#pragma once
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace kvlens::app {

// The embedded models under assets/models; the first is the default.
inline const std::vector<std::string>& embedded_model_names() {
  static const std::vector<std::string> names = {"kvlens-scenes-6m", "kvlens-scenes-14m"};
  return names;
}
inline std::string embedded_model_dir(const std::string& name) {
  return std::string(KVLENS_SOURCE_DIR) + "/assets/models/" + name;
}
inline std::string default_model_dir() { return embedded_model_dir(embedded_model_names().front()); }
// The model folder a --model argument names: the default when empty; an embedded model's folder
// for its bare name (when no such path exists where kvlens runs); else the argument itself.
inline std::string model_dir_of(const std::string& arg) {
  if (arg.empty()) return default_model_dir();
  std::error_code ec;
  if (arg.find('/') == std::string::npos && !std::filesystem::exists(arg, ec))
    for (const std::string& name : embedded_model_names())
      if (arg == name) return embedded_model_dir(name);
  return arg;
}
// Pythons asked for pycocoevalcap's METEOR jar: the one on PATH, then the tests' virtual
// environment that setup.sh --tests creates where the system Python is externally managed.
inline std::vector<std::string> meteor_pythons() {
  return {"python3", std::string(KVLENS_SOURCE_DIR) + "/.deps/venv/bin/python3"};
}
inline std::string default_image() { return std::string(KVLENS_SOURCE_DIR) + "/assets/images/scene_000.png"; }

}  // namespace kvlens::app
