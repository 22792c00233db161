// A small regular-expression engine for scanners: a pattern over Unicode code points is
// compiled to a Thompson NFA and run at one position of a text, yielding every position where
// a match can end. A scanner picks the longest match over its rules (lex/JFlex semantics);
// core/eval/ptb_tokenizer.cpp is built on it.
//
// Syntax: literals; `\` escapes a metacharacter, or gives \t \n \r \f \v \0 \uXXXX; `.` any
// code point; classes `[a-z\u00C0-\u00D6]`, negated `[^...]`, with the named sets \L (letter),
// \D (digit), \U (upper-case letter) usable inside and outside classes; groups `( )`,
// alternation `|`, and `*`, `+`, `?`, `{m}`, `{m,n}`. With `caseless`, a literal letter
// outside a class matches either case (classes are taken as written, as in JFlex).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvlens {

class Pattern {
 public:
  // Throws InternalError naming the pattern when it does not parse (patterns are code, not input).
  Pattern(std::string_view utf8_pattern, bool caseless);
  ~Pattern();
  Pattern(Pattern&&) noexcept;
  Pattern& operator=(Pattern&&) noexcept;

  // Appends to `ends` every end (exclusive index into `text`) of a match starting at `pos`,
  // in increasing order. An empty match is reported as `pos`.
  void match_ends(std::u32string_view text, size_t pos, std::vector<size_t>& ends) const;
  // The longest match's end, or SIZE_MAX when there is none.
  size_t longest(std::u32string_view text, size_t pos) const;
  // Whether some match can begin with `c` (a scanner skips patterns that cannot).
  bool can_start_with(char32_t c) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlens
