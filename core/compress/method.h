// Compression methods: one parameter schema per method drives CLI flags, GUI widgets,
// session JSON and validation messages. A method spec string reads
//   "calibquant:bits=1,tau1=0,tau2=3"   or   "stack:evict=vlcache,quant=calibquant,budget=0.2"
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/compress/policy.h"

namespace kvlens {

struct ParamSpec {
  enum class Type { Int, Float, Bool, Choice, String };
  std::string name;
  Type type = Type::Float;
  double min = 0, max = 0;              // Int / Float range, inclusive
  std::vector<std::string> choices;     // Choice
  std::string def;                      // default, as text
  std::string help;                     // one line, with the paper's formula where it has one
};

// Validated parameter values of one method (every parameter present, defaults filled in).
class Params {
 public:
  Params() = default;
  Params(std::string method, std::map<std::string, std::string> values)
      : method_(std::move(method)), values_(std::move(values)) {}
  const std::string& method() const { return method_; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string str(const std::string& name) const;
  double num(const std::string& name) const;
  int integer(const std::string& name) const;
  bool flag(const std::string& name) const;
  const std::map<std::string, std::string>& values() const { return values_; }
  // Canonical spec string, e.g. "calibquant:bits=1,tau1=0,tau2=3".
  std::string spec() const;
  // Only the values that differ from the defaults, e.g. "vlcache:budget=0.2" (for tables).
  std::string short_spec() const;
  nlohmann::json to_json() const;

 private:
  std::string method_;
  std::map<std::string, std::string> values_;
};

struct MethodSpec {
  std::string name;
  std::string family;    // "reference", "quantization", "eviction", "merge", "composition"
  std::string summary;   // one line
  std::vector<ParamSpec> params;
  // Named parameter presets, e.g. {"paper", {...}}, {"official", {...}}; `preset=NAME` in a
  // spec applies one before the explicit values.
  std::map<std::string, std::map<std::string, std::string>> presets;
  std::function<std::unique_ptr<KVPolicy>(const Params&)> make;
  // Optional check across values (e.g. a stack's values validated by its inner methods), run
  // when Params are made, so a bad value is refused before any model work.
  std::function<void(const Params&)> check;
  // The method's description of its calibration views, for a method whose decode may calibrate
  // the visual keys' pre-softmax scores with g(x) (parameters "tau1", "tau2"): the Params of
  // the stage that calibrates (the instance itself, or a composition's inner method), or
  // nullopt; and whether those values calibrate now (a mode, a bit-width). Views — the
  // Calibration panel, the report's calibration figures, the τ1/τ2 grid — ask these, never a
  // method's name. Unset: the method never calibrates; `calibrates` unset: always when staged.
  std::function<std::optional<Params>(const Params&)> calibration_stage;
  std::function<bool(const Params&)> calibrates;
};

// τ1 and τ2 of a calibration g(x) of the visual keys' pre-softmax scores.
struct Calibration {
  double tau1 = 0, tau2 = 0;
};
// The Params of the stage of `p` that may calibrate (MethodSpec::calibration_stage), or nullopt.
std::optional<Params> calibration_stage(const Params& p);
// τ1, τ2 of the calibration `p`'s decode applies, or nullopt when it applies none.
std::optional<Calibration> calibration_of(const Params& p);

// Small constructors for parameter schemas.
namespace param {
inline ParamSpec choice(std::string name, std::vector<std::string> choices, std::string def,
                        std::string help) {
  ParamSpec p;
  p.name = std::move(name);
  p.type = ParamSpec::Type::Choice;
  p.choices = std::move(choices);
  p.def = std::move(def);
  p.help = std::move(help);
  return p;
}
inline ParamSpec number(std::string name, ParamSpec::Type type, double min, double max,
                        std::string def, std::string help) {
  ParamSpec p;
  p.name = std::move(name);
  p.type = type;
  p.min = min;
  p.max = max;
  p.def = std::move(def);
  p.help = std::move(help);
  return p;
}
inline ParamSpec real(std::string name, double min, double max, std::string def, std::string help) {
  return number(std::move(name), ParamSpec::Type::Float, min, max, std::move(def), std::move(help));
}
inline ParamSpec integer(std::string name, double min, double max, std::string def, std::string help) {
  return number(std::move(name), ParamSpec::Type::Int, min, max, std::move(def), std::move(help));
}
inline ParamSpec flag(std::string name, std::string def, std::string help) {
  ParamSpec p;
  p.name = std::move(name);
  p.type = ParamSpec::Type::Bool;
  p.def = std::move(def);
  p.help = std::move(help);
  return p;
}
}  // namespace param

// All registered methods, in a stable order.
const std::vector<MethodSpec>& methods();
const MethodSpec& find_method(const std::string& name);  // throws InputError naming the choices

// Parses and validates a spec string; throws InputError such as
//   "calibquant: tau2 must be in [0, 8], got -1".
Params parse_method_spec(const std::string& spec);
// The same from values already parsed (session JSON, GUI widgets, a stack's inner methods):
// `preset` ("" = none) applies first, then each explicit value, each validated by the method's
// schema on its own. Values are never joined into a spec string, so a value cannot carry
// other parameters ("1,tau1=5" is refused as an integer).
Params make_params(const std::string& method, const std::string& preset,
                   const std::map<std::string, std::string>& given);
// Validates one value against its schema (used by parse_method_spec, session JSON and GUI).
std::string validate_param(const std::string& method, const ParamSpec& p, const std::string& value);
std::unique_ptr<KVPolicy> make_policy(const std::string& spec);
std::unique_ptr<KVPolicy> make_policy(const Params& params);

}  // namespace kvlens
