#include "models/config.h"

#include <algorithm>
#include <fstream>

#include "core/errors.h"
#include "core/json_file.h"

namespace kvlens {

namespace {

template <typename T>
void get(const nlohmann::json& j, const char* key, T& out, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return;
  try {
    out = j[key].get<T>();
  } catch (const std::exception&) {
    throw InputError(where + ": '" + key + "' has the wrong type (" + j[key].dump() + ")");
  }
}

void positive(int v, const char* key, const std::string& where) {
  if (v <= 0) throw InputError(where + ": '" + key + "' must be positive, got " + std::to_string(v));
}

ClipVisionConfig parse_vision(const nlohmann::json* jp, const std::string& where) {
  ClipVisionConfig c;
  if (!jp) {
    // LlavaConfig's vision tower when vision_config is absent (CLIP ViT-L/14-336).
    c.hidden_size = 1024;
    c.intermediate_size = 4096;
    c.patch_size = 14;
    c.image_size = 336;
    c.num_hidden_layers = 24;
    c.num_attention_heads = 16;
    return c;
  }
  const nlohmann::json& j = *jp;
  const std::string w = where + ": vision_config";
  if (j.contains("model_type") && j["model_type"] != "clip_vision_model" && j["model_type"] != "clip")
    throw InputError(w + ": model_type '" + j["model_type"].get<std::string>() +
                     "' is not supported (expected clip_vision_model)");
  get(j, "hidden_size", c.hidden_size, w);
  get(j, "intermediate_size", c.intermediate_size, w);
  get(j, "num_hidden_layers", c.num_hidden_layers, w);
  get(j, "num_attention_heads", c.num_attention_heads, w);
  get(j, "num_channels", c.num_channels, w);
  get(j, "image_size", c.image_size, w);
  get(j, "patch_size", c.patch_size, w);
  get(j, "hidden_act", c.hidden_act, w);
  get(j, "layer_norm_eps", c.layer_norm_eps, w);
  positive(c.hidden_size, "hidden_size", w);
  positive(c.num_hidden_layers, "num_hidden_layers", w);
  positive(c.num_attention_heads, "num_attention_heads", w);
  positive(c.image_size, "image_size", w);
  positive(c.patch_size, "patch_size", w);
  if (c.hidden_size % c.num_attention_heads != 0)
    throw InputError(w + ": hidden_size " + std::to_string(c.hidden_size) +
                     " is not divisible by num_attention_heads " +
                     std::to_string(c.num_attention_heads));
  if (c.num_channels != 3) throw InputError(w + ": num_channels must be 3");
  return c;
}

LlamaConfig parse_text(const nlohmann::json* jp, const std::string& where) {
  LlamaConfig c;
  nlohmann::json empty = nlohmann::json::object();
  const nlohmann::json& j = jp ? *jp : empty;
  const std::string w = where + ": text_config";
  if (j.contains("model_type") && j["model_type"] != "llama")
    throw InputError(w + ": model_type '" + j["model_type"].get<std::string>() +
                     "' is not supported (expected llama)");
  get(j, "vocab_size", c.vocab_size, w);
  get(j, "hidden_size", c.hidden_size, w);
  get(j, "intermediate_size", c.intermediate_size, w);
  get(j, "num_hidden_layers", c.num_hidden_layers, w);
  get(j, "num_attention_heads", c.num_attention_heads, w);
  c.num_key_value_heads = c.num_attention_heads;
  get(j, "num_key_value_heads", c.num_key_value_heads, w);
  positive(c.hidden_size, "hidden_size", w);
  positive(c.num_attention_heads, "num_attention_heads", w);
  positive(c.num_key_value_heads, "num_key_value_heads", w);
  positive(c.num_hidden_layers, "num_hidden_layers", w);
  positive(c.vocab_size, "vocab_size", w);
  c.head_dim = c.hidden_size / c.num_attention_heads;
  get(j, "head_dim", c.head_dim, w);
  positive(c.head_dim, "head_dim", w);
  if (c.head_dim % 2) throw InputError(w + ": head_dim must be even for rotary embeddings");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw InputError(w + ": num_attention_heads " + std::to_string(c.num_attention_heads) +
                     " is not a multiple of num_key_value_heads " +
                     std::to_string(c.num_key_value_heads));
  get(j, "hidden_act", c.hidden_act, w);
  get(j, "max_position_embeddings", c.max_position_embeddings, w);
  get(j, "rms_norm_eps", c.rms_norm_eps, w);
  get(j, "rope_theta", c.rope_theta, w);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (j.contains(key) && j[key].is_object()) {
      const auto& rp = j[key];
      get(rp, "rope_theta", c.rope_theta, w + "." + key);
      std::string type = "default";
      get(rp, "rope_type", type, w + "." + key);
      if (rp.contains("type") && rp["type"].is_string()) type = rp["type"].get<std::string>();
      if (type != "default")
        throw InputError(w + ": " + key + " rope_type '" + type +
                         "' is not supported (only the default rotary embedding)");
    }
  }
  get(j, "attention_bias", c.attention_bias, w);
  get(j, "mlp_bias", c.mlp_bias, w);
  get(j, "tie_word_embeddings", c.tie_word_embeddings, w);
  get(j, "bos_token_id", c.bos_token_id, w);
  if (j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
    c.eos_token_ids.clear();
    if (j["eos_token_id"].is_array())
      for (const auto& e : j["eos_token_id"]) c.eos_token_ids.push_back(e.get<int>());
    else
      c.eos_token_ids.push_back(j["eos_token_id"].get<int>());
  }
  return c;
}

}  // namespace

static LlavaConfig parse_llava_config_checked(const nlohmann::json& j, const std::string& where);

int LlavaConfig::n_visual_tokens() const {
  return vision.n_patches() + (vision_feature_select_strategy == "full" ? 1 : 0);
}

std::vector<int> LlavaConfig::feature_layer_indices() const {
  std::vector<int> r;
  const int n_states = vision.num_hidden_layers + 1;  // embeddings + each layer
  for (int fl : vision_feature_layers) r.push_back(fl < 0 ? n_states + fl : fl);
  return r;
}

int LlavaConfig::encoder_layers_needed() const {
  const auto idx = feature_layer_indices();
  return *std::max_element(idx.begin(), idx.end());
}

LlavaConfig parse_llava_config(const nlohmann::json& j, const std::string& where) {
  try {
    return parse_llava_config_checked(j, where);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": a value has the wrong type (" + e.what() + ")");
  }
}

static LlavaConfig parse_llava_config_checked(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": not a JSON object");
  const std::string mt = j.value("model_type", std::string());
  if (mt != "llava")
    throw InputError(where + ": model_type '" + mt + "' is not supported (expected 'llava')");
  LlavaConfig c;
  c.vision = parse_vision(j.contains("vision_config") && j["vision_config"].is_object()
                              ? &j["vision_config"] : nullptr, where);
  c.text = parse_text(j.contains("text_config") && j["text_config"].is_object()
                          ? &j["text_config"] : nullptr, where);
  get(j, "image_token_index", c.image_token_index, where);
  get(j, "image_token_id", c.image_token_index, where);
  get(j, "projector_hidden_act", c.projector_hidden_act, where);
  get(j, "multimodal_projector_bias", c.multimodal_projector_bias, where);
  get(j, "vision_feature_select_strategy", c.vision_feature_select_strategy, where);
  if (c.vision_feature_select_strategy != "default" && c.vision_feature_select_strategy != "full")
    throw InputError(where + ": vision_feature_select_strategy '" +
                     c.vision_feature_select_strategy + "' is not 'default' or 'full'");
  if (j.contains("vision_feature_layer") && !j["vision_feature_layer"].is_null()) {
    const auto& fl = j["vision_feature_layer"];
    c.vision_feature_layers.clear();
    if (fl.is_array())
      for (const auto& e : fl) c.vision_feature_layers.push_back(e.get<int>());
    else if (fl.is_number_integer())
      c.vision_feature_layers.push_back(fl.get<int>());
    else
      throw InputError(where + ": 'vision_feature_layer' must be an integer or a list");
  }
  for (int idx : c.feature_layer_indices())
    if (idx < 0 || idx > c.vision.num_hidden_layers)
      throw InputError(where + ": vision_feature_layer selects hidden state " + std::to_string(idx) +
                       ", outside [0, " + std::to_string(c.vision.num_hidden_layers) + "]");
  // tie_word_embeddings may sit at the top level or in text_config.
  c.tie_word_embeddings = c.text.tie_word_embeddings;
  get(j, "tie_word_embeddings", c.tie_word_embeddings, where);
  if (c.image_token_index < 0 || c.image_token_index >= c.text.vocab_size)
    throw InputError(where + ": image_token_index " + std::to_string(c.image_token_index) +
                     " is outside the text vocabulary [0, " + std::to_string(c.text.vocab_size) + ")");
  return c;
}

LlavaConfig load_llava_config(const std::string& path) {
  return parse_llava_config(read_json_file(path, "config"), path);
}

}  // namespace kvlens
