#include "app/lab/sweep.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens {

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t b = 0;
  for (;;) {
    const size_t e = s.find(sep, b);
    out.push_back(s.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) return out;
    b = e + 1;
  }
}

}  // namespace

SweepAxis parse_sweep_axis(const std::string& text, const Params& base) {
  const std::string where = "--param " + text;
  const size_t eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw InputError(where + ": expected NAME=START:STOP:STEPS[:log] or NAME=V1,V2,...");
  SweepAxis a;
  a.name = text.substr(0, eq);
  const std::string rhs = text.substr(eq + 1);
  const MethodSpec& m = find_method(base.method());
  const ParamSpec* p = nullptr;
  for (const ParamSpec& s : m.params)
    if (s.name == a.name) p = &s;
  if (!p) {
    std::string names;
    for (const ParamSpec& s : m.params) names += (names.empty() ? "" : ", ") + s.name;
    throw InputError(where + ": " + base.method() + " has no parameter '" + a.name + "' (it has " + names + ")");
  }
  std::vector<std::string> raw;
  if (rhs.find(':') != std::string::npos) {
    const std::vector<std::string> f = split(rhs, ':');
    if (f.size() < 3 || f.size() > 4 || (f.size() == 4 && f[3] != "log"))
      throw InputError(where + ": expected START:STOP:STEPS or START:STOP:STEPS:log");
    if (p->type != ParamSpec::Type::Int && p->type != ParamSpec::Type::Float)
      throw InputError(where + ": " + a.name + " is not numeric; list its values instead (" + a.name + "=a,b,...)");
    const double lo = parse_real(f[0], where + " START", -1e300, 1e300);
    const double hi = parse_real(f[1], where + " STOP", -1e300, 1e300);
    const int steps = static_cast<int>(parse_integer(f[2], where + " STEPS", 1, 10000));
    a.log = f.size() == 4;
    if (a.log && (lo <= 0 || hi <= 0)) throw InputError(where + ": a log axis needs START and STOP > 0");
    for (int i = 0; i < steps; ++i) {
      const double t = steps == 1 ? 0.0 : static_cast<double>(i) / (steps - 1);
      double x = a.log ? lo * std::pow(hi / lo, t) : lo + (hi - lo) * t;
      char buf[32];  // 12 significant digits: 0.2 rather than 0.19999999999999998
      std::snprintf(buf, sizeof buf, "%.12g", x);
      x = std::strtod(buf, nullptr);
      raw.push_back(p->type == ParamSpec::Type::Int ? std::to_string(std::llround(x)) : format_number(x));
    }
  } else {
    raw = split(rhs, ',');
  }
  std::set<std::string> seen;
  for (const std::string& r : raw) {
    const std::string v = validate_param(base.method(), *p, r);  // range and type checks name the value
    if (!seen.insert(v).second) continue;                        // rounding can repeat integers
    a.values.push_back(v);
    double x = std::nan("");
    if (p->type == ParamSpec::Type::Int || p->type == ParamSpec::Type::Float) x = parse_real(v, where, -1e300, 1e300);
    else if (p->type == ParamSpec::Type::Choice) {
      try {
        x = parse_real(v, where, -1e300, 1e300);
      } catch (const InputError&) {
      }
    }
    a.numbers.push_back(x);
  }
  return a;
}

std::vector<std::string> sweep_specs(const Params& base, const std::vector<SweepAxis>& axes) {
  std::vector<std::map<std::string, std::string>> points{base.values()};
  for (const SweepAxis& a : axes) {
    std::vector<std::map<std::string, std::string>> next;
    for (const auto& p : points)
      for (const std::string& v : a.values) {
        auto q = p;
        q[a.name] = v;
        next.push_back(std::move(q));
      }
    points = std::move(next);
  }
  std::vector<std::string> specs;
  for (const auto& p : points) specs.push_back(make_params(base.method(), "", p).spec());
  return specs;
}

std::string sweep_csv(const std::vector<SweepAxis>& axes, const EvalTable& t) {
  std::string s;
  for (const SweepAxis& a : axes) s += a.name + ",";
  s += "BLEU-1,BLEU-2,BLEU-3,BLEU-4,METEOR,ROUGE-L,CIDEr-D,VQA,kv_bytes,ratio,softmax_mse,spec\n";
  for (const EvalRow& r : t.rows) {
    // The full cache first, with empty parameter fields: the reference line of a plot.
    for (const SweepAxis& a : axes) s += (r.variant.params ? r.variant.params->str(a.name) : std::string()) + ",";
    for (const std::string& m : caption_metric_names()) {
      const double v = metric_value(r.scores, m);
      s += (std::isnan(v) ? std::string() : format_number(v)) + ",";
    }
    const auto acc = r.vqa_accuracy();
    s += (acc ? format_number(*acc) : std::string()) + "," + format_number(r.kv_bytes) + "," + format_number(r.ratio) +
         "," + (r.softmax_mse ? format_number(*r.softmax_mse) : std::string()) + ",\"" + r.variant.key + "\"\n";
  }
  return s;
}

}  // namespace kvlens
