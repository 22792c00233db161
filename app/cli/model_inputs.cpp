#include "app/cli/model_inputs.h"

#include "app/cli/defaults.h"
#include "core/errors.h"
#include "models/tokenizer.h"

namespace kvlens::app {

std::string command_image_path(const Model& model, const std::string& image) {
  if (model.info().takes_image()) return image.empty() ? default_image() : image;
  if (!image.empty())
    throw InputError("--image " + image + ": " + model.dir() + " is a text-only model (" + model.info().architecture +
                     "), which takes no image");
  return "";
}

RGBImage command_image(const Model& model, const std::string& image) {
  const std::string path = command_image_path(model, image);
  return path.empty() ? RGBImage{} : load_image(path);
}

std::string command_template(const Model& model, const std::string& templ) {
  return !model.info().takes_image() && templ == kDefaultTemplate ? "{prompt}" : templ;
}

}  // namespace kvlens::app
