// Rich scenes (generator version 2; core/data/scenes.h): placement, captions and questions. The
// random stream, the drawing and the classic wording are shared with the classic scenes
// (core/data/scene_parts.h).
#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/data/scene_parts.h"
#include "core/data/scenes.h"
#include "core/errors.h"

namespace kvlens {
using namespace scene_parts;

namespace {

struct Disc {
  int64_t x, y, r;  // 1/8 px
};

bool clear_of(const std::vector<Disc>& placed, int64_t x, int64_t y, int64_t r, int64_t gap) {
  for (const Disc& d : placed) {
    const int64_t dx = x - d.x, dy = y - d.y, need = r + d.r + gap;
    if (dx * dx + dy * dy < need * need) return false;
  }
  return true;
}

// The 3×3 cell holding (x, y), and how far (x, y) lies inside it (1/8 px).
int cell_at(int64_t x, int64_t y, int64_t span) {
  const int64_t col = std::min<int64_t>(2, 3 * x / span), row = std::min<int64_t>(2, 3 * y / span);
  return static_cast<int>(row * 3 + col);
}
int64_t cell_inset(int64_t x, int64_t y, int64_t span) {
  const int c = cell_at(x, y, span);
  const int64_t x0 = (c % 3) * span / 3, x1 = (c % 3 + 1) * span / 3;
  const int64_t y0 = (c / 3) * span / 3, y1 = (c / 3 + 1) * span / 3;
  return std::min({x - x0, x1 - x, y - y0, y1 - y});
}

using Kind = std::pair<Shape, Colour>;

// A (shape, colour) no object of the scene has yet, nor `taken`.
Kind new_kind(Rng& rng, const std::vector<SceneObject>& objs, const Kind* taken = nullptr) {
  for (;;) {
    const auto s = static_cast<Shape>(rng.below(kNumShapes));
    const auto c = static_cast<Colour>(rng.below(kNumColours));
    bool used = taken && *taken == Kind{s, c};
    for (const auto& o : objs) used |= o.shape == s && o.colour == c;
    if (!used) return {s, c};
  }
}

SceneObject make_object(Kind k, SizeClass size, Pattern p, Role role, int64_t x, int64_t y, int size_px) {
  SceneObject o;
  o.shape = k.first, o.colour = k.second, o.size = size, o.pattern = p, o.role = role;
  o.x = static_cast<double>(x) / kSub, o.y = static_cast<double>(y) / kSub;
  o.radius = static_cast<double>(rich_radius_units(size, size_px)) / kSub;
  o.cell = cell_at(x, y, int64_t{size_px} * kSub);
  return o;
}

// 1–3 main objects in distinct cells, by the classic scenes' rules: a pair never on an exact
// diagonal, no column with three, two of one column kept apart in x by 40 % of the narrower of
// their ranges (at least 6 px at 256), so "from left to right" is never a near tie.
void place_mains(Rng& rng, int n, int size, std::vector<SceneObject>& objs) {
  std::vector<int> cells = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  for (;;) {
    rng.shuffle(cells);
    if (n == 2) {
      if (std::abs(cells[0] % 3 - cells[1] % 3) != std::abs(cells[0] / 3 - cells[1] / 3)) break;
    } else {
      int per_col[3] = {0, 0, 0};
      for (int i = 0; i < n; ++i) ++per_col[cells[i] % 3];
      if (std::max({per_col[0], per_col[1], per_col[2]}) <= 2) break;
    }
  }
  const int64_t span = int64_t{size} * kSub, margin = std::max<int64_t>(kSub, int64_t{4} * kSub * size / 336);
  const int64_t min_gap = int64_t{6} * kSub * size / 256;
  std::vector<std::array<int64_t, 3>> placed;  // x, lo, hi in 1/8 px
  for (int i = 0; i < n; ++i) {
    const Kind k = new_kind(rng, objs);
    const auto sz = static_cast<SizeClass>(1 + rng.below(2));  // medium or large
    const auto pat = static_cast<Pattern>(rng.below(kNumPatterns));
    const int64_t r = rich_radius_units(sz, size), col = cells[i] % 3, row = cells[i] / 3;
    const int64_t lo = col * span / 3 + r + margin, hi = (col + 1) * span / 3 - r - margin;
    const std::array<int64_t, 3>* other = nullptr;  // the main object sharing this column, if any
    for (const auto& p : placed)
      if (p[0] >= col * span / 3 && p[0] < (col + 1) * span / 3) other = &p;
    int64_t x = rng.range(lo, hi);
    if (other) {
      const int64_t ox = (*other)[0], gap = std::max(min_gap, 4 * std::min(hi - lo, (*other)[2] - (*other)[1]) / 10);
      for (int t = 0; t < 64 && std::abs(x - ox) < gap; ++t) x = rng.range(lo, hi);
      if (std::abs(x - ox) < gap) x = (ox - lo > hi - ox) ? lo : hi;
    }
    const int64_t y = rng.range(row * span / 3 + r + margin, (row + 1) * span / 3 - r - margin);
    placed.push_back({x, lo, hi});
    objs.push_back(make_object(k, sz, pat, Role::Main, x, y, size));
  }
}

// Two main objects, the second partly hiding the first: its centre 0.5·r_back + 0.8·r_front away
// in one of eight directions, so about a third of the one behind stays hidden; never larger
// than the one behind.
void place_occluded_pair(Rng& rng, int size, std::vector<SceneObject>& objs) {
  static constexpr int kDir[8][2] = {{10000, 0}, {-10000, 0}, {0, 10000}, {0, -10000},
                                     {7071, 7071}, {-7071, 7071}, {7071, -7071}, {-7071, -7071}};
  const int64_t span = int64_t{size} * kSub, margin = std::max<int64_t>(kSub, int64_t{4} * kSub * size / 336);
  const Kind kb = new_kind(rng, objs);
  const auto sb = static_cast<SizeClass>(1 + rng.below(2));
  const auto pb = static_cast<Pattern>(rng.below(kNumPatterns));
  const Kind kf = new_kind(rng, objs, &kb);
  const auto sf = sb == SizeClass::Medium ? SizeClass::Medium : static_cast<SizeClass>(1 + rng.below(2));
  const auto pf = static_cast<Pattern>(rng.below(kNumPatterns));
  const int64_t rb = rich_radius_units(sb, size), rf = rich_radius_units(sf, size), d = rb / 2 + 4 * rf / 5;
  const int dir = static_cast<int>(rng.below(8));
  const int64_t ddx = d * kDir[dir][0] / 10000, ddy = d * kDir[dir][1] / 10000;
  // Both discs inside the image with the margin: the back centre's range, shifted by the offset.
  const int64_t xlo = std::max(rb + margin, rf + margin - ddx), xhi = std::min(span - rb - margin, span - rf - margin - ddx);
  const int64_t ylo = std::max(rb + margin, rf + margin - ddy), yhi = std::min(span - rb - margin, span - rf - margin - ddy);
  if (xlo > xhi || ylo > yhi) throw InputError("scene size " + std::to_string(size) + " px is too small for rich scenes");
  const int64_t x = rng.range(xlo, xhi), y = rng.range(ylo, yhi);
  objs.push_back(make_object(kb, sb, pb, Role::Main, x, y, size));
  objs.push_back(make_object(kf, sf, pf, Role::Main, x + ddx, y + ddy, size));
  objs.back().in_front_of = static_cast<int>(objs.size()) - 2;
}

// Discs anywhere in the free space: `n` of one kind (the group), `gap` apart from everything;
// `inset`: how far inside its cell each centre must lie (0: anywhere). Gives how many fitted.
int scatter(Rng& rng, int size, Kind k, SizeClass sz, Role role, int n, int64_t gap, int64_t inset,
            std::vector<SceneObject>& objs) {
  const int64_t span = int64_t{size} * kSub, r = rich_radius_units(sz, size);
  const int64_t margin = std::max<int64_t>(kSub, int64_t{4} * kSub * size / 336);
  std::vector<Disc> placed;
  for (const auto& o : objs)
    placed.push_back({static_cast<int64_t>(o.x * kSub), static_cast<int64_t>(o.y * kSub), static_cast<int64_t>(o.radius * kSub)});
  int fitted = 0;
  for (int i = 0; i < n; ++i) {
    for (int t = 0; t < 400; ++t) {
      const int64_t x = rng.range(r + margin, span - r - margin), y = rng.range(r + margin, span - r - margin);
      if (!clear_of(placed, x, y, r, gap) || (inset > 0 && cell_inset(x, y, span) < inset)) continue;
      placed.push_back({x, y, r});
      objs.push_back(make_object(k, sz, Pattern::Solid, role, x, y, size));
      ++fitted;
      break;
    }
  }
  return fitted;
}

struct Parts {
  std::vector<SceneObject> mains;
  const SceneObject* front = nullptr;  // the occluded pair: the one in front, and the one behind
  const SceneObject* back = nullptr;
  const SceneObject* group = nullptr;  // the first of the group
  int group_n = 0;
  const SceneObject* tiny = nullptr;
};

Parts parts_of(const std::vector<SceneObject>& objs) {
  Parts p;
  for (const auto& o : objs) {
    if (o.role == Role::Main) p.mains.push_back(o);
    if (o.role == Role::Group && p.group_n++ == 0) p.group = &o;
    if (o.role == Role::Tiny) p.tiny = &o;
    if (o.in_front_of >= 0) {
      if (o.in_front_of >= static_cast<int>(objs.size()) || &objs[static_cast<size_t>(o.in_front_of)] == &o ||
          objs[static_cast<size_t>(o.in_front_of)].role != Role::Main || o.role != Role::Main)
        throw InputError("rich scene: in_front_of " + std::to_string(o.in_front_of) +
                         " must name another main object of the scene's " + std::to_string(objs.size()));
      p.front = &o, p.back = &objs[static_cast<size_t>(o.in_front_of)];
    }
  }
  return p;
}

std::string group_phrase(const SceneObject& g, int n) {
  return std::string(count_word(n)) + " small " + colour_name(g.colour) + " " + shape_plural(g.shape);
}
std::string tiny_phrase(const SceneObject& t) {
  return std::string("a tiny ") + colour_name(t.colour) + " " + shape_name(t.shape) + " " + kCellPhrase[t.cell];
}
std::string strip_stop(std::string s) {
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

// The main objects in four other wordings, none of which says how many objects the scene has
// (its group and tiny one are objects too).
std::vector<std::string> main_wordings(const Parts& p, Rng& rng) {
  Wording w{rng};
  std::vector<int> order = {0, 1, 2, 3, 4};
  rng.shuffle(order);
  std::vector<std::string> out;
  for (int k = 0; k < 4; ++k) {
    const int t = order[static_cast<size_t>(k)];
    if (p.front) {
      const std::string f = w.a(*p.front);
      const std::string b = w.a(*p.back);
      switch (t) {
        case 0: out.push_back(f + " partly hiding " + b); break;
        case 1: out.push_back(b + " partly hidden behind " + f); break;
        case 2: out.push_back(f + " overlapping " + b + ", the " + short_name(*p.front) + " in front"); break;
        case 3: out.push_back(b + " with " + f + " in front of it"); break;
        default: out.push_back(f + " in front of " + b + ", the two overlapping"); break;
      }
    } else if (p.mains.size() == 1) {
      const std::string a = w.a(p.mains[0]), loc = kCellPhrase[p.mains[0].cell];
      switch (t) {
        case 0: out.push_back("there is " + a + " " + loc); break;
        case 1: out.push_back(loc + ", " + a); break;
        case 2: out.push_back(a + " sits " + loc); break;
        case 3: out.push_back(a + ", " + loc); break;
        default: out.push_back(loc + " there is " + a); break;
      }
    } else if (p.mains.size() == 2) {
      const auto [oa, ob] = ordered_pair(p.mains[0], p.mains[1]);
      const std::string a = w.a(oa);
      const std::string b = w.a(ob);
      const bool across = horizontal_pair(oa, ob);
      switch (t) {
        case 0: out.push_back(a + (across ? " to the left of " : " is above ") + b); break;
        case 1: out.push_back(b + (across ? " to the right of " : " below ") + a); break;
        case 2: out.push_back(a + (across ? " beside " : " over ") + b + ", the " + short_name(oa) + (across ? " on the left" : " on top")); break;
        case 3: out.push_back(a + " and " + b + (across ? " to its right" : " below it")); break;
        default: out.push_back(b + (across ? " with " : " beneath ") + a + (across ? " on its left" : "")); break;
      }
    } else {
      std::vector<std::string> items;
      for (const auto& o : left_to_right(p.mains)) items.push_back(w.a(o));
      const std::string list = join_list(items);
      switch (t) {
        case 0: out.push_back("from left to right, " + list); break;
        case 1: out.push_back(list + " from left to right"); break;
        case 2: out.push_back("left to right: " + list); break;
        case 3: out.push_back(list + ", in that order from the left"); break;
        default: out.push_back("in a row from the left, " + list); break;
      }
    }
  }
  return out;
}

// Four wordings of the scene, each with the content of rich_canonical_caption.
std::vector<std::string> rich_varied_captions(const Parts& p, Rng& rng) {
  const std::vector<std::string> mains = main_wordings(p, rng);
  std::vector<std::string> out;
  for (int k = 0; k < 4; ++k) {
    std::string s = mains[static_cast<size_t>(k)];
    if (p.group) {
      const std::string cnt = count_word(p.group_n), col = colour_name(p.group->colour), pl = shape_plural(p.group->shape);
      switch (rng.below(4)) {
        case 0: s += "; " + cnt + " small " + col + " " + pl; break;
        case 1: s += "; " + cnt + " little " + col + " " + pl; break;
        case 2: s += "; a group of " + cnt + " small " + col + " " + pl; break;
        default: s += "; " + cnt + " " + col + " " + pl + " scattered around"; break;
      }
    }
    if (p.tiny) {
      const std::string what = std::string(colour_name(p.tiny->colour)) + " " + shape_name(p.tiny->shape);
      const std::string loc = kCellPhrase[p.tiny->cell];
      switch (rng.below(4)) {
        case 0: s += "; a tiny " + what + " " + loc; break;
        case 1: s += "; a very small " + what + " " + loc; break;
        case 2: s += "; " + loc + ", a tiny " + what; break;
        default: s += "; a tiny " + what + ", " + loc; break;
      }
    }
    out.push_back(s + ".");
  }
  return out;
}

VqaPair ask_exist(const std::vector<SceneObject>& objs, const Parts& p, bool yes, bool tiny, Rng& rng) {
  Kind k;
  if (yes) {
    const SceneObject& o = tiny ? *p.tiny : rng.pick(objs);
    k = {o.shape, o.colour};
  } else {
    for (;;) {  // for the tiny one, half the time a main object's kind (present, but not tiny)
      if (tiny && rng.coin()) {
        const SceneObject& m = rng.pick(p.mains);
        k = {m.shape, m.colour};
      } else {
        const auto shape = static_cast<Shape>(rng.below(kNumShapes));
        k = {shape, static_cast<Colour>(rng.below(kNumColours))};
      }
      // (a tiny one of the group's kind is no answer either: the group's small ones are close)
      bool present = false;
      for (const auto& o : objs)
        present |= o.shape == k.first && o.colour == k.second && (!tiny || o.role != Role::Main);
      if (!present) break;
    }
  }
  const std::string what = std::string(colour_name(k.second)) + " " + shape_name(k.first);
  return {std::string("is there ") + (tiny ? "a tiny " + what : with_article(what)) + "?", yes ? "yes" : "no", "exist"};
}

std::vector<VqaPair> rich_questions(const std::vector<SceneObject>& objs, const Parts& p, int size, Rng& rng) {
  std::vector<VqaPair> q, extra;
  if (p.group)
    q.push_back({"how many " + std::string(colour_name(p.group->colour)) + " " + shape_plural(p.group->shape) +
                     " are there?",
                 count_word(p.group_n), "count"});
  if (p.tiny) {
    q.push_back({std::string("what colour is the tiny ") + shape_name(p.tiny->shape) + "?", colour_name(p.tiny->colour),
                 "colour"});
    extra.push_back({std::string("what shape is the tiny ") + colour_name(p.tiny->colour) + " object?",
                     shape_name(p.tiny->shape), "shape"});
    extra.push_back({std::string("where is the tiny ") + shape_name(p.tiny->shape) + "?", cell_name(p.tiny->cell), "where"});
  }
  const bool yes = rng.coin();
  extra.push_back(ask_exist(objs, p, p.tiny ? yes : false, true, rng));
  extra.push_back(ask_exist(objs, p, !yes, false, rng));
  for (const auto& o : p.mains) {
    extra.push_back({"what pattern does the " + short_name(o) + " have?", pattern_name(o.pattern), "pattern"});
    if (!p.front) extra.push_back({"where is the " + short_name(o) + "?", cell_name(o.cell), "where"});
  }
  if (p.front) {
    const bool front_first = rng.coin();
    const SceneObject& a = front_first ? *p.front : *p.back;
    const SceneObject& b = front_first ? *p.back : *p.front;
    extra.push_back({"which is in front, the " + short_name(a) + " or the " + short_name(b) + "?",
                     "the " + short_name(*p.front), "front"});
  } else if (p.mains.size() == 2) {  // the two named, so no other object is an answer
    const auto [a, b] = ordered_pair(p.mains[0], p.mains[1]);
    const bool first_a = rng.coin();
    extra.push_back({std::string("which is ") + (horizontal_pair(a, b) ? "further left" : "higher up") + ", the " +
                         short_name(first_a ? a : b) + " or the " + short_name(first_a ? b : a) + "?",
                     "the " + short_name(a), "relation"});
  } else if (p.mains.size() == 3) {
    // Asked where the leftmost centre also has the leftmost edge, 4 px (at 336) clear of the next.
    const std::vector<SceneObject> row = left_to_right(p.mains);
    const double clear = 4.0 * size / 336;
    bool edge_first = true;
    for (size_t i = 1; i < row.size(); ++i) edge_first &= row[0].x - row[0].radius + clear <= row[i].x - row[i].radius;
    if (edge_first) {
      std::vector<SceneObject> named = p.mains;
      rng.shuffle(named);
      extra.push_back({"of the " + short_name(named[0]) + ", the " + short_name(named[1]) + " and the " +
                           short_name(named[2]) + ", which is furthest left?",
                       "the " + short_name(row[0]), "relation"});
    }
  }
  for (size_t i = 0; i < p.mains.size(); ++i)
    for (size_t j = i + 1; j < p.mains.size(); ++j)
      if (p.mains[i].size != p.mains[j].size && rng.coin()) {
        const SceneObject& big = p.mains[i].size > p.mains[j].size ? p.mains[i] : p.mains[j];
        extra.push_back({"which is larger, the " + short_name(p.mains[i]) + " or the " + short_name(p.mains[j]) + "?",
                         "the " + short_name(big), "larger"});
      }
  rng.shuffle(extra);
  const size_t total = 4 + rng.below(5);  // 4..8
  for (size_t i = 0; i < extra.size() && q.size() < total; ++i) q.push_back(extra[i]);
  return q;
}

}  // namespace

std::string rich_canonical_caption(const std::vector<SceneObject>& objs) {
  const Parts p = parts_of(objs);
  if (p.mains.empty() || p.mains.size() > static_cast<size_t>(kRichMaxMain))
    throw InputError("rich caption needs 1 to 3 main objects, got " + std::to_string(p.mains.size()));
  std::string s;
  if (p.front) {
    s = with_article(describe(*p.front)) + " in front of " + with_article(describe(*p.back));
  } else if (p.mains.size() == 3) {  // the classic "three shapes: ..." would miscount the scene
    std::vector<std::string> items;
    for (const auto& o : left_to_right(p.mains)) items.push_back(with_article(describe(o)));
    s = join_list(items) + ", from left to right";
  } else {
    s = strip_stop(canonical_caption(p.mains));
  }
  if (p.group) s += "; " + group_phrase(*p.group, p.group_n);
  if (p.tiny) s += "; " + tiny_phrase(*p.tiny);
  return s + ".";
}

namespace scene_parts {

Scene generate_rich_scene(uint64_t seed, int64_t index, int size) {
  const uint64_t key = scene_key(seed ^ 0x7269636853636e65ULL, index);  // its own stream, apart from the classic scenes'
  Rng rng(key);
  Scene sc;
  sc.seed = seed;
  sc.index = index;
  const int n_main = static_cast<int>(rng.range(1, kRichMaxMain));
  if (n_main == 2 && rng.below(3) == 0) place_occluded_pair(rng, size, sc.objects);
  else place_mains(rng, n_main, size, sc.objects);
  if (rng.below(5) != 0) {  // the group: 2–9 identical small objects, 5 px apart
    const Kind k = new_kind(rng, sc.objects);
    const int want = static_cast<int>(rng.range(kRichMinGroup, kRichMaxGroup));
    const int got = scatter(rng, size, k, SizeClass::Small, Role::Group, want, int64_t{5} * kSub * size / 336, 0, sc.objects);
    if (got == 1) sc.objects.pop_back();  // a group of one would read as a second tiny detail
  }
  if (rng.below(4) != 0) {  // the tiny one, 6 px from everything and its cell's border
    const Kind k = new_kind(rng, sc.objects);
    const int64_t gap = int64_t{6} * kSub * size / 336;
    scatter(rng, size, k, SizeClass::Tiny, Role::Tiny, 1, gap, rich_radius_units(SizeClass::Tiny, size) + gap, sc.objects);
  }

  render_scene(sc, size, rng, key);  // in order: the one behind before the one in front

  sc.captions.push_back(rich_canonical_caption(sc.objects));
  const Parts parts = parts_of(sc.objects);
  for (auto& c : rich_varied_captions(parts, rng)) sc.captions.push_back(std::move(c));
  sc.questions = rich_questions(sc.objects, parts, size, rng);
  return sc;
}

}  // namespace scene_parts
}  // namespace kvlens
