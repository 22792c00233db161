#include "core/eval/longest_match.h"

#include <algorithm>
#include <utility>

#include "core/errors.h"
#include "core/eval/unicode_text.h"

namespace kvlens {

namespace {

struct CharSet {
  std::vector<std::pair<char32_t, char32_t>> ranges;
  bool letter = false, digit = false, upper = false, any = false, negated = false;

  bool contains(char32_t c) const {
    bool in = any || (letter && is_letter(c)) || (digit && is_digit(c)) || (upper && is_upper(c));
    for (size_t i = 0; !in && i < ranges.size(); ++i) in = c >= ranges[i].first && c <= ranges[i].second;
    return in != negated;
  }
};

struct Node {
  enum Kind { Set, Concat, Alt, Repeat } kind = Concat;
  int set = -1;
  std::vector<Node> kids;
  int min = 0, max = -1;  // Repeat; max -1 = unbounded
};

struct State {
  enum Kind { Char, Split, Match } kind = Match;
  int set = -1;
  int out = -1, out1 = -1;
};

char32_t upper_latin(char32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 32;
  return c;
}

class Parser {
 public:
  Parser(std::u32string p, bool caseless, std::vector<CharSet>& sets, std::string utf8)
      : p_(std::move(p)), caseless_(caseless), sets_(sets), utf8_(std::move(utf8)) {}

  Node parse() {
    Node n = alternation();
    if (i_ != p_.size()) fail("unexpected ')'");
    return n;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw InternalError("pattern '" + utf8_ + "': " + why + " at " + std::to_string(i_));
  }
  bool more() const { return i_ < p_.size(); }
  char32_t peek() const { return p_[i_]; }

  Node alternation() {
    Node alt;
    alt.kind = Node::Alt;
    alt.kids.push_back(concatenation());
    while (more() && peek() == U'|') {
      ++i_;
      alt.kids.push_back(concatenation());
    }
    return alt.kids.size() == 1 ? std::move(alt.kids[0]) : alt;
  }

  Node concatenation() {
    Node cat;
    cat.kind = Node::Concat;
    while (more() && peek() != U'|' && peek() != U')') cat.kids.push_back(repetition());
    return cat;
  }

  Node repetition() {
    Node atom_node = atom();
    while (more()) {
      const char32_t c = peek();
      int lo = 0, hi = -1;
      if (c == U'*') {
        ++i_;
      } else if (c == U'+') {
        ++i_, lo = 1;
      } else if (c == U'?') {
        ++i_, hi = 1;
      } else if (c == U'{') {
        ++i_;
        lo = number();
        hi = lo;
        if (more() && peek() == U',') {
          ++i_;
          hi = number();
        }
        if (!more() || peek() != U'}') fail("expected '}'");
        ++i_;
      } else {
        break;
      }
      Node r;
      r.kind = Node::Repeat;
      r.min = lo;
      r.max = hi;
      r.kids.push_back(std::move(atom_node));
      atom_node = std::move(r);
    }
    return atom_node;
  }

  int number() {
    int v = 0;
    if (!more() || peek() < U'0' || peek() > U'9') fail("expected a number");
    while (more() && peek() >= U'0' && peek() <= U'9') v = v * 10 + static_cast<int>(p_[i_++] - U'0');
    return v;
  }

  Node set_node(CharSet s) {
    sets_.push_back(std::move(s));
    Node n;
    n.kind = Node::Set;
    n.set = static_cast<int>(sets_.size()) - 1;
    return n;
  }

  // After a backslash: a named set (added to `s`) or one escaped code point.
  bool escape(CharSet& s, char32_t& c) {
    if (!more()) fail("dangling '\\'");
    const char32_t e = p_[i_++];
    switch (e) {
      case U'L': s.letter = true; return false;
      case U'D': s.digit = true; return false;
      case U'U': s.upper = true; return false;
      case U't': c = U'\t'; return true;
      case U'n': c = U'\n'; return true;
      case U'r': c = U'\r'; return true;
      case U'f': c = U'\f'; return true;
      case U'v': c = U'\v'; return true;
      case U'0': c = 0; return true;
      case U'u': {
        if (i_ + 4 > p_.size()) fail("short \\u escape");
        c = 0;
        for (int k = 0; k < 4; ++k) {
          const char32_t h = p_[i_++];
          c = c * 16 + (h >= U'0' && h <= U'9' ? h - U'0' : h >= U'A' && h <= U'F' ? h - U'A' + 10
                                                        : h >= U'a' && h <= U'f' ? h - U'a' + 10
                                                                                 : (fail("bad hex digit"), 0));
        }
        return true;
      }
      default: c = e; return true;
    }
  }

  Node atom() {
    const char32_t c = p_[i_++];
    if (c == U'(') {
      Node n = alternation();
      if (!more() || peek() != U')') fail("expected ')'");
      ++i_;
      return n;
    }
    if (c == U'[') return char_class();
    if (c == U'.') {
      CharSet s;
      s.any = true;
      return set_node(s);
    }
    if (c == U'*' || c == U'+' || c == U'?' || c == U'{') fail("nothing to repeat");
    CharSet s;
    char32_t lit = c;
    if (c == U'\\' && !escape(s, lit)) return set_node(s);
    s.ranges.push_back({lit, lit});
    if (caseless_) {
      const char32_t lo = to_lower(std::u32string(1, lit))[0], up = upper_latin(lit);
      if (lo != lit) s.ranges.push_back({lo, lo});
      if (up != lit) s.ranges.push_back({up, up});
    }
    return set_node(s);
  }

  Node char_class() {
    CharSet s;
    if (more() && peek() == U'^') {
      s.negated = true;
      ++i_;
    }
    bool first = true;
    while (more() && (peek() != U']' || first)) {
      first = false;
      char32_t a = p_[i_++];
      if (a == U'\\' && !escape(s, a)) continue;
      char32_t b = a;
      if (i_ + 1 < p_.size() && peek() == U'-' && p_[i_ + 1] != U']') {
        ++i_;
        b = p_[i_++];
        if (b == U'\\' && !escape(s, b)) fail("named set as a range end");
      }
      if (b < a) fail("reversed range");
      s.ranges.push_back({a, b});
    }
    if (!more()) fail("unterminated class");
    ++i_;
    return set_node(s);
  }

  std::u32string p_;
  bool caseless_;
  std::vector<CharSet>& sets_;
  std::string utf8_;
  size_t i_ = 0;
};

}  // namespace

struct Pattern::Impl {
  std::vector<CharSet> sets;
  std::vector<State> states;
  int start = -1;

  struct Frag {
    int start;
    std::vector<std::pair<int, int>> outs;  // (state, 0 = out / 1 = out1) left dangling
  };

  int add(State s) {
    states.push_back(s);
    return static_cast<int>(states.size()) - 1;
  }
  void patch(const std::vector<std::pair<int, int>>& outs, int to) {
    for (const auto& [s, which] : outs) (which ? states[s].out1 : states[s].out) = to;
  }
  Frag empty() {
    const int s = add({State::Split, -1, -1, -1});  // a split with one live branch acts as epsilon
    return {s, {{s, 0}}};
  }

  Frag compile(const Node& n) {
    switch (n.kind) {
      case Node::Set: {
        const int s = add({State::Char, n.set, -1, -1});
        return {s, {{s, 0}}};
      }
      case Node::Concat: {
        if (n.kids.empty()) return empty();
        Frag f = compile(n.kids[0]);
        for (size_t k = 1; k < n.kids.size(); ++k) {
          Frag g = compile(n.kids[k]);
          patch(f.outs, g.start);
          f.outs = std::move(g.outs);
        }
        return f;
      }
      case Node::Alt: {
        Frag f = compile(n.kids[0]);
        for (size_t k = 1; k < n.kids.size(); ++k) {
          Frag g = compile(n.kids[k]);
          const int s = add({State::Split, -1, f.start, g.start});
          f.start = s;
          f.outs.insert(f.outs.end(), g.outs.begin(), g.outs.end());
        }
        return f;
      }
      case Node::Repeat: {
        const Node& kid = n.kids[0];
        Frag f = empty();
        for (int k = 0; k < n.min; ++k) {
          Frag g = compile(kid);
          patch(f.outs, g.start);
          f.outs = std::move(g.outs);
        }
        if (n.max < 0) {  // a star loop after the required copies
          Frag g = compile(kid);
          const int s = add({State::Split, -1, g.start, -1});
          patch(g.outs, s);
          patch(f.outs, s);
          f.outs = {{s, 1}};
        } else {
          std::vector<std::pair<int, int>> done;
          for (int k = n.min; k < n.max; ++k) {  // optional copies
            Frag g = compile(kid);
            const int s = add({State::Split, -1, g.start, -1});
            patch(f.outs, s);
            done.push_back({s, 1});
            f.outs = std::move(g.outs);
          }
          f.outs.insert(f.outs.end(), done.begin(), done.end());
        }
        return f;
      }
    }
    return empty();
  }

  void add_closure(int s, std::vector<int>& list, std::vector<uint32_t>& mark, uint32_t gen) const {
    if (s < 0 || mark[s] == gen) return;
    mark[s] = gen;
    const State& st = states[s];
    if (st.kind == State::Split) {
      add_closure(st.out, list, mark, gen);
      add_closure(st.out1, list, mark, gen);
    } else {
      list.push_back(s);
    }
  }
};

Pattern::Pattern(std::string_view utf8_pattern, bool caseless) : impl_(std::make_unique<Impl>()) {
  Parser parser(utf8_decode(utf8_pattern, "pattern"), caseless, impl_->sets, std::string(utf8_pattern));
  const Node root = parser.parse();
  Impl::Frag f = impl_->compile(root);
  const int match = impl_->add({State::Match, -1, -1, -1});
  impl_->patch(f.outs, match);
  impl_->start = f.start;
}

Pattern::~Pattern() = default;
Pattern::Pattern(Pattern&&) noexcept = default;
Pattern& Pattern::operator=(Pattern&&) noexcept = default;

void Pattern::match_ends(std::u32string_view text, size_t pos, std::vector<size_t>& ends) const {
  const Impl& m = *impl_;
  thread_local std::vector<uint32_t> mark;
  thread_local uint32_t gen = 0;
  if (mark.size() < m.states.size()) mark.assign(m.states.size(), 0);
  thread_local std::vector<int> cur, next;
  cur.clear();
  if (++gen == 0) std::fill(mark.begin(), mark.end(), 0), gen = 1;
  m.add_closure(m.start, cur, mark, gen);
  for (size_t i = pos;; ++i) {
    bool matched = false, live = false;
    for (int s : cur) {
      if (m.states[s].kind == State::Match) matched = true;
      else live = true;
    }
    if (matched) ends.push_back(i);
    if (!live || i >= text.size()) break;
    next.clear();
    if (++gen == 0) std::fill(mark.begin(), mark.end(), 0), gen = 1;
    const char32_t c = text[i];
    for (int s : cur) {
      const State& st = m.states[s];
      if (st.kind == State::Char && m.sets[st.set].contains(c)) m.add_closure(st.out, next, mark, gen);
    }
    std::swap(cur, next);
    if (cur.empty()) break;
  }
}

size_t Pattern::longest(std::u32string_view text, size_t pos) const {
  std::vector<size_t> ends;
  match_ends(text, pos, ends);
  return ends.empty() ? SIZE_MAX : ends.back();
}

bool Pattern::can_start_with(char32_t c) const {
  const Impl& m = *impl_;
  std::vector<uint32_t> mark(m.states.size(), 0);
  std::vector<int> first;
  m.add_closure(m.start, first, mark, 1);
  for (int s : first)
    if (m.states[s].kind == State::Char && m.sets[m.states[s].set].contains(c)) return true;
  return false;
}

}  // namespace kvlens
