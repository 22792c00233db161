// Where the embedded default model and sample image live.
#pragma once
#include <string>
#include <vector>

namespace kvlens::app {

inline std::string default_model_dir() { return std::string(KVLENS_SOURCE_DIR) + "/assets/models/kvlens-scenes-6m"; }
// Pythons asked for pycocoevalcap's METEOR jar: the one on PATH, then the tests' virtual
// environment that setup.sh --tests creates where the system Python is externally managed.
inline std::vector<std::string> meteor_pythons() {
  return {"python3", std::string(KVLENS_SOURCE_DIR) + "/.deps/venv/bin/python3"};
}
inline std::string default_image() { return std::string(KVLENS_SOURCE_DIR) + "/assets/images/scene_000.png"; }

}  // namespace kvlens::app
