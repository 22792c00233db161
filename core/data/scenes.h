// Procedural scenes: small synthetic images of 1–4 coloured shapes on a textured grey
// background, with five reference captions and a few VQA pairs per image. They give the
// captioning and VQA evaluations a data set whose ground truth is known exactly.
//
// Everything is a deterministic function of (seed, index): the generator draws from its own
// splitmix64 stream and renders with integer arithmetic only (geometry in 1/8 pixel units,
// 4×4 supersampled coverage), so pixels and text are identical on every platform and compiler.
//
// Layout of a scene of side S: the image is a 3×3 grid of cells; each object sits in its own
// cell, inside a disc of its radius that keeps a margin from the cell's border, so objects never
// overlap, never leave the image and their relations are unambiguous. No two objects of one
// scene share both colour and shape. In two-object scenes the two cells never lie on an exact
// diagonal, so one axis (horizontal or vertical) always dominates. In scenes of 3–4 objects no
// column holds more than two objects and two objects of one column are at least 6 px (at 256)
// apart in x, so the left-to-right order is never a near tie.
//
// Shape geometry, in units of the object's radius r (all shapes fit in the disc of radius r):
// circle radius 0.95; square half-side 0.70; triangle pointing up with vertices on the circle of
// radius 1; five-pointed star with outer radius 1 and inner radius 0.45; ring between 0.55 and
// 0.95; cross (plus sign) with arms 0.30 half-wide and 0.90 long; diamond with half-width 0.65
// and half-height 0.95. The centre pixel is inside every shape except the ring.
//
// Rich scenes (generator version 2, 336 px by default: LLaVA-1.5's 576 patches of 14 px) give
// compression something to lose. Each has 1–3 main objects (medium or large, each solid,
// striped, dotted or checked), placed in cells as above — or, in a third of the two-object
// scenes, an overlapping pair, the front one partly hiding the one behind; in four scenes of
// five a group of 2–9 identical small objects (9 px radius at 336) scattered in the free space,
// the count to read; in three of four a single tiny object (5 px radius: 10 px across, smaller
// than one 14-px patch) whose colour, shape and place the questions ask. Every object's (shape,
// colour) is its own. Captions: rich_canonical_caption and four wordings of it, none of which
// states how many objects the scene has in all. Questions (4–8): the group's count, the tiny
// object's colour, shape, place and presence, each main object's pattern and place, which of
// the named main objects is further left or higher up (or in front), which is larger, presence.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/data/image.h"

namespace kvlens {

enum class Shape : int { Circle, Square, Triangle, Star, Ring, Cross, Diamond };
enum class Colour : int { Red, Green, Blue, Yellow, Purple, Orange, White, Black };
enum class SizeClass : int { Small, Medium, Large, Tiny };  // Tiny: rich scenes only
// Fill patterns (rich scenes): solid, diagonal stripes, dots, checks of the fill colour and its shade.
enum class Pattern : int { Solid, Striped, Dotted, Checked };
// An object's part in a rich scene: one of the 1–3 main objects, one of a group of identical small
// ones (the count), or the single tiny one (the detail). Classic scenes have main objects only.
enum class Role : int { Main, Group, Tiny };

constexpr int kNumShapes = 7;
constexpr int kNumColours = 8;
constexpr int kNumSizeClasses = 3;  // of the classic scenes (small, medium, large)
constexpr int kNumPatterns = 4;
constexpr int kGridSide = 3;  // the image is a kGridSide × kGridSide grid of cells
constexpr int kMinObjects = 1, kMaxObjects = 4;  // classic scenes
constexpr int kMinSceneSize = 64, kMaxSceneSize = 4096;
// Generator versions: 1 the classic scenes (256 px by default), 2 the rich ones (336 px, LLaVA-1.5's
// 576 patches of 14 px; core/data/scenes_rich.cpp).
constexpr int kClassicScenes = 1, kRichScenes = 2;
constexpr int kRichMaxMain = 3, kRichMinGroup = 2, kRichMaxGroup = 9;
// Most scenes one set holds (their records are kept in memory while the set is written).
constexpr int64_t kMaxScenes = 1000000;

// Canonical lower-case names, as used in captions, questions and annotations.json.
const char* shape_name(Shape s);
const char* colour_name(Colour c);
const char* size_name(SizeClass s);
// "plain", "striped", "dotted", "checked".
const char* pattern_name(Pattern p);
// Plural of a shape name: "circles", "crosses", ...
std::string shape_plural(Shape s);
// Cell names, row-major from the top left: "top left", "top", "top right", "left", "center",
// "right", "bottom left", "bottom", "bottom right". Throws InputError outside 0..8.
const char* cell_name(int cell);
// "one" .. "nine"; throws InputError outside 1..9.
const char* count_word(int n);
// Fill colour of an object. The palette is chosen so that all 8 colours and the grey
// background stay far apart after a bicubic resize to 224 px.
std::array<uint8_t, 3> colour_rgb(Colour c);
// Radius in pixels of a size class in a scene of side `scene_size`: classic scenes 14 / 22 / 32 px
// at 256 (small / medium / large; no tiny), rich scenes 5 / 9 / 26 / 38 px at 336 (tiny / small /
// medium / large).
double size_radius(SizeClass s, int scene_size, int version = kClassicScenes);
// The shade a pattern alternates with the fill colour: the colour darkened, or lightened for the
// dark ones (blue, purple, black), so the pattern shows on every colour.
std::array<uint8_t, 3> pattern_rgb(Colour c);

struct SceneObject {
  Shape shape = Shape::Circle;
  Colour colour = Colour::Red;
  SizeClass size = SizeClass::Small;
  double x = 0, y = 0;   // centre in pixels (x right, y down; pixel i covers [i, i+1))
  double radius = 0;     // pixels; the shape lies inside the disc of this radius
  int cell = 0;          // 0..8, row-major grid cell holding the centre
  Pattern pattern = Pattern::Solid;
  Role role = Role::Main;
  int in_front_of = -1;  // rich scenes: index of the main object this one partly hides, or -1
};

struct VqaPair {
  std::string question, answer;
  // "count", "colour", "exist", "where" or "larger"; rich scenes also "shape", "pattern",
  // "relation" and "front"
  std::string type;
};

struct SceneOptions {
  // Image side in pixels, in [kMinSceneSize, kMaxSceneSize]; 0: the version's own (scene_side).
  int size = 0;
  int version = kClassicScenes;  // kClassicScenes or kRichScenes
};
// The side a scene of these options has: size, or 256 for classic and 336 for rich scenes when 0.
int scene_side(const SceneOptions& opts);

struct Scene {
  uint64_t seed = 0;
  int64_t index = 0;
  RGBImage image;
  std::vector<SceneObject> objects;
  // Exactly 5. captions[0] is the canonical caption (see canonical_caption); the other four
  // vary the wording but keep naming every object, the count and the relations.
  std::vector<std::string> captions;
  std::vector<VqaPair> questions;  // 3..6 pairs, short lower-case answers
};

// Throws InputError for a negative index or a size outside [kMinSceneSize, kMaxSceneSize].
Scene generate_scene(uint64_t seed, int64_t index, const SceneOptions& opts = {});

// The canonical caption: a fixed grammar over "<size> <colour> <shape>" descriptions.
//   1 object:    "a large red circle in the top left."  (at the top / on the left / in the
//                center / ... for the other cells)
//   2 objects:   "a large red circle left of a small blue star." when the horizontal axis
//                dominates (the left one first), "a ... above a ..." otherwise (upper first)
//   3–4 objects: "three shapes: a large red circle, a small blue star and a medium green
//                ring, from left to right." ordered by x
std::string canonical_caption(const std::vector<SceneObject>& objects);

// The canonical caption of a rich scene: its main objects as canonical_caption words one or two
// (with their patterns: "a large striped red circle left of a medium blue square"), three as
// "<a>, <b> and <c>, from left to right", an overlapping pair as "<front> in front of <back>"; then "; <count> small <colour> <shapes>" for the
// group and "; a tiny <colour> <shape> <where>" for the tiny one; a final ".".
std::string rich_canonical_caption(const std::vector<SceneObject>& objects);

// Writes n scenes (indices 0..n-1) to out_dir: images/000000.png ... and annotations.json in
// COCO caption layout plus "questions". Scenes are generated in parallel (OpenMP). The set is
// built in a temporary sibling folder and renamed into place at the end, so a failure leaves
// nothing behind. Throws InputError when n <= 0, the size is out of range, out_dir (or its
// parent) cannot be created or written, out_dir exists and is not a folder, or out_dir is a
// non-empty folder and `force` is false. With `force`, an existing folder is replaced only
// when it is empty or holds a previous scene set (an annotations.json), never anything else.
void write_scene_set(const std::string& out_dir, int64_t n, uint64_t seed, bool force,
                     const SceneOptions& opts = {});

}  // namespace kvlens
