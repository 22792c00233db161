#include "models/chat_template.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>
#include <stdexcept>
#include <vector>

#include "core/errors.h"
#include "models/chat_template_parse.h"

namespace kvlens {

namespace {

using namespace chat_detail;

// An integer argument (a Python int within 64 bits); `what` names it where it is not one.
int64_t as_int(const json& v, const std::string& what) {
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) fail(what + " beyond 64 bits");
  if (!v.is_number_integer()) fail(what + " must be an integer, got " + py_repr(v));
  return v.get<int64_t>();
}


struct Jump {
  bool brk;
};

class Renderer {
 public:
  explicit Renderer(const json& ctx) {
    scopes_.emplace_back();
    for (const auto& [k, v] : ctx.items()) scopes_.back()[k] = v;
  }

  void run(const Body& b, std::string& out) {
    for (const auto& n : b) {
      if (++steps_ > kMaxSteps) fail("the template runs more than " + std::to_string(kMaxSteps) + " statements");
      node(*n, out);
      if (out.size() > kMaxOutput) fail("the rendering grows past " + std::to_string(kMaxOutput) + " bytes");
    }
  }

 private:
  void node(const Node& n, std::string& out) {
    try {
      switch (n.kind) {
        case Node::Text: out += n.text; break;
        case Node::Out: out += py_str(eval(*n.exprs[0])); break;
        case Node::Block: run(n.bodies[0], out); break;
        case Node::Break: throw Jump{true};
        case Node::Continue: throw Jump{false};
        case Node::If: {
          for (size_t k = 0; k < n.exprs.size(); ++k)
            if (truthy(eval(*n.exprs[k]))) return run(n.bodies[k], out);
          if (n.has_else) run(n.bodies.back(), out);
          break;
        }
        case Node::Set: {
          Val v = eval(*n.exprs[0]);
          if (n.targets.size() == 2) {
            json* obj = lookup(n.targets[0]);
            if (!obj || !obj->is_object()) fail("'" + n.targets[0] + "' is not a namespace");
            (*obj)[n.targets[1]] = v.j;
          } else {
            scopes_.back()[n.targets[0]] = v.j;
          }
          break;
        }
        case Node::For: loop(n, out); break;
      }
    } catch (const Error& e) {
      if (e.what.rfind("line ", 0) == 0) throw;
      fail("line " + std::to_string(n.line) + ": " + e.what);
    }
  }

  void loop(const Node& n, std::string& out) {
    const Val it = eval(*n.exprs[0]);
    json items = json::array();
    if (it.j.is_array()) items = it.j;
    else if (it.j.is_object()) for (const auto& [k, v] : it.j.items()) items.push_back(k);
    else if (it.j.is_string()) for (char c : it.j.get<std::string>()) items.push_back(std::string(1, c));
    else if (!it.undef && !it.j.is_null()) fail("cannot loop over " + py_repr(it.j));
    if (n.exprs.size() > 1) {  // the loop's filter, before loop.length counts the items
      json kept = json::array();
      for (const json& x : items) {
        if (++steps_ > kMaxSteps) fail("the template runs more than " + std::to_string(kMaxSteps) + " statements");
        scopes_.emplace_back();
        if (n.targets.size() == 1) scopes_.back()[n.targets[0]] = x;
        else for (size_t k = 0; k < n.targets.size() && x.is_array() && k < x.size(); ++k) scopes_.back()[n.targets[k]] = x[k];
        const bool keep = truthy(eval(*n.exprs[1]));
        scopes_.pop_back();
        if (keep) kept.push_back(x);
      }
      items = kept;
    }
    if (items.empty()) {
      if (n.has_else) run(n.bodies[1], out);
      return;
    }
    const size_t N = items.size();
    for (size_t i = 0; i < N; ++i) {
      if (++steps_ > kMaxSteps) fail("the template runs more than " + std::to_string(kMaxSteps) + " statements");
      scopes_.emplace_back();
      auto& sc = scopes_.back();
      if (n.targets.size() == 1) {
        sc[n.targets[0]] = items[i];
      } else {
        if (!items[i].is_array() || items[i].size() != n.targets.size())
          fail("cannot unpack " + py_repr(items[i]) + " into " + std::to_string(n.targets.size()) + " variables");
        for (size_t k = 0; k < n.targets.size(); ++k) sc[n.targets[k]] = items[i][k];
      }
      sc["loop"] = {{"index0", i}, {"index", i + 1}, {"revindex", N - i}, {"revindex0", N - i - 1},
                    {"first", i == 0}, {"last", i + 1 == N}, {"length", N},
                    {"previtem", i > 0 ? items[i - 1] : json()}, {"nextitem", i + 1 < N ? items[i + 1] : json()}};
      bool stop = false;
      try {
        run(n.bodies[0], out);
      } catch (const Jump& j) {
        stop = j.brk;
      }
      scopes_.pop_back();
      if (stop) break;
    }
  }

  json* lookup(const std::string& name) {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return &f->second;
    }
    return nullptr;
  }

  static Val item(const Val& o, const json& key) {
    if (o.undef) fail("an undefined value has no item " + py_repr(key));
    if (o.j.is_object() && key.is_string()) {
      auto f = o.j.find(key.get<std::string>());
      return f == o.j.end() ? Val::undefined() : V(*f);
    }
    if ((o.j.is_array() || o.j.is_string()) && key.is_number_integer()) {
      const int64_t n = o.j.is_array() ? static_cast<int64_t>(o.j.size()) : static_cast<int64_t>(o.j.get_ref<const std::string&>().size());
      int64_t k = key.get<int64_t>();
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Val::undefined();
      return o.j.is_array() ? V(o.j[static_cast<size_t>(k)]) : V(std::string(1, o.j.get_ref<const std::string&>()[static_cast<size_t>(k)]));
    }
    return Val::undefined();
  }

  Val eval(const Expr& e) {
    switch (e.kind) {
      case Expr::Lit: return e.negated ? Val::undefined() : V(e.lit);
      case Expr::Name: {
        if (json* v = lookup(e.name)) return V(*v);
        return Val::undefined();
      }
      case Expr::List: {
        json a = json::array();
        for (const auto& k : e.kids) a.push_back(eval(*k).j);
        return V(a);
      }
      case Expr::Dict: {
        json o = json::object();
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) o[py_str(eval(*e.kids[k]))] = eval(*e.kids[k + 1]).j;
        return V(o);
      }
      case Expr::Attr: {
        const Val o = eval(*e.kids[0]);
        if (o.undef) fail("an undefined value has no attribute '" + e.name + "'");
        return item(o, json(e.name));
      }
      case Expr::Index: return item(eval(*e.kids[0]), eval(*e.kids[1]).j);
      case Expr::Slice: return slice(e);
      case Expr::Call: return call(e);
      case Expr::Filter: return filter(e);
      case Expr::Test: {
        const bool r = test(e);
        return V(e.negated ? !r : r);
      }
      case Expr::Neg: {
        const Val v = eval(*e.kids[0]);
        if (!v.j.is_number()) fail("cannot negate " + py_repr(v.j));
        if (v.j.is_number_float()) return V(-v.j.get<double>());
        const int64_t x = as_int(v.j, "a negated number");
        if (x == INT64_MIN) fail("an integer beyond 64 bits");
        return V(-x);
      }
      case Expr::Not: return V(!truthy(eval(*e.kids[0])));
      case Expr::And: {
        const Val a = eval(*e.kids[0]);
        return truthy(a) ? eval(*e.kids[1]) : a;
      }
      case Expr::Or: {
        const Val a = eval(*e.kids[0]);
        return truthy(a) ? a : eval(*e.kids[1]);
      }
      case Expr::Cond: return truthy(eval(*e.kids[1])) ? eval(*e.kids[0]) : eval(*e.kids[2]);
      case Expr::In: {
        const Val a = eval(*e.kids[0]), b = eval(*e.kids[1]);
        bool r = false;
        if (b.j.is_string()) r = a.j.is_string() && b.j.get<std::string>().find(a.j.get<std::string>()) != std::string::npos;
        else if (b.j.is_array()) r = std::find(b.j.begin(), b.j.end(), a.j) != b.j.end();
        else if (b.j.is_object()) r = a.j.is_string() && b.j.contains(a.j.get<std::string>());
        else if (!b.undef) fail("'in' needs a string, list or mapping, got " + py_repr(b.j));
        return V(e.negated ? !r : r);
      }
      case Expr::Bin: return binary(e.name, eval(*e.kids[0]), eval(*e.kids[1]));
    }
    fail("an expression of an unknown kind");
  }

  Val slice(const Expr& e) {
    const Val o = eval(*e.kids[0]);
    auto opt = [&](int k, int64_t def) {
      return e.kids[static_cast<size_t>(k)] ? as_int(eval(*e.kids[static_cast<size_t>(k)]).j, "a slice index") : def;
    };
    const bool str = o.j.is_string();
    if (!str && !o.j.is_array()) fail("cannot slice " + py_repr(o.j));
    const int64_t n = str ? static_cast<int64_t>(o.j.get_ref<const std::string&>().size()) : static_cast<int64_t>(o.j.size());
    const int64_t step = opt(3, 1);
    if (step == 0) fail("a slice step of 0");
    auto norm = [&](int64_t x, int64_t lo, int64_t hi) {
      if (x < 0) x += n;
      return std::clamp(x, lo, hi);
    };
    const int64_t a = e.kids[1] ? norm(opt(1, 0), step > 0 ? 0 : -1, step > 0 ? n : n - 1) : (step > 0 ? 0 : n - 1);
    const int64_t b = e.kids[2] ? norm(opt(2, 0), step > 0 ? 0 : -1, step > 0 ? n : n - 1) : (step > 0 ? n : -1);
    json r = str ? json(std::string()) : json::array();
    for (int64_t k = a; step > 0 ? k < b : k > b; k += step) {
      if (str) r.get_ref<std::string&>() += o.j.get_ref<const std::string&>()[static_cast<size_t>(k)];
      else r.push_back(o.j[static_cast<size_t>(k)]);
    }
    return V(r);
  }

  Val binary(const std::string& op, const Val& a, const Val& b) {
    if (op == "==") return V(!a.undef && !b.undef ? a.j == b.j : a.undef == b.undef);
    if (op == "!=") return V(!(!a.undef && !b.undef ? a.j == b.j : a.undef == b.undef));
    auto bounded = [&](Val v) {
      const size_t n = v.j.is_string() ? v.j.get_ref<const std::string&>().size() : v.j.is_array() ? v.j.size() : 0;
      if (n > kMaxOutput) fail("a value grows past " + std::to_string(kMaxOutput) + " items");
      charge(n);
      return v;
    };
    if (op == "~") return bounded(V(py_str(a) + py_str(b)));
    if (a.undef || b.undef) fail("'" + op + "' on an undefined value");
    const json &x = a.j, &y = b.j;
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      if (!((x.is_number() && y.is_number()) || (x.is_string() && y.is_string())))
        fail("cannot compare " + py_repr(x) + " and " + py_repr(y));
      const bool lt = x < y, gt = y < x;
      return V(op == "<" ? lt : op == ">" ? gt : op == "<=" ? !gt : !lt);
    }
    if (op == "+") {
      if (x.is_string() && y.is_string()) return bounded(V(x.get<std::string>() + y.get<std::string>()));
      if (x.is_array() && y.is_array()) {
        if (x.size() + y.size() > kMaxOutput) fail("a list grows past " + std::to_string(kMaxOutput) + " items");
        charge(x.size() + y.size());
        json r = x;
        for (const json& v : y) r.push_back(v);
        return V(r);
      }
    }
    if (op == "*" && x.is_string() && y.is_number_integer()) {
      if (y.get<int64_t>() > 0 && static_cast<double>(x.get_ref<const std::string&>().size()) * static_cast<double>(y.get<int64_t>()) > kMaxOutput)
        fail("a repeated string longer than " + std::to_string(kMaxOutput) + " bytes");
      std::string r;
      if (!x.get_ref<const std::string&>().empty())  // ('' * n is '' for any n)
        for (int64_t k = 0; k < y.get<int64_t>(); ++k) r += x.get<std::string>();
      return bounded(V(r));
    }
    if (!x.is_number() || !y.is_number()) fail("'" + op + "' on " + py_repr(x) + " and " + py_repr(y));
    const bool ints = x.is_number_integer() && y.is_number_integer();
    const double p = x.get<double>(), q = y.get<double>();
    const int64_t i = ints ? as_int(x, "an operand") : 0, k = ints ? as_int(y, "an operand") : 0;
    int64_t r = 0;
    if (op == "+" || op == "-" || op == "*") {
      if (!ints) return V(op == "+" ? p + q : op == "-" ? p - q : p * q);
      const bool over = op == "+" ? __builtin_add_overflow(i, k, &r) : op == "-" ? __builtin_sub_overflow(i, k, &r)
                                                                           : __builtin_mul_overflow(i, k, &r);
      if (over) fail("an integer beyond 64 bits");
      return V(r);
    }
    if (q == 0 && (op == "/" || op == "//" || op == "%")) fail("division by zero");
    if (op == "/") return V(p / q);
    if (ints && (op == "//" || op == "%")) {  // Python's: the quotient floored, the remainder of the divisor's sign
      if (k == -1) {
        if (op == "%") return V(int64_t{0});
        if (i == INT64_MIN) fail("an integer beyond 64 bits");
        return V(-i);
      }
      const int64_t quo = i / k, rem = i % k;
      const bool adjust = rem != 0 && ((rem < 0) != (k < 0));
      return op == "//" ? V(adjust ? quo - 1 : quo) : V(adjust ? rem + k : rem);
    }
    if (op == "//") return V(std::floor(p / q));
    if (op == "%") return V(p - q * std::floor(p / q));
    if (op == "**") {
      if (!ints || k < 0) return V(std::pow(p, q));
      int64_t acc = 1;  // at most 63 products before the result leaves 64 bits (unless |i| <= 1)
      if (i == 0 || i == 1) return V(k == 0 ? int64_t{1} : i);
      if (i == -1) return V(k % 2 ? int64_t{-1} : int64_t{1});
      for (int64_t n = 0; n < k; ++n) {
        int64_t next = 0;
        if (__builtin_mul_overflow(acc, i, &next)) fail("an integer beyond 64 bits");
        acc = next;
      }
      return V(acc);
    }
    fail("unknown operator '" + op + "'");
  }

  std::vector<Val> args(const Expr& e, size_t from) {
    std::vector<Val> r;
    for (size_t k = from; k < e.kids.size(); ++k) r.push_back(eval(*e.kids[k]));
    return r;
  }
  Val kwarg(const Expr& e, const std::string& k) {
    for (const auto& [name, x] : e.kwargs)
      if (name == k) return eval(*x);
    return Val::undefined();
  }

  Val call(const Expr& e) {
    const Expr& f = *e.kids[0];
    const std::vector<Val> a = args(e, 1);
    if (f.kind == Expr::Name) {
      if (f.name == "raise_exception") fail("the chat template raised: " + (a.empty() ? std::string() : py_str(a[0])));
      if (f.name == "namespace" || f.name == "dict") {
        json o = json::object();
        for (const auto& [k, x] : e.kwargs) o[k] = eval(*x).j;
        return V(o);
      }
      if (f.name == "range") {
        int64_t lo = 0, hi = 0, st = 1;
        if (a.size() == 1) hi = as_int(a[0].j, "range()'s stop");
        else if (a.size() >= 2) lo = as_int(a[0].j, "range()'s start"), hi = as_int(a[1].j, "range()'s stop"),
                                st = a.size() > 2 ? as_int(a[2].j, "range()'s step") : 1;
        if (st == 0) fail("range() with a step of 0");
        if ((static_cast<__int128>(hi) - lo) / st > kMaxItems) fail("range() of more than " + std::to_string(kMaxItems) + " numbers");
        json r = json::array();
        for (int64_t k = lo; st > 0 ? k < hi : k > hi; k += st) r.push_back(k);
        return V(r);
      }
      if (f.name == "strftime_now") {
        const std::time_t t = std::time(nullptr);
        std::tm tm{};
        localtime_r(&t, &tm);
        char buf[256];
        const size_t n = std::strftime(buf, sizeof buf, a.empty() ? "" : py_str(a[0]).c_str(), &tm);
        return V(std::string(buf, n));
      }
      fail("the function '" + f.name + "' is not supported");
    }
    if (f.kind != Expr::Attr) fail("only functions and methods can be called");
    const Val o = eval(*f.kids[0]);
    const std::string& m = f.name;
    if (o.j.is_string()) {
      const std::string s = o.j.get<std::string>();
      std::string r = s;
      if (m == "upper" || m == "lower") {
        for (char& c : r) c = static_cast<char>(m == "upper" ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        return V(r);
      }
      if (m == "strip" || m == "lstrip" || m == "rstrip") {
        const std::string chars = a.empty() ? std::string(" \t\n\r\f\v") : py_str(a[0]);
        size_t x = 0, y = r.size();
        if (m != "rstrip") while (x < y && chars.find(r[x]) != std::string::npos) ++x;
        if (m != "lstrip") while (y > x && chars.find(r[y - 1]) != std::string::npos) --y;
        return V(r.substr(x, y - x));
      }
      if (m == "startswith" || m == "endswith") {
        const std::string p = py_str(a.at(0));
        return V(m == "startswith" ? s.rfind(p, 0) == 0 : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0);
      }
      if (m == "replace") {
        const std::string from = py_str(a.at(0)), to = py_str(a.at(1));
        if (from.empty()) fail("replace() of an empty string");
        std::string out;
        for (size_t k = 0; k < s.size();) {
          if (s.compare(k, from.size(), from) == 0) out += to, k += from.size();
          else out += s[k++];
        }
        return V(out);
      }
      if (m == "split") {
        json parts = json::array();
        if (a.empty() || a[0].j.is_null()) {
          std::string cur;
          for (char c : s) {
            if (std::isspace(static_cast<unsigned char>(c))) {
              if (!cur.empty()) parts.push_back(cur), cur.clear();
            } else {
              cur += c;
            }
          }
          if (!cur.empty()) parts.push_back(cur);
        } else {
          const std::string sep = py_str(a[0]);
          if (sep.empty()) fail("split() with an empty separator");
          size_t k = 0;
          for (size_t at; (at = s.find(sep, k)) != std::string::npos; k = at + sep.size()) parts.push_back(s.substr(k, at - k));
          parts.push_back(s.substr(k));
        }
        return V(parts);
      }
      if (m == "title" || m == "capitalize") {
        bool start = true;
        for (char& c : r) {
          const bool alpha = std::isalpha(static_cast<unsigned char>(c));
          c = static_cast<char>(start && alpha ? std::toupper(static_cast<unsigned char>(c))
                                               : m == "capitalize" || alpha ? std::tolower(static_cast<unsigned char>(c)) : c);
          start = m == "title" ? !alpha : false;
        }
        return V(r);
      }
    }
    if (o.j.is_object()) {
      if (m == "items") {
        json r = json::array();
        for (const auto& [k, v] : o.j.items()) r.push_back(json::array({k, v}));
        return V(r);
      }
      if (m == "keys" || m == "values") {
        json r = json::array();
        for (const auto& [k, v] : o.j.items()) r.push_back(m == "keys" ? json(k) : v);
        return V(r);
      }
      if (m == "get") {
        const Val v = item(o, a.at(0).j);
        return v.undef ? (a.size() > 1 ? a[1] : V(nullptr)) : v;
      }
    }
    fail("the method '" + m + "' of " + (o.undef ? std::string("an undefined value") : py_repr(o.j)) + " is not supported");
  }

  bool test(const Expr& e) {
    const Val v = eval(*e.kids[0]);
    const std::vector<Val> a = args(e, 1);
    const std::string& t = e.name;
    if (t == "defined") return !v.undef;
    if (t == "undefined") return v.undef;
    if (t == "none") return !v.undef && v.j.is_null();
    if (t == "string") return v.j.is_string();
    if (t == "number") return v.j.is_number() && !v.undef;
    if (t == "integer") return v.j.is_number_integer();
    if (t == "float") return v.j.is_number_float();
    if (t == "boolean") return v.j.is_boolean();
    if (t == "true") return v.j.is_boolean() && v.j.get<bool>();
    if (t == "false") return v.j.is_boolean() && !v.j.get<bool>();
    if (t == "mapping") return v.j.is_object();
    if (t == "sequence" || t == "iterable") return v.j.is_array() || v.j.is_string() || (t == "iterable" && v.j.is_object());
    if (t == "equalto" || t == "eq" || t == "sameas") return !v.undef && !a.empty() && v.j == a[0].j;
    if (t == "ne") return a.empty() || v.j != a[0].j;
    if (t == "odd" || t == "even") return v.j.is_number_integer() && (v.j.get<int64_t>() % 2 != 0) == (t == "odd");
    if (t == "in") return !a.empty() && a[0].j.is_array() && std::find(a[0].j.begin(), a[0].j.end(), v.j) != a[0].j.end();
    fail("the test '" + t + "' is not supported");
  }

  Val filter(const Expr& e) {
    const Val v = eval(*e.kids[0]);
    const std::vector<Val> a = args(e, 1);
    const std::string& f = e.name;
    if (f == "trim") return V(trim(py_str(v)));
    if (f == "upper" || f == "lower" || f == "title" || f == "capitalize") return call_method(V(py_str(v)), f, {});
    if (f == "length" || f == "count") {
      if (v.j.is_string()) return V(static_cast<int64_t>(v.j.get_ref<const std::string&>().size()));
      return V(static_cast<int64_t>(v.undef || v.j.is_null() ? 0 : v.j.size()));
    }
    if (f == "string") return V(py_str(v));
    if (f == "int") {
      if (v.j.is_number_integer()) return V(as_int(v.j, "int()'s argument"));
      const double d = v.j.is_number() ? v.j.get<double>() : 0.0;
      if (!(std::fabs(d) < 9.2e18)) fail("int() of " + py_repr(v.j) + " beyond 64 bits");
      return V(static_cast<int64_t>(d));
    }
    if (f == "default" || f == "d") {
      const bool boolean = a.size() > 1 && truthy(a[1]);
      return (v.undef || (boolean && !truthy(v))) ? (a.empty() ? V("") : a[0]) : v;
    }
    if (f == "first" || f == "last") {
      if (v.j.is_array()) return v.j.empty() ? Val::undefined() : V(f == "first" ? v.j.front() : v.j.back());
      if (v.j.is_string()) {
        const std::string& s = v.j.get_ref<const std::string&>();
        return s.empty() ? Val::undefined() : V(std::string(1, f == "first" ? s.front() : s.back()));
      }
      fail("'" + f + "' of " + py_repr(v.j));
    }
    if (f == "list") return V(v.j.is_array() ? v.j : json::array());
    if (f == "reverse") {
      json r = v.j;
      if (r.is_array()) std::reverse(r.begin(), r.end());
      else if (r.is_string()) std::reverse(r.get_ref<std::string&>().begin(), r.get_ref<std::string&>().end());
      return V(r);
    }
    if (f == "join") {
      const std::string sep = a.empty() ? "" : py_str(a[0]);
      std::string r;
      bool first = true;
      for (const json& x : v.j) {
        const std::string piece = (first ? "" : sep) + py_str(V(x));
        r += piece;
        first = false;
        charge(piece.size());
        if (r.size() > kMaxOutput) fail("a joined string grows past " + std::to_string(kMaxOutput) + " bytes");
      }
      return V(r);
    }
    if (f == "items") {
      json r = json::array();
      for (const auto& [k, x] : v.j.items()) r.push_back(json::array({k, x}));
      return V(r);
    }
    if (f == "tojson") {
      const Val ind = kwarg(e, "indent");
      return V(py_json(v.j, ind.undef || ind.j.is_null() ? -1 : static_cast<int>(ind.j.get<int64_t>())));
    }
    if (f == "selectattr" || f == "rejectattr") {
      if (a.empty()) fail(f + " needs an attribute");
      const std::string attr = py_str(a[0]);
      json r = json::array();
      for (const json& x : v.undef ? json::array() : v.j) {
        const Val got = item(V(x), json(attr));
        bool ok;
        if (a.size() == 1) {
          ok = truthy(got);
        } else {
          auto probe = mk(Expr::Test);
          probe->name = py_str(a[1]);
          auto lit = mk(Expr::Lit);
          lit->lit = got.j;
          lit->negated = got.undef;
          probe->kids = {lit};
          for (size_t k = 2; k < a.size(); ++k) {
            auto l = mk(Expr::Lit);
            l->lit = a[k].j;
            probe->kids.push_back(l);
          }
          ok = test(*probe);
        }
        if (ok == (f == "selectattr")) r.push_back(x);
      }
      return V(r);
    }
    if (f == "map") {
      const Val attr = kwarg(e, "attribute");
      json r = json::array();
      for (const json& x : v.j) {
        if (!attr.undef) r.push_back(item(V(x), attr.j).j);
        else fail("map() without attribute= is not supported");
      }
      return V(r);
    }
    if (f == "replace") return call_method(v, "replace", a);
    fail("the filter '" + f + "' is not supported");
  }

  Val call_method(const Val& o, const std::string& m, const std::vector<Val>& a) {
    Expr c;
    c.kind = Expr::Call;
    auto attr = mk(Expr::Attr);
    attr->name = m;
    auto lit = mk(Expr::Lit);
    lit->lit = o.j;
    attr->kids = {lit};
    c.kids = {attr};
    for (const Val& x : a) {
      auto l = mk(Expr::Lit);
      l->lit = x.j;
      c.kids.push_back(l);
    }
    return call(c);
  }

  // Everything values are built of, summed (string bytes, list items): a template may not build
  // without bound even where each value stays small.
  void charge(size_t n) {
    work_ += static_cast<int64_t>(n);
    if (work_ > kMaxWork) fail("the template builds more than " + std::to_string(kMaxWork) + " bytes of values");
  }

  std::vector<std::map<std::string, json>> scopes_;
  int64_t steps_ = 0, work_ = 0;
};

}  // namespace

std::string render_chat_template(const std::string& tmpl, const nlohmann::ordered_json& context, const std::string& where) {
  try {
    const Body body = parse_template(tmpl);
    std::string out;
    Renderer(context).run(body, out);
    return out;
  } catch (const Error& e) {
    throw InputError(where + ": chat template, " + e.what);
  } catch (const Jump&) {
    throw InputError(where + ": chat template, a break or continue outside a loop");
  } catch (const nlohmann::ordered_json::exception& e) {
    throw InputError(where + ": chat template, a value of the wrong type (" + std::string(e.what()) + ")");
  } catch (const std::out_of_range& e) {  // (a call with too few arguments, a number too large)
    throw InputError(where + ": chat template, an argument or number out of range (" + std::string(e.what()) + ")");
  } catch (const std::invalid_argument& e) {
    throw InputError(where + ": chat template, an invalid number (" + std::string(e.what()) + ")");
  }
}

}  // namespace kvlens
