#include "models/chat_template_parse.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>

namespace kvlens::chat_detail {

void fail(const std::string& what) { throw Error{what}; }

struct DepthGuard {
  int& d;
  explicit DepthGuard(int& depth) : d(depth) {
    if (++d > kMaxDepth) fail("nested more than " + std::to_string(kMaxDepth) + " deep");
  }
  ~DepthGuard() { --d; }
};

bool truthy(const Val& v) {
  if (v.undef || v.j.is_null()) return false;
  if (v.j.is_boolean()) return v.j.get<bool>();
  if (v.j.is_number()) return v.j.get<double>() != 0;
  if (v.j.is_string()) return !v.j.get_ref<const std::string&>().empty();
  return !v.j.empty();
}

// Python's repr of a float: the shortest text that reads back, with ".0" where it is whole.
std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

std::string py_str(const Val& v) {
  if (v.undef) return "";
  const json& j = v.j;
  if (j.is_string()) return j.get<std::string>();
  return py_repr(j);
}

std::string py_repr(const json& j) {
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.get<bool>() ? "True" : "False";
  if (j.is_number_integer()) return std::to_string(j.get<int64_t>());
  if (j.is_number_unsigned()) return std::to_string(j.get<uint64_t>());
  if (j.is_number_float()) return py_float(j.get<double>());
  if (j.is_string()) {
    const std::string& s = j.get_ref<const std::string&>();
    const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    std::string out(1, q);
    for (char c : s) {
      if (c == q || c == '\\') out += '\\';
      if (c == '\n') out += "\\n";
      else if (c == '\t') out += "\\t";
      else out += c;
    }
    return out + q;
  }
  std::string out = j.is_array() ? "[" : "{";
  bool first = true;
  if (j.is_array()) {
    for (const json& x : j) out += (first ? "" : ", ") + py_repr(x), first = false;
  } else {
    for (const auto& [k, x] : j.items()) out += (first ? "" : ", ") + py_repr(json(k)) + ": " + py_repr(x), first = false;
  }
  return out + (j.is_array() ? "]" : "}");
}

// json.dumps(x, ensure_ascii=False) with Python's separators, or indented.
std::string py_json(const json& j, int indent, int depth) {
  if (!j.is_array() && !j.is_object()) return j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (j.empty()) return j.is_array() ? "[]" : "{}";
  const std::string nl = indent >= 0 ? "\n" + std::string(static_cast<size_t>(indent * (depth + 1)), ' ') : "";
  const std::string close = indent >= 0 ? "\n" + std::string(static_cast<size_t>(indent * depth), ' ') : "";
  const std::string sep = indent >= 0 ? "," : ", ";
  std::string out = j.is_array() ? "[" : "{";
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    out += (first ? "" : sep) + nl;
    if (j.is_object()) out += json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ": ";
    out += py_json(*it, indent, depth + 1);
    first = false;
  }
  return out + close + (j.is_array() ? "]" : "}");
}

// ---- expressions -----------------------------------------------------------------------------

struct Tok {
  enum Kind { Name, Num, Str, Op, End } kind;
  std::string text;
  json num;
};

std::vector<Tok> lex_expr(const std::string& s) {
  std::vector<Tok> out;
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = i;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Tok::Name, s.substr(i, e - i), {}});
      i = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = i;
      bool real = false;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_' ||
                              (s[e] == '.' && e + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[e + 1]))))) {
        real = real || s[e] == '.';
        ++e;
      }
      std::string t = s.substr(i, e - i);
      t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
      out.push_back({Tok::Num, t, real ? json(std::stod(t)) : json(std::stoll(t))});
      i = e;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t e = i + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] == '\\' && e + 1 < s.size()) {
          const char n = s[++e];
          v += n == 'n' ? '\n' : n == 't' ? '\t' : n == 'r' ? '\r' : n;
        } else {
          v += s[e];
        }
      }
      if (e >= s.size()) fail("a string is never closed");
      out.push_back({Tok::Str, v, {}});
      i = e + 1;
    } else {
      static const char* ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "|",
                                  ".", ",", ":", "(", ")", "[", "]", "{", "}", "="};
      bool hit = false;
      for (const char* op : ops)
        if (s.compare(i, std::strlen(op), op) == 0) {
          out.push_back({Tok::Op, op, {}});
          i += std::strlen(op);
          hit = true;
          break;
        }
      if (!hit) fail(std::string("unexpected character '") + c + "'");
    }
  }
  out.push_back({Tok::End, "", {}});
  return out;
}

ExprP mk(Expr::Kind k) {
  auto e = std::make_shared<Expr>();
  e->kind = k;
  return e;
}

class ExprParser {
 public:
  explicit ExprParser(const std::string& s) : t_(lex_expr(s)) {}
  ExprP parse_all() {
    ExprP e = parse();
    if (!at_end()) fail("unexpected '" + t_[i_].text + "'");
    return e;
  }
  ExprP parse() { return cond(); }
  ExprP parse_no_cond() { return or_(); }  // a for-loop's iterable: `if` starts its filter
  bool at_end() const { return t_[i_].kind == Tok::End; }
  bool is(const char* op) const { return t_[i_].kind == Tok::Op && t_[i_].text == op; }
  bool is_word(const char* w) const { return t_[i_].kind == Tok::Name && t_[i_].text == w; }
  void expect(const char* op) {
    if (!is(op)) fail(std::string("expected '") + op + "', got '" + t_[i_].text + "'");
    ++i_;
  }
  std::string name() {
    if (t_[i_].kind != Tok::Name) fail("expected a name, got '" + t_[i_].text + "'");
    return t_[i_++].text;
  }

 private:
  ExprP cond() {
    ExprP a = or_();
    if (is_word("if")) {
      ++i_;
      ExprP c = or_();
      ExprP b = mk(Expr::Lit);
      b->lit = nullptr;
      b->negated = true;  // (a missing else gives undefined)
      if (is_word("else")) {
        ++i_;
        b = cond();
      }
      ExprP e = mk(Expr::Cond);
      e->kids = {a, c, b};
      return e;
    }
    return a;
  }
  ExprP or_() {
    ExprP a = and_();
    while (is_word("or")) {
      ++i_;
      ExprP e = mk(Expr::Or);
      e->kids = {a, and_()};
      a = e;
    }
    return a;
  }
  ExprP and_() {
    ExprP a = not_();
    while (is_word("and")) {
      ++i_;
      ExprP e = mk(Expr::And);
      e->kids = {a, not_()};
      a = e;
    }
    return a;
  }
  ExprP not_() {
    if (is_word("not")) {
      ++i_;
      ExprP e = mk(Expr::Not);
      e->kids = {not_()};
      return e;
    }
    return compare();
  }
  ExprP compare() {
    ExprP a = math1(), chain, last = a;
    while (true) {
      static const char* cmp[] = {"==", "!=", "<=", ">=", "<", ">"};
      const char* op = nullptr;
      for (const char* c : cmp)
        if (is(c)) op = c;
      if (op) {
        // Chained as Python chains them: a < b <= c is a < b and b <= c.
        ++i_;
        ExprP rhs = math1();
        ExprP e = mk(Expr::Bin);
        e->name = op;
        e->kids = {last, rhs};
        if (chain) {
          ExprP both = mk(Expr::And);
          both->kids = {chain, e};
          chain = both;
        } else {
          chain = e;
        }
        last = rhs;
        a = chain;
      } else if (is_word("in") || (is_word("not") && t_[i_ + 1].kind == Tok::Name && t_[i_ + 1].text == "in")) {
        const bool neg = is_word("not");
        i_ += neg ? 2 : 1;
        ExprP e = mk(Expr::In);
        e->negated = neg;
        e->kids = {a, math1()};
        a = last = e;
        chain = nullptr;
      } else {
        return a;
      }
    }
  }
  ExprP binary(ExprP a, const std::string& op, ExprP b) {
    ExprP e = mk(Expr::Bin);
    e->name = op;
    e->kids = {std::move(a), std::move(b)};
    return e;
  }
  ExprP math1() {
    ExprP a = concat();
    while (is("+") || is("-")) {
      const std::string op = t_[i_++].text;
      a = binary(a, op, concat());
    }
    return a;
  }
  ExprP concat() {
    ExprP a = math2();
    while (is("~")) {
      ++i_;
      a = binary(a, "~", math2());
    }
    return a;
  }
  ExprP math2() {
    ExprP a = pow_();
    while (is("*") || is("/") || is("//") || is("%")) {
      const std::string op = t_[i_++].text;
      a = binary(a, op, pow_());
    }
    return a;
  }
  ExprP pow_() {
    ExprP a = unary();
    while (is("**")) {
      ++i_;
      a = binary(a, "**", unary());
    }
    return a;
  }
  ExprP unary() {
    const DepthGuard guard(depth_);
    if (is("-")) {
      ++i_;
      ExprP e = mk(Expr::Neg);
      e->kids = {unary()};
      return e;
    }
    if (is("+")) ++i_;
    return filters(postfix(primary()));
  }
  void call_args(Expr& e) {
    expect("(");
    while (!is(")")) {
      if (t_[i_].kind == Tok::Name && t_[i_ + 1].kind == Tok::Op && t_[i_ + 1].text == "=") {
        const std::string k = name();
        ++i_;
        e.kwargs.push_back({k, parse()});
      } else {
        e.kids.push_back(parse());
      }
      if (!is(")")) expect(",");
    }
    expect(")");
  }
  ExprP filters(ExprP a) {
    while (true) {
      if (is("|")) {
        ++i_;
        ExprP e = mk(Expr::Filter);
        e->name = name();
        e->kids = {a};
        if (is("(")) call_args(*e);
        a = e;
      } else if (is_word("is")) {
        ++i_;
        ExprP e = mk(Expr::Test);
        if (is_word("not")) ++i_, e->negated = true;
        e->name = name();
        e->kids = {a};
        if (is("(")) {
          call_args(*e);
        } else if (!at_end() && (t_[i_].kind == Tok::Str || t_[i_].kind == Tok::Num ||
                                 (t_[i_].kind == Tok::Name && !is_word("and") && !is_word("or") && !is_word("else") &&
                                  !is_word("if")))) {
          e->kids.push_back(primary());  // `is equalto 'x'`, `is sameas none`
        }
        a = e;
      } else {
        return a;
      }
    }
  }
  ExprP postfix(ExprP a) {
    while (true) {
      if (is(".")) {
        ++i_;
        ExprP e = mk(Expr::Attr);
        e->name = t_[i_].kind == Tok::Num ? t_[i_++].text : name();
        e->kids = {a};
        a = e;
      } else if (is("[")) {
        ++i_;
        ExprP e = mk(Expr::Index);
        e->kids = {a};
        ExprP parts[3];
        int n = 0;
        bool slice = false;
        while (true) {
          if (!is(":") && !is("]")) parts[n] = parse();
          if (is(":")) {
            slice = true;
            ++i_;
            if (++n > 2) fail("a slice has at most three parts");
            continue;
          }
          break;
        }
        expect("]");
        if (slice) {
          e->kind = Expr::Slice;
          for (ExprP& p : parts) e->kids.push_back(p);
        } else {
          if (!parts[0]) fail("an empty subscript []");
          e->kids.push_back(parts[0]);
        }
        a = e;
      } else if (is("(")) {
        ExprP e = mk(Expr::Call);
        e->kids = {a};
        call_args(*e);
        a = e;
      } else {
        return a;
      }
    }
  }
  ExprP primary() {
    const Tok& t = t_[i_];
    if (t.kind == Tok::Str) {
      ExprP e = mk(Expr::Lit);
      std::string s;
      while (t_[i_].kind == Tok::Str) s += t_[i_++].text;  // adjacent strings join
      e->lit = s;
      return e;
    }
    if (t.kind == Tok::Num) {
      ExprP e = mk(Expr::Lit);
      e->lit = t.num;
      ++i_;
      return e;
    }
    if (t.kind == Tok::Name) {
      ++i_;
      ExprP e = mk(Expr::Lit);
      if (t.text == "true" || t.text == "True") e->lit = true;
      else if (t.text == "false" || t.text == "False") e->lit = false;
      else if (t.text == "none" || t.text == "None") e->lit = nullptr;
      else e->kind = Expr::Name, e->name = t.text;
      return e;
    }
    if (is("(")) {
      ++i_;
      ExprP e = parse();
      if (is(",")) {  // a tuple: a list here
        ExprP l = mk(Expr::List);
        l->kids.push_back(e);
        while (is(",")) {
          ++i_;
          if (is(")")) break;
          l->kids.push_back(parse());
        }
        e = l;
      }
      expect(")");
      return e;
    }
    if (is("[")) {
      ++i_;
      ExprP e = mk(Expr::List);
      while (!is("]")) {
        e->kids.push_back(parse());
        if (!is("]")) expect(",");
      }
      expect("]");
      return e;
    }
    if (is("{")) {
      ++i_;
      ExprP e = mk(Expr::Dict);
      while (!is("}")) {
        e->kids.push_back(parse());
        expect(":");
        e->kids.push_back(parse());
        if (!is("}")) expect(",");
      }
      expect("}");
      return e;
    }
    fail("unexpected '" + t.text + "'");
  }

  std::vector<Tok> t_;
  size_t i_ = 0;
  int depth_ = 0;
};

// ---- statements -------------------------------------------------------------------------------

struct Tag {
  enum Kind { Text, Var, Stmt } kind;
  std::string text;
  int line;
};

// The template cut into text, {{ }} and {% %} (comments dropped), with Jinja2's whitespace
// control: "-" strips all whitespace on that side, lstrip_blocks strips a block's indentation,
// trim_blocks drops the newline after a block ("+" keeps either).
std::vector<Tag> cut(const std::string& s) {
  std::vector<Tag> out;
  size_t i = 0;
  int line = 1;
  bool strip_next = false;
  auto line_at = [&](size_t upto) {
    return line + static_cast<int>(std::count(s.begin() + static_cast<std::ptrdiff_t>(i), s.begin() + static_cast<std::ptrdiff_t>(upto), '\n'));
  };
  while (i <= s.size()) {
    size_t p = std::string::npos;
    for (size_t k = i; k + 1 < s.size(); ++k)
      if (s[k] == '{' && (s[k + 1] == '{' || s[k + 1] == '%' || s[k + 1] == '#')) {
        p = k;
        break;
      }
    std::string text = s.substr(i, p == std::string::npos ? std::string::npos : p - i);
    if (strip_next) {
      size_t a = 0;
      while (a < text.size() && std::isspace(static_cast<unsigned char>(text[a]))) ++a;
      text.erase(0, a);
      strip_next = false;
    }
    if (p == std::string::npos) {
      if (!text.empty()) out.push_back({Tag::Text, text, line});
      break;
    }
    const char kind = s[p + 1];
    const char left = p + 2 < s.size() ? s[p + 2] : ' ';
    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    // The tag's end, outside quoted strings.
    size_t e = p + 2;
    char quote = 0;
    for (; e + 1 < s.size(); ++e) {
      if (quote) {
        if (s[e] == '\\') ++e;
        else if (s[e] == quote) quote = 0;
      } else if (kind != '#' && (s[e] == '\'' || s[e] == '"')) {
        quote = s[e];
      } else if (s.compare(e, 2, close) == 0) {
        break;
      }
    }
    if (e + 1 >= s.size()) fail("line " + std::to_string(line_at(p)) + ": a tag opened here is never closed");
    const char right = s[e - 1];
    const bool block = kind != '{';
    if (left == '-') {
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    } else if (block && left != '+') {  // lstrip_blocks: the tag alone after a line's indentation
      size_t b = text.size();
      while (b > 0 && (text[b - 1] == ' ' || text[b - 1] == '\t')) --b;
      // Only where that whitespace starts a line (or the template).
      const bool starts_line = b > 0 ? text[b - 1] == '\n' : (i == 0 || s[i - 1] == '\n');
      if (starts_line) text.erase(b);
    }
    if (!text.empty()) out.push_back({Tag::Text, text, line});
    const int tag_line = line_at(p);
    const size_t inner_a = p + 2 + ((left == '-' || left == '+') ? 1 : 0);
    const size_t inner_b = e - ((right == '-' || right == '+') && e - 1 >= inner_a ? 1 : 0);
    const std::string inner = s.substr(inner_a, inner_b > inner_a ? inner_b - inner_a : 0);
    if (kind == '{') out.push_back({Tag::Var, inner, tag_line});
    else if (kind == '%') out.push_back({Tag::Stmt, inner, tag_line});
    size_t after = e + 2;
    if (right == '-') {
      strip_next = true;
    } else if (block && right != '+') {  // trim_blocks
      if (after < s.size() && s[after] == '\n') ++after;
      else if (after + 1 < s.size() && s[after] == '\r' && s[after + 1] == '\n') after += 2;
    }
    line = line_at(after);
    i = after;
    if (i == s.size()) break;
  }
  return out;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

class Parser {
 public:
  explicit Parser(std::vector<Tag> tags) : tags_(std::move(tags)) {}
  Body parse_top() {
    std::string end;
    Body b = body({}, end);
    if (!end.empty()) fail("line " + std::to_string(line_) + ": '" + end + "' without its opening tag");
    return b;
  }

 private:
  static std::string first_word(const std::string& s, std::string* rest) {
    const std::string t = trim(s);
    size_t e = 0;
    while (e < t.size() && (std::isalnum(static_cast<unsigned char>(t[e])) || t[e] == '_')) ++e;
    if (rest) *rest = trim(t.substr(e));
    return t.substr(0, e);
  }
  // Nodes until one of `ends` (its word in `end`, its rest in `end_rest`).
  Body body(const std::vector<std::string>& ends, std::string& end, std::string* end_rest = nullptr) {
    const DepthGuard guard(depth_);
    Body out;
    while (pos_ < tags_.size()) {
      const Tag& t = tags_[pos_++];
      line_ = t.line;
      auto n = std::make_shared<Node>();
      n->line = t.line;
      try {
        if (t.kind == Tag::Text) {
          n->kind = Node::Text;
          n->text = t.text;
        } else if (t.kind == Tag::Var) {
          n->kind = Node::Out;
          n->exprs = {ExprParser(t.text).parse_all()};
        } else {
          std::string rest;
          const std::string w = first_word(t.text, &rest);
          if (std::find(ends.begin(), ends.end(), w) != ends.end()) {
            end = w;
            if (end_rest) *end_rest = rest;
            return out;
          }
          if (w == "if") {
            n->kind = Node::If;
            std::string cond = rest, e;
            while (true) {
              n->exprs.push_back(ExprParser(cond).parse_all());
              std::string r;
              n->bodies.push_back(body({"elif", "else", "endif"}, e, &r));
              if (e == "elif") {
                cond = r;
                continue;
              }
              if (e == "else") {
                n->has_else = true;
                n->bodies.push_back(body({"endif"}, e));
              }
              if (e != "endif") fail("an if without its endif");
              break;
            }
          } else if (w == "for") {
            n->kind = Node::For;
            const size_t in = rest.find(" in ");
            if (in == std::string::npos) fail("expected 'for x in ...'");
            for (size_t a = 0; a <= in;) {
              size_t b = rest.find(',', a);
              if (b == std::string::npos || b > in) b = in;
              n->targets.push_back(trim(rest.substr(a, b - a)));
              a = b + 1;
            }
            std::string iter = rest.substr(in + 4);
            // `for x in xs if cond`: a filter on the items.
            ExprParser ep(iter);
            n->exprs.push_back(ep.parse_no_cond());
            if (ep.is_word("if")) {
              const size_t at = iter.find(" if ");
              n->exprs.push_back(ExprParser(iter.substr(at + 4)).parse_all());
            } else if (!ep.at_end()) {
              fail("unexpected text after the for-loop's iterable");
            }
            std::string e;
            n->bodies.push_back(body({"else", "endfor"}, e));
            if (e == "else") {
              n->has_else = true;
              n->bodies.push_back(body({"endfor"}, e));
            }
            if (e != "endfor") fail("a for without its endfor");
          } else if (w == "set") {
            n->kind = Node::Set;
            const size_t eq = rest.find('=');
            if (eq == std::string::npos) fail("block assignments ({% set x %}...{% endset %}) are not supported");
            const std::string target = trim(rest.substr(0, eq));
            const size_t dot = target.find('.');
            n->targets.push_back(trim(target.substr(0, dot)));
            if (dot != std::string::npos) n->targets.push_back(trim(target.substr(dot + 1)));
            n->exprs.push_back(ExprParser(rest.substr(eq + 1)).parse_all());
          } else if (w == "generation") {
            n->kind = Node::Block;
            std::string e;
            n->bodies.push_back(body({"endgeneration"}, e));
            if (e != "endgeneration") fail("a generation block without its endgeneration");
          } else if (w == "break" || w == "continue") {
            n->kind = w == "break" ? Node::Break : Node::Continue;
          } else {
            fail("the statement '" + w + "' is not supported");
          }
        }
      } catch (const Error& e) {
        if (e.what.rfind("line ", 0) == 0) throw;
        fail("line " + std::to_string(t.line) + ": " + e.what);
      }
      out.push_back(n);
    }
    end.clear();
    if (!ends.empty()) fail("line " + std::to_string(line_) + ": the template ends before '" + ends.back() + "'");
    return out;
  }

  std::vector<Tag> tags_;
  size_t pos_ = 0;
  int line_ = 1;
  int depth_ = 0;
};

// ---- evaluation -------------------------------------------------------------------------------

Body parse_template(const std::string& tmpl) {
  // (Jinja2 drops one newline at the template's end: keep_trailing_newline is off.)
  std::string src = tmpl;
  if (!src.empty() && src.back() == '\n') src.pop_back();
  if (!src.empty() && src.back() == '\r') src.pop_back();
  return Parser(cut(src)).parse_top();
}

}  // namespace kvlens::chat_detail
