// The table of architectures: config.json's model_type → the loader of the file that implements
// it (LLaVA-NeXT loads through models/llava.cpp, its anyres parts in models/llava_next.cpp). A new
// architecture adds one row here and one file beside models/llava.cpp (its shared
// decoder and decode loop: models/decoder_model.cpp).
#include "models/model.h"

#include <sys/stat.h>

#include "core/errors.h"
#include "core/json_file.h"
#include "models/llama_text.h"
#include "models/internvl.h"
#include "models/llava.h"
#include "models/qwen2_vl.h"

namespace kvlens {

namespace {

struct Architecture {
  const char* model_type;  // config.json's "model_type"
  std::unique_ptr<Model> (*load)(const std::string& dir, const BackendOptions& backend);
};

std::unique_ptr<Model> load_text_only(const std::string& dir, const BackendOptions& be) {
  return std::make_unique<LlamaTextModel>(LlamaTextModel::load(dir, be));
}

std::unique_ptr<Model> load_qwen2_vl(const std::string& dir, const BackendOptions& be) {
  return std::make_unique<Qwen2VLModel>(Qwen2VLModel::load(dir, be));
}

const Architecture kArchitectures[] = {
    {"llava", [](const std::string& dir, const BackendOptions& be) -> std::unique_ptr<Model> {
       return std::make_unique<LlavaModel>(LlavaModel::load(dir, be));
     }},
    {"llava_next", [](const std::string& dir, const BackendOptions& be) -> std::unique_ptr<Model> {
       return std::make_unique<LlavaModel>(LlavaModel::load(dir, be));
     }},
    {"internvl", [](const std::string& dir, const BackendOptions& be) -> std::unique_ptr<Model> {
       return std::make_unique<InternVLModel>(InternVLModel::load(dir, be));
     }},
    {"qwen2_vl", load_qwen2_vl},
    {"qwen2_5_vl", load_qwen2_vl},
    {"llama", load_text_only},
    {"mistral", load_text_only},
    {"qwen2", load_text_only},
};

// config.json's model_type, or "" when the folder, the file or the key is missing or unreadable
// (the first architecture's loader then reports what it expected).
std::string model_type_of(const std::string& dir) {
  const std::string path = dir + "/config.json";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  try {
    const nlohmann::json j = read_json_file(path, "model config");
    return j.is_object() && j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
  } catch (const InputError&) {
    return "";
  }
}

}  // namespace

std::unique_ptr<Model> load_model(const std::string& dir, const BackendOptions& backend) {
  const std::string type = model_type_of(dir);
  for (const Architecture& a : kArchitectures)
    if (type == a.model_type) return a.load(dir, backend);
  if (!type.empty()) {
    std::string known;
    for (const Architecture& a : kArchitectures) known += (known.empty() ? "" : ", ") + std::string(a.model_type);
    throw InputError(dir + "/config.json: model_type '" + type + "' is not one kvlens reads (" + known + ")");
  }
  // Unreadable or without a model_type: the default architecture's loader names the file and
  // what it expects.
  return kArchitectures[0].load(dir, backend);
}

}  // namespace kvlens
