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

#include "core/data/scene_parts.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/parallel.h"

namespace kvlens {
namespace fs = std::filesystem;
using namespace scene_parts;

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
const char* const kSizeNames[] = {"small", "medium", "large", "tiny"};
const char* const kPatternNames[] = {"plain", "striped", "dotted", "checked"};
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
static_assert(sizeof(kPatternNames) / sizeof(kPatternNames[0]) == kNumPatterns);
}  // namespace

const char* shape_name(Shape s) { return name_at(kShapeNames, static_cast<int>(s), "shape id"); }
const char* colour_name(Colour c) { return name_at(kColourNames, static_cast<int>(c), "colour id"); }
const char* size_name(SizeClass s) { return name_at(kSizeNames, static_cast<int>(s), "size class"); }
const char* pattern_name(Pattern p) { return name_at(kPatternNames, static_cast<int>(p), "pattern id"); }
std::string shape_plural(Shape s) { return std::string(shape_name(s)) + (s == Shape::Cross ? "es" : "s"); }
const char* cell_name(int cell) { return name_at(kCellNames, cell, "grid cell"); }
const char* count_word(int n) { return name_at(kCountWords, n, "count", 1); }
std::array<uint8_t, 3> colour_rgb(Colour c) {
  colour_name(c);  // range check
  return kPalette[static_cast<int>(c)];
}
std::array<uint8_t, 3> pattern_rgb(Colour c) {
  const auto rgb = colour_rgb(c);
  const bool dark = c == Colour::Blue || c == Colour::Purple || c == Colour::Black;
  std::array<uint8_t, 3> out{};
  for (int i = 0; i < 3; ++i) out[i] = static_cast<uint8_t>(dark ? (rgb[i] + 2 * 255) / 3 : rgb[i] * 2 / 5);
  return out;
}

namespace {

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

double size_radius(SizeClass s, int scene_size, int version) {
  check_size(scene_size);
  size_name(s);  // range check
  if (version == kRichScenes) return static_cast<double>(rich_radius_units(s, scene_size)) / kSub;
  if (version != kClassicScenes)
    throw InputError("scene generator version must be 1 or 2, got " + std::to_string(version));
  if (s == SizeClass::Tiny) throw InputError("size class tiny is in rich scenes only (generator version 2)");
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

int scene_side(const SceneOptions& opts) {
  return opts.size != 0 ? opts.size : opts.version == kRichScenes ? 336 : 256;
}

Scene generate_scene(uint64_t seed, int64_t index, const SceneOptions& opts) {
  check_version(opts.version);
  const int size = scene_side(opts);
  check_size(size);
  if (index < 0) throw InputError("scene index must be >= 0, got " + std::to_string(index));
  if (opts.version == kRichScenes) return generate_rich_scene(seed, index, size);
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

  render_scene(sc, size, rng, key);

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

nlohmann::ordered_json object_json(const SceneObject& o, int version) {
  nlohmann::ordered_json j = {{"shape", shape_name(o.shape)}, {"colour", colour_name(o.colour)},
                              {"size", size_name(o.size)}, {"x", o.x}, {"y", o.y}, {"radius", o.radius},
                              {"cell", cell_name(o.cell)}};
  if (version == kRichScenes) {
    static const char* const roles[] = {"main", "group", "tiny"};
    j["pattern"] = pattern_name(o.pattern);
    j["role"] = roles[static_cast<int>(o.role)];
    if (o.in_front_of >= 0) j["in_front_of"] = o.in_front_of;
  }
  return j;
}

void fill_scene_set(const fs::path& dir, int64_t n, uint64_t seed, const SceneOptions& opts) {
  std::error_code ec;
  fs::create_directory(dir / "images", ec);
  if (ec) throw InputError("cannot create folder '" + (dir / "images").string() + "': " + ec.message());

  std::vector<Scene> scenes(static_cast<size_t>(n));
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  // Every core unless the user says otherwise (OMP_NUM_THREADS, --threads): the CLI keeps
  // OpenMP's own loops at one thread for the model's sake (core/parallel.h).
  const int threads = product_threads();
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
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
  if (opts.version != kClassicScenes) j["info"]["version"] = opts.version;  // a classic set names no version
  // Built apart and moved in at the end: ordered_json keeps its keys in a vector, so a
  // reference into `j` would not survive adding the next key.
  nlohmann::ordered_json images = nlohmann::ordered_json::array();
  nlohmann::ordered_json anns = nlohmann::ordered_json::array(), qs = nlohmann::ordered_json::array();
  int64_t qid = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Scene& sc = scenes[static_cast<size_t>(i)];
    nlohmann::ordered_json objs = nlohmann::ordered_json::array();
    for (const auto& o : sc.objects) objs.push_back(object_json(o, opts.version));
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
                     const SceneOptions& options) {
  SceneOptions opts = options;
  check_version(opts.version);
  opts.size = scene_side(options);
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
