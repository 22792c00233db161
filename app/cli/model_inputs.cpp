#include "app/cli/model_inputs.h"


#include "app/cli/defaults.h"
#include "app/lab/experiment.h"
#include "core/errors.h"
#include "models/tokenizer.h"

namespace kvlens::app {

std::string command_image_path(const Model& model, const std::string& image) {
  if (model.info().takes_image()) return image.empty() ? default_image_for(model.dir()) : image;
  if (!image.empty())
    throw InputError("--image " + image + ": " + model.dir() + " is a text-only model (" + model.info().architecture +
                     "), which takes no image");
  return "";
}

RGBImage command_image(const Model& model, const std::string& image) {
  const std::string path = command_image_path(model, image);
  return path.empty() ? RGBImage{} : load_image(path);
}

std::string prompt_span_line(const Model& model, const PrefillState& st) {
  const PromptSpan s = prompt_span(model, st);
  if (s.n == 0) return "no prompt span marked (<span> ... </span> in --template): methods that act on visual tokens act on none";
  return "the methods' visual segment: prompt tokens " + std::to_string(s.first) + ".." + std::to_string(s.first + s.n - 1) +
         " \"" + s.text + "\"";
}

}  // namespace kvlens::app
