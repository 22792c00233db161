// The parts the scene generators share: see core/data/scene_parts.h.
#include "core/data/scene_parts.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"

namespace kvlens::scene_parts {

namespace {
constexpr int kRadiusAt256[kNumSizeClasses] = {14, 22, 32};
}  // namespace

// Radius of a size class in 1/8 pixel units, rounded.
int64_t radius_units(SizeClass s, int size) {
  return (int64_t{kRadiusAt256[static_cast<int>(s)]} * kSub * size + 128) / 256;
}

void check_version(int version) {
  if (version != kClassicScenes && version != kRichScenes)
    throw InputError("scene generator version must be " + std::to_string(kClassicScenes) + " (classic) or " +
                     std::to_string(kRichScenes) + " (rich), got " + std::to_string(version));
}

int64_t rich_radius_units(SizeClass s, int size) {
  static constexpr int kAt336[4] = {9, 26, 38, 5};  // small, medium, large, tiny
  return (int64_t{kAt336[static_cast<int>(s)]} * kSub * size + 168) / 336;
}

void check_size(int size) {
  if (size < kMinSceneSize || size > kMaxSceneSize)
    throw InputError("scene size must be in [" + std::to_string(kMinSceneSize) + ", " +
                     std::to_string(kMaxSceneSize) + "] pixels, got " + std::to_string(size));
}

uint64_t scene_key(uint64_t seed, int64_t index) {
  return mix64(mix64(seed ^ 0x6B766C656E73ULL) ^ static_cast<uint64_t>(index));
}

namespace {

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
  int base;            // grey level
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

int64_t floor_mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }
int64_t floor_div(int64_t a, int64_t m) { return (a - floor_mod(a, m)) / m; }

// Whether the pixel at offset (ox, oy) from the object's centre (1/8 px) takes the pattern's
// shade: stripes at 45°, dots on a square lattice, checks; period 8 px at 336.
bool in_shade(Pattern pattern, int64_t ox, int64_t oy, int64_t period) {
  const int64_t half = period / 2;
  switch (pattern) {
    case Pattern::Solid: return false;
    case Pattern::Striped: return floor_mod(floor_div(ox + oy, half), 2) == 1;
    case Pattern::Dotted: {
      const int64_t u = floor_mod(ox, period) - half, v = floor_mod(oy, period) - half;
      return 100 * (u * u + v * v) <= 9 * period * period;  // radius 0.3 of the period
    }
    case Pattern::Checked: return floor_mod(floor_div(ox, half) + floor_div(oy, half), 2) == 1;
  }
  return false;
}


void render_object(RGBImage& img, Shape s, Colour c, int64_t cx, int64_t cy, int64_t r, Pattern pattern) {
  const std::vector<Pt> poly = polygon(s, r);
  const auto fill = colour_rgb(c);
  const auto shade = pattern_rgb(c);
  const int64_t period = std::max<int64_t>(4 * kSub, int64_t{8} * kSub * img.width / 336);
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
      const auto& rgb = in_shade(pattern, px * kSub + kSub / 2 - cx, py * kSub + kSub / 2 - cy, period) ? shade : fill;
      uint8_t* p = &img.data[static_cast<size_t>((py * img.width + px) * 3)];
      for (int ch = 0; ch < 3; ++ch) p[ch] = static_cast<uint8_t>((p[ch] * (16 - cover) + rgb[ch] * cover + 8) / 16);
    }
  }
}

}  // namespace

void render_scene(Scene& sc, int size, Rng& rng, uint64_t key) {
  Background bg;
  bg.base = static_cast<int>(rng.range(112, 140));
  bg.grad_x = static_cast<int>(rng.range(-12, 12));
  bg.grad_y = static_cast<int>(rng.range(-12, 12));
  sc.image.width = sc.image.height = size;
  sc.image.data.assign(static_cast<size_t>(size) * size * 3, 0);
  render_background(sc.image, bg, key);
  for (const auto& o : sc.objects)
    render_object(sc.image, o.shape, o.colour, static_cast<int64_t>(o.x * kSub), static_cast<int64_t>(o.y * kSub),
                  static_cast<int64_t>(o.radius * kSub), o.pattern);
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
  const std::string pattern = o.pattern == Pattern::Solid ? "" : std::string(pattern_name(o.pattern)) + " ";
  return std::string(size_name(o.size)) + " " + pattern + colour_name(o.colour) + " " + shape_name(o.shape);
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


}  // namespace kvlens::scene_parts
