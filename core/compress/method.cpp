#include "core/compress/method.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "core/errors.h"
#include "core/numbers.h"
#include "core/compress/registry.h"

namespace kvlens {

namespace {

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n";
  const size_t a = s.find_first_not_of(ws);
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(ws);
  return s.substr(a, b - a + 1);
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// Stored values were validated when the Params were made; reading them back cannot fail.
bool parse_double(const std::string& s, double& out) {
  try {
    out = parse_real(s, "value", -HUGE_VAL, HUGE_VAL);
    return true;
  } catch (const InputError&) {
    return false;
  }
}

bool parse_bool(const std::string& s, bool& out) {
  if (s == "on" || s == "true" || s == "1" || s == "yes") return out = true, true;
  if (s == "off" || s == "false" || s == "0" || s == "no") return out = false, true;
  return false;
}


// Splits on `sep` outside brackets, so a nested value such as quant=(calibquant:bits=1,tau2=3)
// stays one item. A closing bracket without its opening one, or an opening one never closed,
// is refused: either would make every later separator part of one item.
std::vector<std::string> split_top(const std::string& method, const std::string& s, char sep) {
  std::vector<std::string> out;
  int depth = 0;
  std::string cur;
  for (char c : s) {
    if (c == '(' || c == '[' || c == '{') ++depth;
    if (c == ')' || c == ']' || c == '}') {
      if (depth == 0)
        throw InputError(method + ": '" + std::string(1, c) + "' closes no bracket in '" + s + "'");
      --depth;
    }
    if (c == sep && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) throw InputError(method + ": a bracket opened in '" + s + "' is never closed");
  out.push_back(cur);
  return out;
}

const ParamSpec* find_param(const MethodSpec& m, const std::string& name) {
  for (const ParamSpec& p : m.params)
    if (p.name == name) return &p;
  return nullptr;
}

std::vector<std::string> param_names(const MethodSpec& m) {
  std::vector<std::string> v;
  for (const ParamSpec& p : m.params) v.push_back(p.name);
  return v;
}

const MethodSpec* lookup(const std::string& name) {
  for (const MethodSpec& m : methods())
    if (m.name == name) return &m;
  return nullptr;
}

}  // namespace

// ---- Params -----------------------------------------------------------------------------------

std::string Params::str(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end())
    throw InternalError(method_ + ": parameter '" + name + "' was not parsed");
  return it->second;
}

double Params::num(const std::string& name) const {
  double x;
  const std::string s = str(name);
  if (!parse_double(s, x)) throw InternalError(method_ + ": parameter " + name + " is not a number: " + s);
  return x;
}

int Params::integer(const std::string& name) const {
  const double x = num(name);
  if (x != std::floor(x) || std::fabs(x) > 2147483647.0)
    throw InternalError(method_ + ": parameter " + name + " is not an integer: " + str(name));
  return static_cast<int>(x);
}

bool Params::flag(const std::string& name) const {
  bool b;
  const std::string s = str(name);
  if (!parse_bool(s, b)) throw InternalError(method_ + ": parameter " + name + " is not on/off: " + s);
  return b;
}

std::string Params::spec() const {
  std::string out = method_;
  std::vector<std::string> items;
  std::set<std::string> done;
  if (const MethodSpec* m = lookup(method_)) {
    for (const ParamSpec& p : m->params) {
      auto it = values_.find(p.name);
      if (it == values_.end()) continue;
      items.push_back(p.name + "=" + it->second);
      done.insert(p.name);
    }
  }
  for (const auto& kv : values_)
    if (!done.count(kv.first)) items.push_back(kv.first + "=" + kv.second);
  if (!items.empty()) out += ":" + join(items, ",");
  return out;
}

std::string Params::short_spec() const {
  std::vector<std::string> items;
  const MethodSpec* m = lookup(method_);
  for (const auto& kv : values_) {
    const ParamSpec* p = m ? find_param(*m, kv.first) : nullptr;
    std::string def;
    if (p) {
      try {
        def = validate_param(method_, *p, p->def);
      } catch (const InputError&) {
        def = p->def;  // pass-through defaults ("default") are not values of their own
      }
    }
    if (!p || kv.second != def) items.push_back(kv.first + "=" + kv.second);
  }
  return items.empty() ? method_ : method_ + ":" + join(items, ",");
}

nlohmann::json Params::to_json() const {
  nlohmann::json params = nlohmann::json::object();
  const MethodSpec* m = lookup(method_);
  for (const auto& kv : values_) {
    const ParamSpec* p = m ? find_param(*m, kv.first) : nullptr;
    double x;
    bool b;
    if (p && p->type == ParamSpec::Type::Int && parse_double(kv.second, x))
      params[kv.first] = static_cast<int64_t>(x);
    else if (p && p->type == ParamSpec::Type::Float && parse_double(kv.second, x))
      params[kv.first] = x;
    else if (p && p->type == ParamSpec::Type::Bool && parse_bool(kv.second, b))
      params[kv.first] = b;
    else
      params[kv.first] = kv.second;
  }
  return {{"method", method_}, {"spec", spec()}, {"params", params}};
}

// ---- registry ---------------------------------------------------------------------------------

const std::vector<MethodSpec>& methods() {
  // Built once; the registry is constant for the life of the program.
  static const std::vector<MethodSpec> all = [] {
    std::vector<MethodSpec> v = quantization_methods();
    for (MethodSpec& m : eviction_methods()) v.push_back(std::move(m));
    std::set<std::string> names;
    for (const MethodSpec& m : v)
      if (!names.insert(m.name).second) throw InternalError("method registry: duplicate method " + m.name);
    return v;
  }();
  return all;
}

const MethodSpec& find_method(const std::string& name) {
  if (const MethodSpec* m = lookup(name)) return *m;
  std::vector<std::string> names;
  for (const MethodSpec& m : methods()) names.push_back(m.name);
  throw InputError("unknown method '" + name + "'; valid methods: " + join(names, ", "));
}

std::optional<Params> calibration_stage(const Params& p) {
  const MethodSpec& m = find_method(p.method());
  return m.calibration_stage ? m.calibration_stage(p) : std::nullopt;
}

std::optional<Calibration> calibration_of(const Params& p) {
  const std::optional<Params> stage = calibration_stage(p);
  if (!stage) return std::nullopt;
  const MethodSpec& m = find_method(stage->method());
  if (m.calibrates && !m.calibrates(*stage)) return std::nullopt;
  return Calibration{stage->num("tau1"), stage->num("tau2")};
}

std::string validate_param(const std::string& method, const ParamSpec& p, const std::string& raw) {
  const std::string value = trim(raw);
  const std::string head = method + ": " + p.name;
  switch (p.type) {
    case ParamSpec::Type::Int:
      return std::to_string(parse_integer(value, head, static_cast<int64_t>(p.min), static_cast<int64_t>(p.max)));
    case ParamSpec::Type::Float:
      return format_number(parse_real(value, head, p.min, p.max));
    case ParamSpec::Type::Bool: {
      bool b;
      if (!parse_bool(value, b))
        throw InputError(head + " must be one of on|off, got '" + value + "'");
      return b ? "on" : "off";
    }
    case ParamSpec::Type::Choice: {
      for (const std::string& c : p.choices)
        if (c == value) return c;
      throw InputError(head + " must be one of " + join(p.choices, "|") + ", got '" + value + "'");
    }
    case ParamSpec::Type::String:
      if (value.empty()) throw InputError(head + " must not be empty");
      return value;
  }
  throw InternalError(head + ": unknown parameter type");
}

Params parse_method_spec(const std::string& text) {
  const std::string spec = trim(text);
  const size_t colon = spec.find(':');
  const std::string name = trim(spec.substr(0, colon));
  if (name.empty()) throw InputError("method spec '" + spec + "' names no method");
  find_method(name);  // an unknown method is named before its parameters are read

  std::map<std::string, std::string> given;  // explicit name=value pairs
  std::string preset;
  if (colon != std::string::npos) {
    const std::string rest = spec.substr(colon + 1);
    if (trim(rest).empty())
      throw InputError(name + ": ':' must be followed by name=value pairs, e.g. '" + name + ":preset=paper'");
    for (const std::string& item_raw : split_top(name, rest, ',')) {
      const std::string item = trim(item_raw);
      if (item.empty()) throw InputError(name + ": empty item in '" + rest + "' (a stray comma?)");
      const size_t eq = item.find('=');
      if (eq == std::string::npos)
        throw InputError(name + ": expected name=value, got '" + item + "'");
      const std::string key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
      if (key == "preset") {
        if (!preset.empty()) throw InputError(name + ": preset given twice");
        if (value.empty()) throw InputError(name + ": preset must name a preset");
        preset = value;
        continue;
      }
      if (given.count(key)) throw InputError(name + ": parameter " + key + " given twice");
      given[key] = value;
    }
  }
  return make_params(name, preset, given);
}

Params make_params(const std::string& name, const std::string& preset,
                   const std::map<std::string, std::string>& given) {
  const MethodSpec& m = find_method(name);
  for (const auto& kv : given)
    if (!find_param(m, kv.first)) {
      const std::vector<std::string> valid = param_names(m);
      throw InputError(name + ": unknown parameter '" + kv.first + "'; valid parameters: " +
                       (valid.empty() ? std::string("none") : join(valid, ", ")) +
                       (m.presets.empty() ? "" : ", preset"));
    }
  std::map<std::string, std::string> values;
  for (const ParamSpec& p : m.params) values[p.name] = validate_param(name, p, p.def);
  if (!preset.empty()) {
    auto it = m.presets.find(preset);
    if (it == m.presets.end()) {
      std::vector<std::string> names;
      for (const auto& kv : m.presets) names.push_back(kv.first);
      throw InputError(name + ": unknown preset '" + preset + "'; valid presets: " +
                       (names.empty() ? std::string("none") : join(names, ", ")));
    }
    for (const auto& kv : it->second) {
      const ParamSpec* p = find_param(m, kv.first);
      if (!p) throw InternalError(name + ": preset " + preset + " sets unknown parameter " + kv.first);
      values[kv.first] = validate_param(name, *p, kv.second);
    }
  }
  for (const auto& kv : given) values[kv.first] = validate_param(name, *find_param(m, kv.first), kv.second);
  Params out(name, std::move(values));
  if (m.check) m.check(out);
  return out;
}

std::unique_ptr<KVPolicy> make_policy(const Params& params) {
  const MethodSpec& m = find_method(params.method());
  if (!m.make) throw InternalError(m.name + ": method has no factory");
  return m.make(params);
}

std::unique_ptr<KVPolicy> make_policy(const std::string& spec) {
  return make_policy(parse_method_spec(spec));
}

}  // namespace kvlens
