// What a command gives the model it loaded: an image and a template, each as the checkpoint's
// architecture takes them (a text-only model takes no image and no <image> marker).
#pragma once
#include <string>

#include "core/data/image.h"
#include "models/model.h"

namespace kvlens::app {

// --model's help: the architectures a model directory may hold.
inline constexpr const char* kModelHelp =
    "HF-format model directory (LLaVA-1.5, LLaVA-NeXT, InternVL, Qwen2-VL, Qwen2.5-VL, Llama, Mistral or Qwen2), or an "
    "embedded model's name: kvlens-scenes-14m (12 layers, 576 visual tokens, rich scenes) or kvlens-scenes-6m (4 layers, "
    "196 visual tokens, classic scenes). Default: the folder or name KVLENS_MODEL holds, else kvlens-scenes-14m";

// The file --image names, else the sample image; for a text-only model no image, and --image
// is refused (InputError naming the model).
RGBImage command_image(const Model& model, const std::string& image);
// The image file a command reads ("" for a text-only model): --image, else the sample image.
std::string command_image_path(const Model& model, const std::string& image);
// What a text-only model's methods treat as the visual segment: the prompt tokens the template's
// <span> … </span> marks and their text, or that no span is marked.
std::string prompt_span_line(const Model& model, const PrefillState& st);

}  // namespace kvlens::app
