// The parts the scene generators share (core/data/scenes.cpp, the classic scenes, and
// core/data/scenes_rich.cpp, the rich ones): the random stream, integer rasterisation of the
// shapes and their fill patterns on the textured background, and the caption wording. Internal
// to core/data: everything here is a deterministic function of its inputs, so a scene is the
// same on every platform.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/data/image.h"
#include "core/data/scenes.h"

namespace kvlens::scene_parts {

constexpr int kSub = 8;  // geometry unit: 1/8 pixel

// Radius of a size class of the classic scenes in 1/8 pixel units, rounded (14 / 22 / 32 px at 256).
int64_t radius_units(SizeClass s, int size);
// Throws InputError for a side outside [kMinSceneSize, kMaxSceneSize].
void check_size(int size);
// Throws InputError for a generator version other than kClassicScenes or kRichScenes.
void check_version(int version);
// Radius of a size class of the rich scenes in 1/8 pixel units, rounded (5 / 9 / 26 / 38 px at
// 336: tiny, small, medium, large).
int64_t rich_radius_units(SizeClass s, int size);
// A rich scene (core/data/scenes_rich.cpp); seed, index and size already checked.
Scene generate_rich_scene(uint64_t seed, int64_t index, int size);

// ---------------------------------------------------------------------------------------------
// Random numbers: splitmix64, with integer helpers only (no std:: distributions), so every
// platform draws the same sequence.

inline uint64_t mix64(uint64_t z) {
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

uint64_t scene_key(uint64_t seed, int64_t index);

// ---------------------------------------------------------------------------------------------
// Drawing, integer only (coordinates in 1/8 pixel units): the textured grey background, then
// each shape with 4×4 supersampled coverage, a pattern other than solid alternating the fill
// colour with its shade (pattern_rgb) in a lattice fixed to the object's centre.

// The scene's image: the background's grey level and gradients drawn from `rng`, its texture
// from `key`, then every object in order.
void render_scene(Scene& sc, int size, Rng& rng, uint64_t key);

// ---------------------------------------------------------------------------------------------
// Text

int col_of(const SceneObject& o);
int row_of(const SceneObject& o);
std::string with_article(const std::string& s);
// "<size> [<pattern>] <colour> <shape>": the pattern word only for a pattern other than solid.
std::string describe(const SceneObject& o);
std::string short_name(const SceneObject& o);  // "<colour> <shape>"
// Location phrases per cell, matching cell_name ("in the top left", "at the top", ...).
extern const char* const kCellPhrase[9];
// By x (generated scenes keep x apart).
std::vector<SceneObject> left_to_right(std::vector<SceneObject> objs);
// For two objects: whether the horizontal axis dominates, and the pair ordered (left or upper first).
bool horizontal_pair(const SceneObject& a, const SceneObject& b);
std::pair<SceneObject, SceneObject> ordered_pair(const SceneObject& a, const SceneObject& b);
std::string join_list(const std::vector<std::string>& items);

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
  std::string pattern(Pattern p) {
    static const std::vector<std::string> w[4] = {{""}, {"striped", "stripy"}, {"dotted", "spotted"}, {"checked", "checkered"}};
    return rng.pick(w[static_cast<int>(p)]);
  }
  std::string bare(const SceneObject& o) {  // "big red circle", "big striped red circle"
    const std::string sz = size(o.size);
    const std::string pt = o.pattern == Pattern::Solid ? "" : pattern(o.pattern) + " ";
    const std::string sh = shape(o.shape);
    return sz + " " + pt + colour_name(o.colour) + " " + sh;
  }
  std::string a(const SceneObject& o) { return with_article(bare(o)); }  // "a big red circle"
};

// Four captions of 1–4 objects in the classic grammar's varied wordings (canonical_caption's
// content, other words), each ending in ".".
std::vector<std::string> varied_captions(const std::vector<SceneObject>& objs, Rng& rng);

}  // namespace kvlens::scene_parts
