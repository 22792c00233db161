// Procedural scene generator: placement, integer rasterisation, captions, VQA pairs and the
// on-disk scene set. See core/data/scenes.h for the layout rules and the canonical grammar.
#include "core/data/scenes.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/files.h"

namespace kvlens {
namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Names and palette

namespace {
template <size_t N>
const char* name_at(const char* const (&names)[N], int i, const char* what, int first = 0) {
  if (i < first || i >= first + static_cast<int>(N))
    throw InputError(std::string(what) + " must be in [" + std::to_string(first) + ", " +
                     std::to_string(first + static_cast<int>(N) - 1) + "], got " + std::to_string(i));
  return names[i - first];
}
const char* const kShapeNames[] = {"circle", "square", "triangle", "star", "ring", "cross", "diamond"};
const char* const kColourNames[] = {"red", "green", "blue", "yellow", "purple", "orange", "white", "black"};
const char* const kSizeNames[] = {"small", "medium", "large"};
const char* const kCellNames[] = {"top left",    "top",    "top right", "left",        "center",
                                  "right",       "bottom left", "bottom", "bottom right"};
const char* const kCountWords[] = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine"};
// Fill colours, indexed by Colour: saturated, far from each other and from mid grey.
const std::array<uint8_t, 3> kPalette[] = {{220, 30, 30},  {30, 160, 50},   {30, 70, 220},
                                           {245, 215, 35}, {140, 50, 170},  {250, 130, 20},
                                           {245, 245, 245}, {20, 20, 20}};
static_assert(sizeof(kShapeNames) / sizeof(kShapeNames[0]) == kNumShapes);
static_assert(sizeof(kColourNames) / sizeof(kColourNames[0]) == kNumColours);
static_assert(sizeof(kPalette) / sizeof(kPalette[0]) == kNumColours);
}  // namespace

const char* shape_name(Shape s) { return name_at(kShapeNames, static_cast<int>(s), "shape id"); }
const char* colour_name(Colour c) { return name_at(kColourNames, static_cast<int>(c), "colour id"); }
const char* size_name(SizeClass s) { return name_at(kSizeNames, static_cast<int>(s), "size class"); }
const char* cell_name(int cell) { return name_at(kCellNames, cell, "grid cell"); }
const char* count_word(int n) { return name_at(kCountWords, n, "count", 1); }
std::array<uint8_t, 3> colour_rgb(Colour c) {
  colour_name(c);  // range check
  return kPalette[static_cast<int>(c)];
}

namespace {

constexpr int kRadiusAt256[kNumSizeClasses] = {14, 22, 32};
constexpr int kSub = 8;  // geometry unit: 1/8 pixel

// Radius of a size class in 1/8 pixel units, rounded.
int64_t radius_units(SizeClass s, int size) {
  return (int64_t{kRadiusAt256[static_cast<int>(s)]} * kSub * size + 128) / 256;
}

void check_size(int size) {
  if (size < kMinSceneSize || size > kMaxSceneSize)
    throw InputError("scene size must be in [" + std::to_string(kMinSceneSize) + ", " +
                     std::to_string(kMaxSceneSize) + "] pixels, got " + std::to_string(size));
}

// ---------------------------------------------------------------------------------------------
// Random numbers: splitmix64, with integer helpers only (no std:: distributions), so every
// platform draws the same sequence.

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

struct Rng {
  uint64_t state;
  explicit Rng(uint64_t s) : state(s) {}
  uint64_t next() { return mix64(state += 0x9E3779B97F4A7C15ULL); }
  // Uniform in [0, n), unbiased (rejection of the incomplete top block).
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t v;
    do v = next(); while (v >= limit);
    return v % n;
  }
  int64_t range(int64_t lo, int64_t hi) {  // inclusive
    return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo + 1)));
  }
  bool coin() { return (next() >> 63) != 0; }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
  }
  template <class T>
  const T& pick(const std::vector<T>& v) { return v[below(v.size())]; }
};

uint64_t scene_key(uint64_t seed, int64_t index) {
  return mix64(mix64(seed ^ 0x6B766C656E73ULL) ^ static_cast<uint64_t>(index));
}

// Stateless hash for background texture.
int64_t hash_to(uint64_t key, int64_t a, int64_t b, uint64_t salt, int64_t n) {
  const uint64_t h = mix64(key ^ mix64(static_cast<uint64_t>(a) * 0x9E3779B97F4A7C15ULL ^
                                       static_cast<uint64_t>(b) * 0xC2B2AE3D27D4EB4FULL ^ salt));
  return static_cast<int64_t>(h % static_cast<uint64_t>(n));
}

// ---------------------------------------------------------------------------------------------
// Rasterisation, integer only. Coordinates in 1/8 pixel units.

struct Pt { int64_t x, y; };

int64_t round_div(int64_t a, int64_t b) {  // b > 0, rounds half away from zero
  return a >= 0 ? (a + b / 2) / b : -((-a + b / 2) / b);
}

// Unit-circle directions ×10000: triangle vertices, and the star's 10 vertices alternating
// outer / inner, starting at the top and going clockwise (y down).
constexpr int kTri[3][2] = {{0, -10000}, {8660, 5000}, {-8660, 5000}};
constexpr int kStar[10][2] = {{0, -10000},    {5878, -8090},  {9511, -3090}, {9511, 3090},
                              {5878, 8090},   {0, 10000},     {-5878, 8090}, {-9511, 3090},
                              {-9511, -3090}, {-5878, -8090}};

std::vector<Pt> polygon(Shape s, int64_t r) {
  std::vector<Pt> p;
  if (s == Shape::Triangle) {
    for (const auto& v : kTri) p.push_back({round_div(r * v[0], 10000), round_div(r * v[1], 10000)});
  } else if (s == Shape::Star) {
    for (int i = 0; i < 10; ++i) {
      const int64_t rr = (i % 2 == 0) ? r * 100 : r * 45;  // inner radius 0.45 r
      p.push_back({round_div(rr * kStar[i][0], 1000000), round_div(rr * kStar[i][1], 1000000)});
    }
  }
  return p;
}

bool in_polygon(const std::vector<Pt>& p, int64_t x, int64_t y) {
  bool in = false;
  for (size_t i = 0, j = p.size() - 1; i < p.size(); j = i++) {
    const Pt a = p[i], b = p[j];
    if ((a.y > y) != (b.y > y)) {
      // x < a.x + (y - a.y) (b.x - a.x) / (b.y - a.y), multiplied through by (b.y - a.y)
      const int64_t lhs = (x - a.x) * (b.y - a.y), rhs = (y - a.y) * (b.x - a.x);
      if ((b.y > a.y) ? lhs < rhs : lhs > rhs) in = !in;
    }
  }
  return in;
}

bool inside(Shape s, int64_t r, const std::vector<Pt>& poly, int64_t dx, int64_t dy) {
  const int64_t ax = dx < 0 ? -dx : dx, ay = dy < 0 ? -dy : dy;
  const int64_t d2 = dx * dx + dy * dy, r2 = r * r;
  switch (s) {
    case Shape::Circle: return 400 * d2 <= 361 * r2;
    case Shape::Square: return 10 * ax <= 7 * r && 10 * ay <= 7 * r;
    case Shape::Ring: return 400 * d2 <= 361 * r2 && 400 * d2 >= 121 * r2;
    case Shape::Cross:
      return (10 * ax <= 3 * r && 10 * ay <= 9 * r) || (10 * ay <= 3 * r && 10 * ax <= 9 * r);
    case Shape::Diamond: return 380 * ax + 260 * ay <= 247 * r;
    case Shape::Triangle:
    case Shape::Star: return in_polygon(poly, dx, dy);
  }
  return false;
}

struct Background {
  int base;        // grey level
  int grad_x, grad_y;  // grey levels across the image
};

void render_background(RGBImage& img, const Background& bg, uint64_t key) {
  const int64_t w = img.width, h = img.height;
  const int64_t lat = std::max<int64_t>(4, 16 * w / 256);  // value-noise lattice spacing, px
  // Value noise in [-6, 6] grey levels at the lattice points, interpolated bilinearly: a soft
  // mottled texture that, unlike per-pixel grain, keeps the PNG files small.
  const int64_t lw = w / lat + 2, lh = h / lat + 2;
  std::vector<int64_t> node(static_cast<size_t>(lw * lh));
  for (int64_t gy = 0; gy < lh; ++gy)
    for (int64_t gx = 0; gx < lw; ++gx) node[static_cast<size_t>(gy * lw + gx)] = hash_to(key, gx, gy, 1, 13) - 6;
  for (int64_t y = 0; y < h; ++y) {
    const int64_t gy = y / lat, fy = y % lat;
    const int64_t grad_y = 256 * bg.grad_y * (2 * y + 1 - h) / (2 * h);
    for (int64_t x = 0; x < w; ++x) {
      const int64_t gx = x / lat, fx = x % lat;
      const int64_t* n0 = &node[static_cast<size_t>(gy * lw + gx)];
      const int64_t* n1 = n0 + lw;
      const int64_t coarse = 256 *
          (n0[0] * (lat - fx) * (lat - fy) + n0[1] * fx * (lat - fy) + n1[0] * (lat - fx) * fy + n1[1] * fx * fy) /
          (lat * lat);
      const int64_t grad = 256 * bg.grad_x * (2 * x + 1 - w) / (2 * w) + grad_y;
      const int64_t v = std::clamp<int64_t>((256 * bg.base + grad + coarse + 128) / 256, 0, 255);
      uint8_t* px = &img.data[static_cast<size_t>((y * w + x) * 3)];
      px[0] = px[1] = px[2] = static_cast<uint8_t>(v);
    }
  }
}

// Blends one object over the image with 4×4 supersampled coverage.
void render_object(RGBImage& img, Shape s, Colour c, int64_t cx, int64_t cy, int64_t r) {
  const std::vector<Pt> poly = polygon(s, r);
  const auto rgb = colour_rgb(c);
  const int64_t x0 = std::max<int64_t>(0, (cx - r) / kSub - 1);
  const int64_t x1 = std::min<int64_t>(img.width - 1, (cx + r) / kSub + 1);
  const int64_t y0 = std::max<int64_t>(0, (cy - r) / kSub - 1);
  const int64_t y1 = std::min<int64_t>(img.height - 1, (cy + r) / kSub + 1);
  for (int64_t py = y0; py <= y1; ++py) {
    for (int64_t px = x0; px <= x1; ++px) {
      int cover = 0;
      for (int sy = 0; sy < 4; ++sy)
        for (int sx = 0; sx < 4; ++sx)
          cover += inside(s, r, poly, px * kSub + 2 * sx + 1 - cx, py * kSub + 2 * sy + 1 - cy);
      if (cover == 0) continue;
      uint8_t* p = &img.data[static_cast<size_t>((py * img.width + px) * 3)];
      for (int ch = 0; ch < 3; ++ch) p[ch] = static_cast<uint8_t>((p[ch] * (16 - cover) + rgb[ch] * cover + 8) / 16);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Text

int col_of(const SceneObject& o) { return o.cell % kGridSide; }
int row_of(const SceneObject& o) { return o.cell / kGridSide; }

std::string with_article(const std::string& s) {
  const char c = s.empty() ? 'x' : s[0];
  const bool vowel = c == 'a' || c == 'e' || c == 'i' || c == 'o' || c == 'u';
  return (vowel ? "an " : "a ") + s;
}

std::string describe(const SceneObject& o) {
  return std::string(size_name(o.size)) + " " + colour_name(o.colour) + " " + shape_name(o.shape);
}

std::string short_name(const SceneObject& o) {  // unique within a scene
  return std::string(colour_name(o.colour)) + " " + shape_name(o.shape);
}

// Location phrases per cell, matching cell_name.
const char* const kCellPhrase[9] = {"in the top left",    "at the top",    "in the top right",
                                    "on the left",        "in the center", "on the right",
                                    "in the bottom left", "at the bottom", "in the bottom right"};

// Canonical order for 3–4 objects: by x (generated scenes keep x apart, see generate_scene).
std::vector<SceneObject> left_to_right(std::vector<SceneObject> objs) {
  std::stable_sort(objs.begin(), objs.end(),
                   [](const SceneObject& a, const SceneObject& b) { return a.x < b.x; });
  return objs;
}

// For two objects: whether the horizontal axis dominates, and the pair ordered (left or upper
// first).
bool horizontal_pair(const SceneObject& a, const SceneObject& b) {
  const int dc = std::abs(col_of(a) - col_of(b)), dr = std::abs(row_of(a) - row_of(b));
  if (dc != dr) return dc > dr;
  return std::abs(a.x - b.x) >= std::abs(a.y - b.y);
}

std::pair<SceneObject, SceneObject> ordered_pair(const SceneObject& a, const SceneObject& b) {
  const bool first_a = horizontal_pair(a, b) ? a.x < b.x : a.y < b.y;
  return first_a ? std::make_pair(a, b) : std::make_pair(b, a);
}

std::string join_list(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) s += (i + 1 == items.size()) ? " and " : ", ";
    s += items[i];
  }
  return s;
}

// Synonyms for the varied captions. Shape and colour words stay truthful. Every draw is its
// own statement: the operands of `a + b` are unsequenced, so drawing inside one expression
// would let compilers disagree on the order of draws.
struct Wording {
  Rng& rng;
  std::string size(SizeClass s) {
    static const std::vector<std::string> w[3] = {
        {"small", "tiny", "little"}, {"medium", "medium-sized", "mid-sized"}, {"large", "big"}};
    return rng.pick(w[static_cast<int>(s)]);
  }
  std::string shape(Shape s) {
    if (s == Shape::Cross) return rng.coin() ? "cross" : "plus sign";
    if (s == Shape::Circle) return rng.coin() ? "circle" : "disc";
    return shape_name(s);
  }
  std::string bare(const SceneObject& o) {  // "big red circle"
    const std::string sz = size(o.size);
    const std::string sh = shape(o.shape);
    return sz + " " + colour_name(o.colour) + " " + sh;
  }
  std::string a(const SceneObject& o) { return with_article(bare(o)); }  // "a big red circle"
};

std::vector<std::string> varied_captions(const std::vector<SceneObject>& objs, Rng& rng) {
  Wording w{rng};
  std::vector<int> order = {0, 1, 2, 3, 4, 5};
  rng.shuffle(order);
  std::vector<std::string> out;
  const size_t n = objs.size();
  for (int k = 0; k < 4; ++k) {
    const int t = order[k];
    const std::string noun = rng.pick(std::vector<std::string>{"image", "picture", "scene"});
    const std::string things = rng.coin() ? "shapes" : "objects";
    std::string s;
    if (n == 1) {
      const SceneObject& o = objs[0];
      const std::string loc = kCellPhrase[o.cell];
      const std::string bare = w.bare(o), a = with_article(bare);
      const std::string thing = things == "shapes" ? "shape" : "object";
      switch (t) {
        case 0: s = "there is " + a + " " + loc; break;
        case 1: s = a + " " + loc + " of the " + noun; break;
        case 2: s = "the " + noun + " shows a single " + bare + " " + loc; break;
        case 3: s = loc + ", there is one " + bare; break;
        case 4: s = "one " + thing + " only: " + a + ", " + loc; break;
        default: s = with_article(noun) + " with one " + bare + " " + loc; break;
      }
    } else if (n == 2) {
      const auto [oa, ob] = ordered_pair(objs[0], objs[1]);
      const std::string a = w.a(oa);
      const std::string b = w.a(ob);
      const std::string two = "two " + things;
      if (horizontal_pair(oa, ob)) {
        switch (t) {
          case 0: s = a + " to the left of " + b; break;
          case 1: s = b + " to the right of " + a; break;
          case 2: s = "there are " + two + ": " + a + " on the left and " + b + " on the right"; break;
          case 3: s = a + " beside " + b + ", with the " + short_name(oa) + " on the left"; break;
          case 4: s = "the " + noun + " shows " + two + ", " + a + " and " + b + " to its right"; break;
          default: s = two + " side by side: " + a + " left of " + b; break;
        }
      } else {
        switch (t) {
          case 0: s = a + " is above " + b; break;
          case 1: s = b + " below " + a; break;
          case 2: s = "there are " + two + ": " + a + " at the top and " + b + " underneath"; break;
          case 3: s = b + " beneath " + a; break;
          case 4: s = "the " + noun + " shows " + two + ", " + a + " and " + b + " below it"; break;
          default: s = two + ", one above the other: " + a + " over " + b; break;
        }
      }
    } else {
      std::vector<std::string> items;
      for (const auto& o : left_to_right(objs)) items.push_back(w.a(o));
      std::vector<std::string> shuffled = items;
      rng.shuffle(shuffled);
      const std::string cnt = count_word(static_cast<int>(n));
      const std::string list = join_list(items), mixed = join_list(shuffled);
      switch (t) {
        case 0: s = "there are " + cnt + " " + things + " in the " + noun + ": " + list + ", from left to right"; break;
        case 1: s = "from left to right, " + cnt + " " + things + ": " + list; break;
        case 2: s = cnt + " " + things + ", left to right: " + list; break;
        case 3: s = with_article(noun) + " of " + cnt + " " + things + ": " + mixed; break;
        case 4: s = list + " appear from left to right, " + cnt + " " + things + " in all"; break;
        default: s = "the " + noun + " contains " + cnt + " " + things + ", " + mixed + "; the leftmost is " + items.front(); break;
      }
    }
    out.push_back(s + ".");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// VQA

VqaPair exist_question(const std::vector<SceneObject>& objs, bool yes, Rng& rng) {
  const bool with_colour = rng.coin();
  auto present = [&](int shape, int colour) {
    for (const auto& o : objs)
      if (static_cast<int>(o.shape) == shape && (colour < 0 || static_cast<int>(o.colour) == colour)) return true;
    return false;
  };
  int shape = 0, colour = -1;
  if (yes) {
    const SceneObject& o = rng.pick(objs);
    shape = static_cast<int>(o.shape);
    if (with_colour) colour = static_cast<int>(o.colour);
  } else {
    do {
      // hard negatives: half the time ask for a present shape in another colour
      shape = (with_colour && rng.coin()) ? static_cast<int>(rng.pick(objs).shape)
                                          : static_cast<int>(rng.below(kNumShapes));
      colour = with_colour ? static_cast<int>(rng.below(kNumColours)) : -1;
    } while (present(shape, colour));
  }
  std::string subject = shape_name(static_cast<Shape>(shape));
  if (colour >= 0) subject = std::string(colour_name(static_cast<Colour>(colour))) + " " + subject;
  return {"is there " + with_article(subject) + "?", yes ? "yes" : "no", "exist"};
}

VqaPair where_question(const SceneObject& o) {
  return {"where is the " + short_name(o) + "?", cell_name(o.cell), "where"};
}

std::vector<VqaPair> make_questions(const std::vector<SceneObject>& objs, Rng& rng) {
  const int n = static_cast<int>(objs.size());
  std::vector<VqaPair> q;
  q.push_back({"how many shapes are there?", count_word(n), "count"});
  const bool yes = rng.coin();
  q.push_back(exist_question(objs, yes, rng));
  const int where_first = static_cast<int>(rng.below(static_cast<uint64_t>(n)));
  q.push_back(where_question(objs[where_first]));

  std::vector<VqaPair> extra;
  std::vector<int> unique_shape;  // objects whose shape occurs once
  for (int i = 0; i < n; ++i) {
    int same = 0;
    for (const auto& o : objs) same += o.shape == objs[i].shape;
    if (same == 1) unique_shape.push_back(i);
  }
  if (!unique_shape.empty()) {
    const SceneObject& o = objs[rng.pick(unique_shape)];
    extra.push_back({std::string("what colour is the ") + shape_name(o.shape) + "?", colour_name(o.colour), "colour"});
  }
  std::vector<std::pair<int, int>> differ;
  for (int i = 0; i < n; ++i)
    for (int j = i + 1; j < n; ++j)
      if (objs[i].size != objs[j].size) differ.push_back({i, j});
  if (!differ.empty()) {
    auto [i, j] = rng.pick(differ);
    if (rng.coin()) std::swap(i, j);
    const SceneObject &a = objs[i], &b = objs[j];
    const SceneObject& big = a.size > b.size ? a : b;
    extra.push_back({"which is larger, the " + short_name(a) + " or the " + short_name(b) + "?",
                     "the " + short_name(big), "larger"});
  }
  if (n >= 2) {
    int k = static_cast<int>(rng.below(static_cast<uint64_t>(n - 1)));
    if (k >= where_first) ++k;
    extra.push_back(where_question(objs[k]));
  }
  extra.push_back(exist_question(objs, !yes, rng));  // balances the first one

  rng.shuffle(extra);
  const size_t total = 3 + rng.below(4);  // 3..6
  for (size_t i = 0; i < extra.size() && q.size() < total; ++i) q.push_back(extra[i]);
  return q;
}

}  // namespace

double size_radius(SizeClass s, int scene_size) {
  check_size(scene_size);
  size_name(s);  // range check
  return static_cast<double>(radius_units(s, scene_size)) / kSub;
}

std::string canonical_caption(const std::vector<SceneObject>& objs) {
  if (objs.empty() || objs.size() > static_cast<size_t>(kMaxObjects))
    throw InputError("canonical caption needs 1 to 4 objects, got " + std::to_string(objs.size()));
  if (objs.size() == 1) return with_article(describe(objs[0])) + " " + kCellPhrase[objs[0].cell] + ".";
  if (objs.size() == 2) {
    const auto [a, b] = ordered_pair(objs[0], objs[1]);
    const char* rel = horizontal_pair(a, b) ? " left of " : " above ";
    return with_article(describe(a)) + rel + with_article(describe(b)) + ".";
  }
  std::vector<std::string> items;
  for (const auto& o : left_to_right(objs)) items.push_back(with_article(describe(o)));
  return std::string(count_word(static_cast<int>(objs.size()))) + " shapes: " + join_list(items) +
         ", from left to right.";
}

Scene generate_scene(uint64_t seed, int64_t index, const SceneOptions& opts) {
  check_size(opts.size);
  if (index < 0) throw InputError("scene index must be >= 0, got " + std::to_string(index));
  const int size = opts.size;
  const uint64_t key = scene_key(seed, index);
  Rng rng(key);

  Scene sc;
  sc.seed = seed;
  sc.index = index;
  const int n = static_cast<int>(rng.range(kMinObjects, kMaxObjects));

  // Cells: distinct. A pair never lies on an exact diagonal, so one axis dominates; with 3–4
  // objects no column holds more than two, so they can be kept apart in x (below).
  std::vector<int> cells = {0, 1, 2, 3, 4, 5, 6, 7, 8};
  for (;;) {
    rng.shuffle(cells);
    if (n == 2) {
      const int dc = std::abs(cells[0] % 3 - cells[1] % 3), dr = std::abs(cells[0] / 3 - cells[1] / 3);
      if (dc != dr) break;
    } else {
      int per_col[3] = {0, 0, 0};
      for (int i = 0; i < n; ++i) ++per_col[cells[i] % 3];
      if (std::max({per_col[0], per_col[1], per_col[2]}) <= 2) break;
    }
  }

  // Each centre is drawn in its cell, `margin` plus its radius away from the cell's border.
  // With 3–4 objects, two objects of one column are also kept `gap` apart in x, so that
  // "from left to right" is never a near tie: gap is 40% of the narrower of their two ranges,
  // at least 6 px at 256 (always feasible: half of the narrower range is larger).
  const int64_t span = int64_t{size} * kSub;
  const int64_t margin = std::max<int64_t>(kSub, int64_t{3} * kSub * size / 256);
  const int64_t min_gap = int64_t{6} * kSub * size / 256;
  std::vector<std::array<int64_t, 3>> placed;  // x, lo, hi in 1/8 px
  for (int i = 0; i < n; ++i) {
    SceneObject o;
    bool dup;
    do {
      o.shape = static_cast<Shape>(rng.below(kNumShapes));
      o.colour = static_cast<Colour>(rng.below(kNumColours));
      dup = false;
      for (const auto& p : sc.objects) dup |= p.shape == o.shape && p.colour == o.colour;
    } while (dup);
    o.size = static_cast<SizeClass>(rng.below(kNumSizeClasses));
    o.cell = cells[i];
    const int64_t r = radius_units(o.size, size);
    const int64_t col = o.cell % 3, row = o.cell / 3;
    const int64_t lo = col * span / 3 + r + margin, hi = (col + 1) * span / 3 - r - margin;
    const int64_t* other = nullptr;  // the object sharing this column, if any
    if (n >= 3)
      for (const auto& p : placed)
        if (p[0] >= col * span / 3 && p[0] < (col + 1) * span / 3) other = p.data();
    int64_t cx = rng.range(lo, hi);
    if (other) {
      const int64_t gap = std::max(min_gap, 4 * std::min(hi - lo, other[2] - other[1]) / 10);
      int tries = 0;
      while (std::abs(cx - other[0]) < gap && ++tries < 64) cx = rng.range(lo, hi);
      if (std::abs(cx - other[0]) < gap) cx = (other[0] - lo > hi - other[0]) ? lo : hi;
    }
    const int64_t cy = rng.range(row * span / 3 + r + margin, (row + 1) * span / 3 - r - margin);
    placed.push_back({cx, lo, hi});
    o.x = static_cast<double>(cx) / kSub;
    o.y = static_cast<double>(cy) / kSub;
    o.radius = static_cast<double>(r) / kSub;
    sc.objects.push_back(o);
  }

  Background bg;
  bg.base = static_cast<int>(rng.range(112, 140));
  bg.grad_x = static_cast<int>(rng.range(-12, 12));
  bg.grad_y = static_cast<int>(rng.range(-12, 12));
  sc.image.width = sc.image.height = size;
  sc.image.data.assign(static_cast<size_t>(size) * size * 3, 0);
  render_background(sc.image, bg, key);
  for (const auto& o : sc.objects)
    render_object(sc.image, o.shape, o.colour, static_cast<int64_t>(o.x * kSub),
                  static_cast<int64_t>(o.y * kSub), static_cast<int64_t>(o.radius * kSub));

  sc.captions.push_back(canonical_caption(sc.objects));
  for (auto& c : varied_captions(sc.objects, rng)) sc.captions.push_back(std::move(c));
  sc.questions = make_questions(sc.objects, rng);
  return sc;
}

// ---------------------------------------------------------------------------------------------
// Writing a scene set

namespace {

std::string image_file_name(int64_t i) {
  std::string s = std::to_string(i);
  if (s.size() < 6) s.insert(0, 6 - s.size(), '0');
  return "images/" + s + ".png";
}

// A sibling of `target` that does not exist yet, created as an empty folder.
fs::path make_sibling_dir(const fs::path& target, const std::string& tag) {
  const fs::path parent = target.parent_path();
  for (int k = 0; k < 1000; ++k) {
    const fs::path p = parent / ("." + target.filename().string() + ".kvlens-" + tag + "-" +
                                 std::to_string(getpid()) + "-" + std::to_string(k));
    std::error_code ec;
    if (fs::create_directory(p, ec)) return p;
    if (ec) throw InputError("cannot create a folder in '" + parent.string() + "': " + ec.message());
  }
  throw InputError("cannot find a free temporary folder name beside '" + target.string() + "'");
}

nlohmann::ordered_json object_json(const SceneObject& o) {
  return {{"shape", shape_name(o.shape)}, {"colour", colour_name(o.colour)}, {"size", size_name(o.size)},
          {"x", o.x}, {"y", o.y}, {"radius", o.radius}, {"cell", cell_name(o.cell)}};
}

void fill_scene_set(const fs::path& dir, int64_t n, uint64_t seed, const SceneOptions& opts) {
  std::error_code ec;
  fs::create_directory(dir / "images", ec);
  if (ec) throw InputError("cannot create folder '" + (dir / "images").string() + "': " + ec.message());

  std::vector<Scene> scenes(static_cast<size_t>(n));
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t i = 0; i < n; ++i) {
    if (failed.load(std::memory_order_relaxed)) continue;
    try {
      Scene sc = generate_scene(seed, i, opts);
      write_png((dir / image_file_name(i)).string(), sc.image);
      sc.image = RGBImage{};
      scenes[static_cast<size_t>(i)] = std::move(sc);
    } catch (...) {
#pragma omp critical(kvlens_scenes_error)
      if (!failed.exchange(true)) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);

  nlohmann::ordered_json j;
  j["info"] = {{"generator", "kvlens scenes"}, {"seed", seed}, {"n", n}, {"size", opts.size}};
  // Built apart and moved in at the end: ordered_json keeps its keys in a vector, so a
  // reference into `j` would not survive adding the next key.
  nlohmann::ordered_json images = nlohmann::ordered_json::array();
  nlohmann::ordered_json anns = nlohmann::ordered_json::array(), qs = nlohmann::ordered_json::array();
  int64_t qid = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Scene& sc = scenes[static_cast<size_t>(i)];
    nlohmann::ordered_json objs = nlohmann::ordered_json::array();
    for (const auto& o : sc.objects) objs.push_back(object_json(o));
    images.push_back({{"id", i}, {"file_name", image_file_name(i)}, {"width", opts.size},
                      {"height", opts.size}, {"objects", std::move(objs)}});
    for (size_t k = 0; k < sc.captions.size(); ++k)
      anns.push_back({{"id", i * 5 + static_cast<int64_t>(k)}, {"image_id", i}, {"caption", sc.captions[k]}});
    for (const auto& q : sc.questions)
      qs.push_back({{"id", qid++}, {"image_id", i}, {"question", q.question}, {"answer", q.answer}, {"type", q.type}});
  }
  j["images"] = std::move(images);
  j["annotations"] = std::move(anns);
  j["questions"] = std::move(qs);
  const fs::path ann = dir / "annotations.json";
  write_file_atomic(ann.string(), j.dump(1) + "\n", "scene annotations");
}

}  // namespace

void write_scene_set(const std::string& out_dir, int64_t n, uint64_t seed, bool force,
                     const SceneOptions& opts) {
  if (n <= 0 || n > kMaxScenes)
    throw InputError("number of scenes must be in [1, " + std::to_string(kMaxScenes) + "], got " + std::to_string(n));
  check_size(opts.size);
  if (out_dir.empty()) throw InputError("output folder must not be empty");

  fs::path target = fs::path(out_dir).lexically_normal();
  if (target.filename().empty() && target.has_parent_path()) target = target.parent_path();
  const std::string fname = target.filename().string();
  if (fname.empty() || fname == "." || fname == ".." || target == target.root_path())
    throw InputError("output folder '" + out_dir + "' must name a folder (not '.', '..' or '/')");
  if (target.parent_path().empty()) target = fs::path(".") / target;

  std::error_code ec;
  const fs::file_status st = fs::status(target, ec);
  const bool exists = fs::exists(st);
  if (exists && !fs::is_directory(st))
    throw InputError("output folder '" + out_dir + "' exists and is not a folder");
  if (exists && !fs::is_empty(target, ec)) {
    if (!force)
      throw InputError("output folder '" + out_dir + "' exists and is not empty; replacing it needs force (--force)");
    if (!fs::exists(target / "annotations.json", ec))
      throw InputError("output folder '" + out_dir +
                       "' is not empty and holds no scene set (no annotations.json); refusing to replace it");
  }

  // Create missing parents, remembering the topmost one to remove on failure.
  const fs::path parent = target.parent_path();
  fs::path created_top;
  if (!fs::exists(parent, ec)) {
    for (fs::path p = parent; !p.empty() && !fs::exists(p, ec); p = p.parent_path()) {
      created_top = p;
      if (p == p.parent_path()) break;
    }
    fs::create_directories(parent, ec);
    if (ec) {
      if (!created_top.empty()) fs::remove_all(created_top, ec);
      throw InputError("cannot create output folder '" + out_dir + "': " + ec.message());
    }
  } else if (!fs::is_directory(parent, ec)) {
    throw InputError("cannot create output folder '" + out_dir + "': '" + parent.string() + "' is not a folder");
  }

  // Folders left by an earlier run that was killed mid-way (its process is gone).
  remove_stale_temporaries(parent.string());

  fs::path tmp;
  auto clean_up = [&] {
    std::error_code ignored;
    if (!tmp.empty()) fs::remove_all(tmp, ignored);
    if (!created_top.empty()) fs::remove_all(created_top, ignored);
  };
  try {
    tmp = make_sibling_dir(target, "partial");
    fill_scene_set(tmp, n, seed, opts);
    if (exists) {
      const fs::path old = make_sibling_dir(target, "old");
      fs::remove(old);
      fs::rename(target, old);
      try {
        fs::rename(tmp, target);
      } catch (...) {
        fs::rename(old, target);
        throw;
      }
      fs::remove_all(old, ec);
    } else {
      fs::rename(tmp, target);
    }
  } catch (const fs::filesystem_error& e) {
    clean_up();
    throw InputError("cannot write scene set to '" + out_dir + "': " + e.code().message());
  } catch (...) {
    clean_up();
    throw;
  }
}

}  // namespace kvlens
