#include "app/cli/model_inputs.h"

#include <algorithm>
#include <vector>

#include "app/cli/defaults.h"
#include "app/lab/experiment.h"
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

std::string prompt_span_line(const Model& model, const PrefillState& st) {
  const auto at = std::find(st.kinds.begin(), st.kinds.end(), SegmentKind::Visual);
  if (at == st.kinds.end() || st.n_visual == 0)
    return "no prompt span marked (<span> ... </span> in --template): methods that act on visual tokens act on none";
  const int first = static_cast<int>(at - st.kinds.begin());
  const std::vector<int> ids(st.ids.begin() + first, st.ids.begin() + first + st.n_visual);
  return "the methods' visual segment: prompt tokens " + std::to_string(first) + ".." + std::to_string(first + st.n_visual - 1) +
         " \"" + model.tokenizer().decode(ids) + "\"";
}

std::string command_template(const Model& model, const std::string& templ) { return model_template(model, templ); }

}  // namespace kvlens::app
