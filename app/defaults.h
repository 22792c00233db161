// Where the embedded default model and sample image live.
#pragma once
#include <string>

namespace kvlens::app {

inline std::string default_model_dir() { return std::string(KVLENS_SOURCE_DIR) + "/assets/models/kvlens-scenes-6m"; }
inline std::string default_image() { return std::string(KVLENS_SOURCE_DIR) + "/assets/images/scene_000.png"; }

}  // namespace kvlens::app
