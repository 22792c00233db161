#include "models/config.h"

#include <algorithm>
#include <type_traits>

#include "core/errors.h"
#include "core/json_file.h"
#include "core/numbers.h"

namespace kvlens {

namespace {

// Bounds of the architecture numbers kvlens accepts: far beyond any LLaVA checkpoint, small
// enough that no size computed from them overflows.
constexpr int kMaxWidth = 1 << 16;        // hidden / head sizes
constexpr int kMaxMlp = 1 << 18;          // intermediate sizes
constexpr int kMaxLayers = 512;
constexpr int kMaxHeads = 1024;
constexpr int kMaxVocab = 1 << 24;
constexpr int kMaxImageSide = 8192;
constexpr int kMaxPositions = 1 << 24;
constexpr int kMaxTiles = 64;             // LLaVA-NeXT tiles of one resolution, and resolutions listed

// Strings and booleans: the JSON type must match.
template <typename T>
void get(const nlohmann::json& j, const char* key, T& out, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return;
  if constexpr (std::is_same_v<T, bool>) {
    if (!j[key].is_boolean()) throw InputError(where + ": '" + key + "' must be true or false, got " + j[key].dump());
  } else {
    if (!j[key].is_string()) throw InputError(where + ": '" + key + "' must be a string, got " + j[key].dump());
  }
  out = j[key].get<T>();
}

// Integers and reals: parsed strictly (core/numbers.h), in [lo, hi].
void get_int(const nlohmann::json& j, const char* key, int& out, const std::string& where, int lo, int hi) {
  if (!j.contains(key) || j[key].is_null()) return;
  out = json_int(j[key], where + ": " + key, lo, hi);
}

void get_real(const nlohmann::json& j, const char* key, double& out, const std::string& where, double lo, double hi) {
  if (!j.contains(key) || j[key].is_null()) return;
  out = json_real(j[key], where + ": " + key, lo, hi);
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
  get_int(j, "hidden_size", c.hidden_size, w, 1, kMaxWidth);
  get_int(j, "intermediate_size", c.intermediate_size, w, 1, kMaxMlp);
  get_int(j, "num_hidden_layers", c.num_hidden_layers, w, 1, kMaxLayers);
  get_int(j, "num_attention_heads", c.num_attention_heads, w, 1, kMaxHeads);
  get_int(j, "num_channels", c.num_channels, w, 3, 3);
  get_int(j, "image_size", c.image_size, w, 1, kMaxImageSide);
  get_int(j, "patch_size", c.patch_size, w, 1, kMaxImageSide);
  if (c.patch_size > c.image_size)  // also when one of the two is the default
    throw InputError(w + ": patch_size " + std::to_string(c.patch_size) + " is larger than image_size " +
                     std::to_string(c.image_size) + " (no patch would fit)");
  get(j, "hidden_act", c.hidden_act, w);
  get_real(j, "layer_norm_eps", c.layer_norm_eps, w, 0, 1);
  if (c.hidden_size % c.num_attention_heads != 0)
    throw InputError(w + ": hidden_size " + std::to_string(c.hidden_size) +
                     " is not divisible by num_attention_heads " +
                     std::to_string(c.num_attention_heads));
  return c;
}

// The decoder's keys of object j (LLaVA's text_config, or a text-only config's top level, whose
// model_type may also be mistral: missing keys then take MistralConfig's defaults); `w` names it
// in messages.
LlamaConfig parse_text(const nlohmann::json* jp, const std::string& w, bool mistral_too = false) {
  LlamaConfig c;
  nlohmann::json empty = nlohmann::json::object();
  const nlohmann::json& j = jp ? *jp : empty;
  get(j, "model_type", c.model_type, w);
  // (Qwen2-VL's decoder: "qwen2_vl_text" in text_config, or the hub's flat config, "qwen2_vl")
  const bool qwen_vl = c.model_type == "qwen2_vl_text" || c.model_type == "qwen2_vl" || c.model_type == "qwen2_5_vl_text" ||
                       c.model_type == "qwen2_5_vl";
  if (c.model_type != "llama" && !(mistral_too && (c.model_type == "mistral" || c.model_type == "qwen2" || qwen_vl)))
    throw InputError(w + ": model_type '" + c.model_type + "' is not supported (expected llama" +
                     (mistral_too ? ", mistral or qwen2)" : ")"));
  const bool mistral = c.model_type == "mistral", qwen2 = c.model_type == "qwen2" || qwen_vl;
  if (mistral) c.intermediate_size = 14336, c.max_position_embeddings = 4096 * 32, c.sliding_window = 4096;
  if (qwen2) {
    // Qwen2Config's defaults; biases on q, k and v (not on o), no BOS or EOS unless given.
    c.vocab_size = 151936, c.intermediate_size = 22016, c.max_position_embeddings = 32768;
    c.qkv_bias = true;
    c.bos_token_id = -1;
    c.eos_token_ids.clear();
  }
  get_int(j, "vocab_size", c.vocab_size, w, 1, kMaxVocab);
  get_int(j, "hidden_size", c.hidden_size, w, 1, kMaxWidth);
  get_int(j, "intermediate_size", c.intermediate_size, w, 1, kMaxMlp);
  get_int(j, "num_hidden_layers", c.num_hidden_layers, w, 1, kMaxLayers);
  get_int(j, "num_attention_heads", c.num_attention_heads, w, 1, kMaxHeads);
  c.num_key_value_heads = mistral ? std::min(8, c.num_attention_heads) : c.num_attention_heads;
  get_int(j, "num_key_value_heads", c.num_key_value_heads, w, 1, c.num_attention_heads);
  c.head_dim = std::max(1, c.hidden_size / c.num_attention_heads);
  get_int(j, "head_dim", c.head_dim, w, 1, kMaxWidth);
  if (c.head_dim % 2) throw InputError(w + ": head_dim must be even for rotary embeddings");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw InputError(w + ": num_attention_heads " + std::to_string(c.num_attention_heads) +
                     " is not a multiple of num_key_value_heads " +
                     std::to_string(c.num_key_value_heads));
  get(j, "hidden_act", c.hidden_act, w);
  get_int(j, "max_position_embeddings", c.max_position_embeddings, w, 1, kMaxPositions);
  get_real(j, "rms_norm_eps", c.rms_norm_eps, w, 0, 1);
  double theta = c.rope.theta;
  get_real(j, "rope_theta", theta, w, 1, 1e12);
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (j.contains(key) && j[key].is_object()) {
      const auto& rp = j[key];
      const std::string at = w + "." + key;
      get_real(rp, "rope_theta", theta, at, 1, 1e12);
      std::string type = "default";
      get(rp, "rope_type", type, at);
      if (rp.contains("type") && rp["type"].is_string()) type = rp["type"].get<std::string>();
      if (type == "llama3") {
        // Llama-3.1's scaling: every parameter named, none defaulted.
        auto need = [&](const char* k, double lo, double hi) {
          if (!rp.contains(k) || rp[k].is_null()) throw InputError(at + ": rope_type 'llama3' needs '" + k + "'");
          return json_real(rp[k], at + ": " + k, lo, hi);
        };
        c.rope.type = type;
        c.rope.factor = static_cast<float>(need("factor", 1, 1e6));
        c.rope.low_freq_factor = static_cast<float>(need("low_freq_factor", 1e-6, 1e6));
        c.rope.high_freq_factor = static_cast<float>(need("high_freq_factor", 1e-6, 1e6));
        if (!(c.rope.high_freq_factor > c.rope.low_freq_factor))
          throw InputError(at + ": high_freq_factor " + format_number(c.rope.high_freq_factor) +
                           " must exceed low_freq_factor " + format_number(c.rope.low_freq_factor));
        if (!rp.contains("original_max_position_embeddings"))
          throw InputError(at + ": rope_type 'llama3' needs 'original_max_position_embeddings'");
        c.rope.original_max_position = json_int(rp["original_max_position_embeddings"],
                                                at + ": original_max_position_embeddings", 1, kMaxPositions);
      } else if (type != "default" && !(qwen_vl && type == "mrope")) {
        throw InputError(w + ": " + key + " rope_type '" + type +
                         "' is not supported (the default rotary embedding and llama3's scaling)");
      }
      if (rp.contains("mrope_section") && !rp["mrope_section"].is_null()) {
        // M-RoPE (Qwen2-VL): the head's D/2 frequencies split among temporal, height and width.
        const auto& ms = rp["mrope_section"];
        if (!qwen_vl) throw InputError(at + ": mrope_section is read for qwen2_vl checkpoints only");
        if (!ms.is_array() || ms.size() != 3)
          throw InputError(at + ": mrope_section must list 3 section sizes (temporal, height, width), got " + ms.dump());
        c.rope.sections.clear();
        for (size_t i = 0; i < ms.size(); ++i)
          c.rope.sections.push_back(json_int(ms[i], at + ": mrope_section[" + std::to_string(i) + "]", 1, kMaxWidth));
      }
    }
  }
  c.rope.theta = static_cast<float>(theta);
  if (qwen_vl) {
    if (c.rope.sections.empty()) throw InputError(w + ": no rope_parameters.mrope_section (Qwen2-VL's M-RoPE sections)");
    int sum = 0;
    for (int x : c.rope.sections) sum += x;
    if (sum != c.head_dim / 2)
      throw InputError(w + ": mrope_section sums to " + std::to_string(sum) + "; it must split head_dim / 2 = " +
                       std::to_string(c.head_dim / 2) + " frequencies");
  }
  bool attention_bias = false;
  get(j, "attention_bias", attention_bias, w);
  if (attention_bias) c.qkv_bias = c.o_bias = true;
  get(j, "mlp_bias", c.mlp_bias, w);
  get(j, "tie_word_embeddings", c.tie_word_embeddings, w);
  if (j.contains("sliding_window") && j["sliding_window"].is_null()) c.sliding_window = 0;  // (null: none)
  get_int(j, "sliding_window", c.sliding_window, w, 0, kMaxPositions);
  if (qwen2) {  // Qwen2 slides its window only where use_sliding_window says so
    bool sliding = false;
    get(j, "use_sliding_window", sliding, w);
    if (!sliding) c.sliding_window = 0;
  }
  // Token ids are checked against the vocabulary; -1 is how some configs say "none".
  get_int(j, "bos_token_id", c.bos_token_id, w, -1, c.vocab_size - 1);
  if (j.contains("eos_token_id") && !j["eos_token_id"].is_null()) {
    c.eos_token_ids.clear();
    const auto& e = j["eos_token_id"];
    if (e.is_array()) {
      for (size_t i = 0; i < e.size(); ++i)
        c.eos_token_ids.push_back(json_int(e[i], w + ": eos_token_id[" + std::to_string(i) + "]", 0, c.vocab_size - 1));
    } else {
      c.eos_token_ids.push_back(json_int(e, w + ": eos_token_id", 0, c.vocab_size - 1));
    }
  }
  return c;
}

// LLaVA-NeXT's keys: the grid pinpoints (HF's default list when absent), each a whole number of
// tiles, and a feature selection that leaves each tile a grid of patches.
void parse_anyres(const nlohmann::json& j, const std::string& where, LlavaConfig& c) {
  const int tile = c.vision.image_size;
  c.grid_pinpoints = {{336, 672}, {672, 336}, {672, 672}, {1008, 336}, {336, 1008}};
  if (j.contains("image_grid_pinpoints") && !j["image_grid_pinpoints"].is_null())
    c.grid_pinpoints = parse_grid_pinpoints(j["image_grid_pinpoints"], where + ": image_grid_pinpoints");
  for (size_t i = 0; i < c.grid_pinpoints.size(); ++i) {
    const auto [h, w] = c.grid_pinpoints[i];
    if (h % tile || w % tile)
      throw InputError(where + ": image_grid_pinpoints[" + std::to_string(i) + "] = [" + std::to_string(h) + ", " +
                       std::to_string(w) + "] is not a whole number of " + std::to_string(tile) +
                       "-pixel tiles (vision_config.image_size)");
    if ((h / tile) * (w / tile) > kMaxTiles)
      throw InputError(where + ": image_grid_pinpoints[" + std::to_string(i) + "] = [" + std::to_string(h) + ", " +
                       std::to_string(w) + "] makes " + std::to_string((h / tile) * (w / tile)) +
                       " tiles; kvlens takes at most " + std::to_string(kMaxTiles));
  }
  if (c.vision_feature_select_strategy != "default")
    throw InputError(where + ": vision_feature_select_strategy '" + c.vision_feature_select_strategy +
                     "' does not work with llava_next: each tile's features must be a grid of patches ('default')");
}

}  // namespace

std::vector<std::array<int, 2>> parse_grid_pinpoints(const nlohmann::json& v, const std::string& where) {
  if (!v.is_array() || v.empty())
    throw InputError(where + ": expected a non-empty list of [height, width] pairs, got " + v.dump());
  if (v.size() > static_cast<size_t>(kMaxTiles))
    throw InputError(where + ": lists " + std::to_string(v.size()) + " resolutions; kvlens takes at most " +
                     std::to_string(kMaxTiles));
  std::vector<std::array<int, 2>> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = where + "[" + std::to_string(i) + "]";
    if (!v[i].is_array() || v[i].size() != 2) throw InputError(at + ": expected [height, width], got " + v[i].dump());
    out.push_back({json_int(v[i][0], at + "[0] (height)", 1, kMaxImageSide),
                   json_int(v[i][1], at + "[1] (width)", 1, kMaxImageSide)});
  }
  return out;
}

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
  if (mt != "llava" && mt != "llava_next")
    throw InputError(where + ": model_type '" + mt + "' is not supported (expected 'llava' or 'llava_next')");
  LlavaConfig c;
  c.model_type = mt;
  c.vision = parse_vision(j.contains("vision_config") && j["vision_config"].is_object()
                              ? &j["vision_config"] : nullptr, where);
  c.text = parse_text(j.contains("text_config") && j["text_config"].is_object()
                          ? &j["text_config"] : nullptr, where + ": text_config", true);
  get_int(j, "image_token_index", c.image_token_index, where, 0, c.text.vocab_size - 1);
  get_int(j, "image_token_id", c.image_token_index, where, 0, c.text.vocab_size - 1);
  get(j, "projector_hidden_act", c.projector_hidden_act, where);
  get(j, "multimodal_projector_bias", c.multimodal_projector_bias, where);
  get(j, "vision_feature_select_strategy", c.vision_feature_select_strategy, where);
  if (c.vision_feature_select_strategy != "default" && c.vision_feature_select_strategy != "full")
    throw InputError(where + ": vision_feature_select_strategy '" +
                     c.vision_feature_select_strategy + "' is not 'default' or 'full'");
  if (j.contains("vision_feature_layer") && !j["vision_feature_layer"].is_null()) {
    const auto& fl = j["vision_feature_layer"];
    // Hidden states are 0 (embeddings) .. L; negative indices count from the end (-1 = L).
    const int L = c.vision.num_hidden_layers;
    c.vision_feature_layers.clear();
    if (fl.is_array()) {
      if (fl.empty()) throw InputError(where + ": 'vision_feature_layer' is an empty list, expected at least one layer");
      if (fl.size() > static_cast<size_t>(L + 1))
        throw InputError(where + ": 'vision_feature_layer' lists " + std::to_string(fl.size()) +
                         " layers, the vision tower has " + std::to_string(L + 1) + " hidden states");
      for (size_t i = 0; i < fl.size(); ++i)
        c.vision_feature_layers.push_back(
            json_int(fl[i], where + ": vision_feature_layer[" + std::to_string(i) + "]", -(L + 1), L));
    } else if (fl.is_number()) {
      c.vision_feature_layers.push_back(json_int(fl, where + ": vision_feature_layer", -(L + 1), L));
    } else {
      throw InputError(where + ": 'vision_feature_layer' must be an integer or a list, got " + fl.dump());
    }
  }
  // tie_word_embeddings may sit at the top level or in text_config.
  c.tie_word_embeddings = c.text.tie_word_embeddings;
  get(j, "tie_word_embeddings", c.tie_word_embeddings, where);
  if (c.anyres()) parse_anyres(j, where, c);
  if (c.image_token_index < 0 || c.image_token_index >= c.text.vocab_size)
    throw InputError(where + ": image_token_index " + std::to_string(c.image_token_index) +
                     " is outside the text vocabulary [0, " + std::to_string(c.text.vocab_size) + ")");
  return c;
}

namespace {

// An int, or a [h, w] pair whose two sides are equal (InternViT's image_size and patch_size).
void square_size(const nlohmann::json& j, const char* key, int& out, const std::string& w) {
  if (!j.contains(key) || j[key].is_null()) return;
  const auto& v = j[key];
  if (v.is_array()) {
    if (v.size() != 2) throw InputError(w + ": '" + key + "' must be an integer or [height, width], got " + v.dump());
    const int h = json_int(v[0], w + ": " + key + "[0]", 1, kMaxImageSide), wd = json_int(v[1], w + ": " + key + "[1]", 1, kMaxImageSide);
    if (h != wd) throw InputError(w + ": '" + key + "' " + v.dump() + " is not square (kvlens reads square tiles)");
    out = h;
  } else {
    out = json_int(v, w + ": " + key, 1, kMaxImageSide);
  }
}

InternVLConfig parse_internvl_checked(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": not a JSON object");
  InternVLConfig c;
  const std::string w = where + ": vision_config";
  const nlohmann::json vj = j.contains("vision_config") && j["vision_config"].is_object() ? j["vision_config"] : nlohmann::json::object();
  InternVitConfig& v = c.vision;
  if (vj.contains("model_type") && vj["model_type"] != "internvl_vision")
    throw InputError(w + ": model_type " + vj["model_type"].dump() + " is not supported (expected internvl_vision)");
  get_int(vj, "hidden_size", v.hidden_size, w, 1, kMaxWidth);
  get_int(vj, "intermediate_size", v.intermediate_size, w, 1, kMaxMlp);
  get_int(vj, "num_hidden_layers", v.num_hidden_layers, w, 1, kMaxLayers);
  get_int(vj, "num_attention_heads", v.num_attention_heads, w, 1, kMaxHeads);
  square_size(vj, "image_size", v.image_size, w);
  square_size(vj, "patch_size", v.patch_size, w);
  get(vj, "hidden_act", v.hidden_act, w);
  get(vj, "norm_type", v.norm_type, w);
  get_real(vj, "layer_norm_eps", v.layer_norm_eps, w, 0, 1);
  get(vj, "attention_bias", v.attention_bias, w);
  get(vj, "use_qk_norm", v.use_qk_norm, w);
  get(vj, "use_mean_pooling", v.use_mean_pooling, w);
  get(vj, "use_absolute_position_embeddings", v.use_absolute_position_embeddings, w);
  if (v.norm_type != "layer_norm" && v.norm_type != "rms_norm")
    throw InputError(w + ": norm_type '" + v.norm_type + "' is not 'layer_norm' or 'rms_norm'");
  if (v.hidden_size % v.num_attention_heads)
    throw InputError(w + ": hidden_size " + std::to_string(v.hidden_size) + " is not divisible by num_attention_heads " +
                     std::to_string(v.num_attention_heads));
  if (v.image_size % v.patch_size || v.grid() % 2)
    throw InputError(w + ": image_size " + std::to_string(v.image_size) + " must be an even number of " +
                     std::to_string(v.patch_size) + "-pixel patches (patch_size), for the 2×2 pixel shuffle");
  // The decoder: Qwen2 unless text_config names another.
  nlohmann::json tj = j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : nlohmann::json::object();
  if (!tj.contains("model_type")) tj["model_type"] = "qwen2";
  c.text = parse_text(&tj, where + ": text_config", true);
  get_int(j, "image_token_id", c.image_token_id, where, 0, c.text.vocab_size - 1);
  get_int(j, "image_token_index", c.image_token_id, where, 0, c.text.vocab_size - 1);
  get_real(j, "downsample_ratio", c.downsample_ratio, where, 0, 1);
  if (c.downsample_ratio != 0.5)
    throw InputError(where + ": downsample_ratio " + format_number(c.downsample_ratio) +
                     " is not supported (the 2×2 pixel shuffle of InternVL, 0.5)");
  get(j, "projector_hidden_act", c.projector_hidden_act, where);
  if (j.contains("vision_feature_layer") && !j["vision_feature_layer"].is_null()) {
    if (!j["vision_feature_layer"].is_number_integer())
      throw InputError(where + ": 'vision_feature_layer' must be one integer for internvl, got " + j["vision_feature_layer"].dump());
    c.vision_feature_layer = json_int(j["vision_feature_layer"], where + ": vision_feature_layer", -(v.num_hidden_layers + 1),
                                      v.num_hidden_layers);
  }
  std::string strategy = "default";
  get(j, "vision_feature_select_strategy", strategy, where);
  if (strategy != "default")
    throw InputError(where + ": vision_feature_select_strategy '" + strategy +
                     "' does not work with internvl: the pixel shuffle needs the patches alone ('default')");
  c.tie_word_embeddings = true;
  get(j, "tie_word_embeddings", c.tie_word_embeddings, where);
  return c;
}

}  // namespace

namespace {

Qwen2VLConfig parse_qwen2_vl_checked(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": not a JSON object");
  Qwen2VLConfig c;
  const std::string w = where + ": vision_config";
  const nlohmann::json vj = j.contains("vision_config") && j["vision_config"].is_object() ? j["vision_config"] : nlohmann::json::object();
  Qwen2VitConfig& v = c.vision;
  const bool v25 = j.value("model_type", std::string()) == "qwen2_5_vl";
  const std::string vision_type = v25 ? "qwen2_5_vl_vision" : "qwen2_vl_vision";
  if (vj.contains("model_type") && vj["model_type"] != vision_type && vj["model_type"] != j.value("model_type", std::string()))
    throw InputError(w + ": model_type " + vj["model_type"].dump() + " is not supported (expected " + vision_type + ")");
  get_int(vj, "depth", v.depth, w, 1, kMaxLayers);
  if (v25) {
    // Qwen2.5-VL: hidden_size is the tower's width, out_hidden_size the merger's output; RMSNorm,
    // a gated MLP of intermediate_size, attention within windows but in fullatt_block_indexes.
    v.windowed = true;
    v.hidden_act = "silu";
    v.intermediate_size = 3420;  // (Qwen2_5_VLVisionConfig's defaults)
    get_int(vj, "hidden_size", v.embed_dim, w, 1, kMaxWidth);
    get_int(vj, "out_hidden_size", v.hidden_size, w, 1, kMaxWidth);
    get_int(vj, "intermediate_size", v.intermediate_size, w, 1, kMaxMlp);
    get_int(vj, "window_size", v.window_size, w, 1, 1 << 16);
    if (vj.contains("fullatt_block_indexes") && !vj["fullatt_block_indexes"].is_null()) {
      const auto& f = vj["fullatt_block_indexes"];
      if (!f.is_array()) throw InputError(w + ": fullatt_block_indexes must be a list of block indices, got " + f.dump());
      v.full_attention_blocks.clear();
      for (size_t i = 0; i < f.size(); ++i)
        v.full_attention_blocks.push_back(json_int(f[i], w + ": fullatt_block_indexes[" + std::to_string(i) + "]", 0, v.depth - 1));
    }
  } else {
    get_int(vj, "embed_dim", v.embed_dim, w, 1, kMaxWidth);
    get_int(vj, "hidden_size", v.hidden_size, w, 1, kMaxWidth);
    get_int(vj, "mlp_ratio", v.mlp_ratio, w, 1, 64);
    v.intermediate_size = v.embed_dim * v.mlp_ratio;
  }
  get_int(vj, "num_heads", v.num_heads, w, 1, kMaxHeads);
  get_int(vj, "in_channels", v.in_channels, w, 3, 3);
  get_int(vj, "in_chans", v.in_channels, w, 3, 3);
  get_int(vj, "patch_size", v.patch_size, w, 1, 1024);
  get_int(vj, "spatial_merge_size", v.spatial_merge_size, w, 1, 8);
  get_int(vj, "temporal_patch_size", v.temporal_patch_size, w, 1, 8);
  get(vj, "hidden_act", v.hidden_act, w);
  double vtheta = v.rope_theta;
  if (vj.contains("rope_parameters") && vj["rope_parameters"].is_object()) {
    const auto& rp = vj["rope_parameters"];
    get_real(rp, "rope_theta", vtheta, w + ".rope_parameters", 1, 1e12);
    std::string type = "axial";
    get(rp, "rope_type", type, w + ".rope_parameters");
    if (type != "axial") throw InputError(w + ".rope_parameters: rope_type '" + type + "' is not supported (axial)");
  }
  v.rope_theta = static_cast<float>(vtheta);
  if (v.windowed && (v.window_size % (v.patch_size * v.spatial_merge_size)))
    throw InputError(w + ": window_size " + std::to_string(v.window_size) + " is not a whole number of merged patches (" +
                     std::to_string(v.patch_size * v.spatial_merge_size) + " pixels)");
  if (v.embed_dim % v.num_heads || (v.embed_dim / v.num_heads) % 4)
    throw InputError(w + ": embed_dim " + std::to_string(v.embed_dim) + " over num_heads " + std::to_string(v.num_heads) +
                     " must be a head size divisible by 4 (the height and width rotations)");
  // The decoder: text_config (transformers 5), else the keys at the top level (the hub's layout).
  nlohmann::json tj = j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  const std::string text_type = v25 ? "qwen2_5_vl_text" : "qwen2_vl_text";
  if (!tj.contains("model_type") || tj["model_type"] == j.value("model_type", std::string())) tj["model_type"] = text_type;
  c.text = parse_text(&tj, where + (j.contains("text_config") ? ": text_config" : ""), true);
  if (c.text.model_type != text_type)
    throw InputError(where + ": text_config model_type '" + c.text.model_type + "' is not " + text_type);
  if (v.hidden_size != c.text.hidden_size)
    throw InputError(w + ": hidden_size " + std::to_string(v.hidden_size) + " (the merger's output) differs from the decoder's " +
                     std::to_string(c.text.hidden_size));
  for (auto [key, out] : {std::pair<const char*, int*>{"image_token_id", &c.image_token_id},
                          {"vision_start_token_id", &c.vision_start_token_id},
                          {"vision_end_token_id", &c.vision_end_token_id}})
    get_int(j, key, *out, where, 0, c.text.vocab_size - 1);
  c.tie_word_embeddings = c.text.tie_word_embeddings;
  get(j, "tie_word_embeddings", c.tie_word_embeddings, where);
  return c;
}

}  // namespace

Qwen2VLConfig parse_qwen2_vl_config(const nlohmann::json& j, const std::string& where) {
  try {
    return parse_qwen2_vl_checked(j, where);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": a value has the wrong type (" + e.what() + ")");
  }
}

InternVLConfig parse_internvl_config(const nlohmann::json& j, const std::string& where) {
  try {
    return parse_internvl_checked(j, where);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": a value has the wrong type (" + e.what() + ")");
  }
}

LlavaConfig load_llava_config(const std::string& path) {
  return parse_llava_config(read_json_file(path, "config"), path);
}

LlamaConfig parse_text_only_config(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": not a JSON object");
  if (!j.contains("model_type")) throw InputError(where + ": no model_type (expected llama, mistral or qwen2)");
  try {
    return parse_text(&j, where, true);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": a value of the wrong type (" + e.what() + ")");
  }
}

LlamaConfig load_text_only_config(const std::string& path) {
  return parse_text_only_config(read_json_file(path, "config"), path);
}

}  // namespace kvlens
