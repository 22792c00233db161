#include "app/lab/session.h"

#include <algorithm>

#include "core/errors.h"
#include "core/json_file.h"
#include "core/numbers.h"

namespace kvlens {

SessionRun session_run_of(const ExperimentOptions& o) {
  SessionRun r;
  r.prompt = o.prompt;
  r.templ = o.templ;
  r.max_new_tokens = o.max_new_tokens;
  r.kv_storage = row_storage_name(o.kv_storage);
  r.diag_steps = o.diag_steps;
  r.sparsity_p = o.sparsity_p;
  r.hit_budget = o.hit_budget;
  return r;
}

void apply_session_run(const SessionRun& r, ExperimentOptions& o) {
  if (!r.prompt.empty()) o.prompt = r.prompt;
  if (!r.templ.empty()) o.templ = r.templ;
  o.max_new_tokens = r.max_new_tokens;
  o.kv_storage = parse_row_storage(r.kv_storage, "kv_storage");
  o.diag_steps = r.diag_steps;
  o.sparsity_p = r.sparsity_p;
  o.hit_budget = r.hit_budget;
}

namespace {

// A method parameter's JSON value as the text the schema validates: strings as they are,
// numbers in their shortest form, booleans as on/off. Lists and objects are not values.
std::string param_text(const nlohmann::json& v, const std::string& at) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "on" : "off";
  if (v.is_number_integer() || v.is_number_unsigned()) return v.dump();
  if (v.is_number_float()) return format_number(v.get<double>());
  throw InputError(at + " must be a string, number or boolean, got " + v.dump());
}

std::string text_field(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key)) return {};
  if (!j[key].is_string()) throw InputError(where + ": '" + key + "' must be a string, got " + j[key].dump());
  return j[key].get<std::string>();
}

Params method_from_json(const nlohmann::json& m, const std::string& at) {
  if (m.is_string()) return parse_method_spec(m.get<std::string>());
  if (!m.is_object() || !m.contains("method") || !m["method"].is_string())
    throw InputError("expected a spec string or {\"method\": ..., \"params\": {...}}");
  for (auto it = m.begin(); it != m.end(); ++it)
    if (it.key() != "method" && it.key() != "params" && it.key() != "preset" && it.key() != "label" &&
        it.key() != "enabled")
      throw InputError("unknown key '" + it.key() + "' (expected method, params, preset, label, enabled)");
  const std::string name = m["method"].get<std::string>();
  std::string preset = text_field(m, "preset", at);
  std::map<std::string, std::string> given;
  if (m.contains("params")) {
    if (!m["params"].is_object()) throw InputError("'params' must be an object");
    for (auto it = m["params"].begin(); it != m["params"].end(); ++it) {
      const std::string value = param_text(it.value(), name + ": " + it.key());
      if (it.key() == "preset") {
        if (!preset.empty()) throw InputError(name + ": preset given twice");
        preset = value;
      } else {
        given[it.key()] = value;
      }
    }
  }
  return make_params(name, preset, given);
}

}  // namespace

Session session_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": a session is a JSON object");
  static const char* known[] = {"name",       "description", "model",          "image",      "prompt",
                                "template",   "max_new_tokens", "kv_storage",   "diag_steps", "sparsity_p",
                                "hit_budget", "methods",     "kvlens_session", "model_hash", "image_hash",
                                "views",      "results"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(std::begin(known), std::end(known), it.key()) == std::end(known))
      throw InputError(where + ": unknown key '" + it.key() + "'");
  // A hand-written session may leave the version out: it then reads as version 1.
  const nlohmann::json ver = j.contains("kvlens_session") ? j["kvlens_session"] : nlohmann::json(1);
  if (!(ver.is_number_integer() || ver.is_number_unsigned()) || ver.get<int64_t>() < 1)
    throw InputError(where + ": 'kvlens_session' must be a version number >= 1, got " + ver.dump());
  if (ver.get<int64_t>() > kSessionVersion)
    throw InputError(where + ": session version " + ver.dump() + " is newer than this kvlens reads (version " +
                     std::to_string(kSessionVersion) + "); open it with a newer kvlens");
  Session s;
  s.name = text_field(j, "name", where);
  s.description = text_field(j, "description", where);
  s.model = text_field(j, "model", where);
  s.image = text_field(j, "image", where);
  s.prompt = text_field(j, "prompt", where);
  s.templ = text_field(j, "template", where);
  if (j.contains("kv_storage")) {
    s.kv_storage = text_field(j, "kv_storage", where);
    parse_row_storage(s.kv_storage, where + ": kv_storage");
  }
  s.model_hash = text_field(j, "model_hash", where);
  s.image_hash = text_field(j, "image_hash", where);
  for (auto [key, out] : {std::pair{"views", &s.views}, {"results", &s.results}})
    if (j.contains(key) && !j[key].is_null()) {
      if (!j[key].is_object()) throw InputError(where + ": '" + key + "' must be an object, got " + j[key].dump());
      *out = j[key];
    }
  const std::string w = where + ": ";
  if (j.contains("max_new_tokens")) s.max_new_tokens = json_int(j["max_new_tokens"], w + "max_new_tokens", 1, kMaxNewTokensLimit);
  if (j.contains("diag_steps")) s.diag_steps = json_int(j["diag_steps"], w + "diag_steps", 1, kMaxDiagSteps);
  if (j.contains("sparsity_p")) s.sparsity_p = json_real(j["sparsity_p"], w + "sparsity_p", 0, 1);
  if (j.contains("hit_budget")) s.hit_budget = json_real(j["hit_budget"], w + "hit_budget", kMinHitBudget, 1);
  if (j.contains("methods")) {
    if (!j["methods"].is_array()) throw InputError(where + ": 'methods' must be a list");
    for (size_t i = 0; i < j["methods"].size(); ++i) {
      const std::string at = where + ": methods[" + std::to_string(i) + "]";
      const nlohmann::json& m = j["methods"][i];
      try {
        s.methods.push_back(method_from_json(m, at));
      } catch (const InputError& e) {
        throw InputError(at + ": " + e.what());
      }
      s.labels.push_back(m.is_object() ? text_field(m, "label", at) : std::string());
      bool on = true;
      if (m.is_object() && m.contains("enabled")) {
        if (!m["enabled"].is_boolean()) throw InputError(at + ": 'enabled' must be true or false, got " + m["enabled"].dump());
        on = m["enabled"].get<bool>();
      }
      s.enabled.push_back(on);
    }
  }
  return s;
}

Session load_session(const std::string& path) {
  return session_from_json(read_json_file(path, "session file"), path);
}

nlohmann::json session_to_json(const Session& s) {
  nlohmann::json j;
  j["kvlens_session"] = kSessionVersion;
  j["name"] = s.name;
  j["description"] = s.description;
  j["model"] = s.model;
  j["image"] = s.image;
  j["prompt"] = s.prompt;
  j["template"] = s.templ;
  j["max_new_tokens"] = s.max_new_tokens;
  j["kv_storage"] = s.kv_storage;
  j["diag_steps"] = s.diag_steps;
  j["sparsity_p"] = s.sparsity_p;
  j["hit_budget"] = s.hit_budget;
  if (!s.model_hash.empty()) j["model_hash"] = s.model_hash;
  if (!s.image_hash.empty()) j["image_hash"] = s.image_hash;
  j["methods"] = nlohmann::json::array();
  for (size_t i = 0; i < s.methods.size(); ++i) {
    const Params& p = s.methods[i];
    nlohmann::json pj = p.to_json();
    nlohmann::json m = {{"method", p.method()}, {"params", pj.contains("params") ? pj["params"] : nlohmann::json::object()}};
    if (!s.method_label(i).empty()) m["label"] = s.method_label(i);
    if (!s.method_enabled(i)) m["enabled"] = false;
    j["methods"].push_back(m);
  }
  if (s.views.is_object()) j["views"] = s.views;
  if (s.results.is_object()) j["results"] = s.results;
  return j;
}

void save_session(const std::string& path, const Session& s) {
  write_file_atomic(path, session_to_json(s).dump(2) + "\n", "session file");
}

}  // namespace kvlens
