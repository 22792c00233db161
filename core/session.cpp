#include "core/session.h"

#include <algorithm>

#include "core/errors.h"
#include "core/json_file.h"

namespace kvlens {

namespace {

std::string param_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "on" : "off";
  return v.dump();
}

}  // namespace

Session session_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": a session is a JSON object");
  static const char* known[] = {"name", "description", "model", "image", "prompt", "template", "max_new_tokens",
                                "kv_storage", "diag_steps", "sparsity_p", "hit_budget", "methods", "kvlens_session"};
  for (auto it = j.begin(); it != j.end(); ++it)
    if (std::find(std::begin(known), std::end(known), it.key()) == std::end(known))
      throw InputError(where + ": unknown key '" + it.key() + "'");
  Session s;
  try {
    s.name = j.value("name", std::string());
    s.description = j.value("description", std::string());
    s.model = j.value("model", std::string());
    s.image = j.value("image", std::string());
    s.prompt = j.value("prompt", std::string());
    s.templ = j.value("template", std::string());
    s.max_new_tokens = j.value("max_new_tokens", s.max_new_tokens);
    s.kv_storage = j.value("kv_storage", s.kv_storage);
    s.diag_steps = j.value("diag_steps", s.diag_steps);
    s.sparsity_p = j.value("sparsity_p", s.sparsity_p);
    s.hit_budget = j.value("hit_budget", s.hit_budget);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": a value has the wrong type (" + e.what() + ")");
  }
  if (s.max_new_tokens < 1) throw InputError(where + ": max_new_tokens must be at least 1");
  parse_row_storage(s.kv_storage, where + ": kv_storage");
  if (s.diag_steps < 1) throw InputError(where + ": diag_steps must be at least 1");
  if (s.sparsity_p < 0 || s.sparsity_p > 1) throw InputError(where + ": sparsity_p must be in [0, 1]");
  if (s.hit_budget <= 0 || s.hit_budget > 1) throw InputError(where + ": hit_budget must be in (0, 1]");
  if (j.contains("methods")) {
    if (!j["methods"].is_array()) throw InputError(where + ": 'methods' must be a list");
    for (size_t i = 0; i < j["methods"].size(); ++i) {
      const auto& m = j["methods"][i];
      const std::string at = where + ": methods[" + std::to_string(i) + "]";
      std::string spec;
      if (m.is_string()) {
        spec = m.get<std::string>();
      } else if (m.is_object() && m.contains("method") && m["method"].is_string()) {
        spec = m["method"].get<std::string>();
        if (m.contains("params")) {
          if (!m["params"].is_object()) throw InputError(at + ": 'params' must be an object");
          bool first = true;
          for (auto it = m["params"].begin(); it != m["params"].end(); ++it) {
            spec += (first ? ":" : ",") + it.key() + "=" + param_text(it.value());
            first = false;
          }
        }
      } else {
        throw InputError(at + ": expected a spec string or {\"method\": ..., \"params\": {...}}");
      }
      try {
        s.methods.push_back(parse_method_spec(spec));
      } catch (const InputError& e) {
        throw InputError(at + ": " + e.what());
      }
    }
  }
  return s;
}

Session load_session(const std::string& path) {
  return session_from_json(read_json_file(path, "session file"), path);
}

nlohmann::json session_to_json(const Session& s) {
  nlohmann::json j;
  j["kvlens_session"] = 1;
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
  j["methods"] = nlohmann::json::array();
  for (const Params& p : s.methods) {
    nlohmann::json pj = p.to_json();
    j["methods"].push_back({{"method", p.method()}, {"params", pj.contains("params") ? pj["params"] : nlohmann::json::object()}});
  }
  return j;
}

void save_session(const std::string& path, const Session& s) {
  write_file_atomic(path, session_to_json(s).dump(2) + "\n", "session file");
}

}  // namespace kvlens
