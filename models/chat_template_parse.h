// The parts of models/chat_template.cpp's renderer that read a template: Jinja values as JSON
// (with Python's printing of them), expressions (a lexer and a precedence parser), and the
// template cut into text, output and statement nodes with Jinja2's whitespace control. Internal
// to the chat template renderer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlens::chat_detail {

using json = nlohmann::ordered_json;  // (dicts keep their order, as Python's do)

// A value: JSON data, or Jinja's undefined (a missing variable, key or attribute).
struct Val {
  json j;
  bool undef = false;
  static Val undefined() {
    Val v;
    v.undef = true;
    return v;
  }
};
inline Val V(json j) { return Val{std::move(j), false}; }

// What a template did wrong (the renderer adds the file and the line).
struct Error {
  std::string what;
};
[[noreturn]] void fail(const std::string& what);

// Bounds on what a template may build: nesting, a range's or a repeated string's length, the text
// rendered, the statements run, the values built. A checkpoint's template is input like any file.
constexpr int kMaxDepth = 200;
constexpr int64_t kMaxItems = 1 << 20;
constexpr size_t kMaxOutput = size_t{1} << 24;
constexpr int64_t kMaxSteps = 1 << 20;  // statements run and loop turns, in all
constexpr int64_t kMaxWork = int64_t{1} << 26;

bool truthy(const Val& v);
std::string py_str(const Val& v);    // str(): strings as they are, the rest as repr()
std::string py_repr(const json& j);  // Python's repr of the value
std::string py_json(const json& j, int indent, int depth = 0);  // json.dumps(x, ensure_ascii=False)
std::string trim(const std::string& s);

struct Expr;
using ExprP = std::shared_ptr<Expr>;
struct Expr {
  enum Kind { Lit, Name, List, Dict, Attr, Index, Slice, Call, Filter, Test, Neg, Bin, And, Or, Not, Cond, In } kind;
  json lit;
  std::string name;  // Name, Attr, Filter, Test, Bin's operator
  std::vector<ExprP> kids;
  std::vector<std::pair<std::string, ExprP>> kwargs;
  bool negated = false;  // Test, In; a Lit standing for undefined
};
ExprP mk(Expr::Kind k);

struct Node;
using Body = std::vector<std::shared_ptr<Node>>;
struct Node {
  enum Kind { Text, Out, If, For, Set, Break, Continue, Block } kind;
  int line = 0;
  std::string text;
  std::vector<ExprP> exprs;          // Out: 1; If: each branch's condition; For: iterable (+ filter); Set: value
  std::vector<Body> bodies;          // If: each branch (+ else); For: body (+ else); Block: body
  std::vector<std::string> targets;  // For: loop variables; Set: name (and attribute)
  bool has_else = false;
};

// The template's statements (Jinja2 with trim_blocks and lstrip_blocks; one newline at its end
// dropped); Error naming the line where it cannot be read.
Body parse_template(const std::string& tmpl);

}  // namespace kvlens::chat_detail
