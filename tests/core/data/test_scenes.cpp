// Procedural scenes: determinism, layout rules, captions and VQA answers checked against the
// object list, rendered pixels, the written scene set, and bad-input handling (core and CLI).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/data/image.h"
#include "models/preprocess/clip_image.h"
#include "core/data/scenes.h"

namespace fs = std::filesystem;
using namespace kvlens;

namespace {

// Expected vocabulary, written out here independently of the generator.
const std::vector<std::string> kShapes = {"circle", "square", "triangle", "star",
                                          "ring",   "cross",  "diamond"};
const std::vector<std::string> kColours = {"red",    "green",  "blue",  "yellow",
                                           "purple", "orange", "white", "black"};
const std::vector<std::string> kSizes = {"small", "medium", "large"};
const std::vector<std::string> kCells = {"top left",    "top",    "top right",
                                         "left",        "center", "right",
                                         "bottom left", "bottom", "bottom right"};
const std::vector<std::string> kCounts = {"one", "two", "three", "four"};

std::string shape_of(const SceneObject& o) { return kShapes[static_cast<int>(o.shape)]; }
std::string colour_of(const SceneObject& o) { return kColours[static_cast<int>(o.colour)]; }
std::string describe(const SceneObject& o) {
  return kSizes[static_cast<int>(o.size)] + " " + colour_of(o) + " " + shape_of(o);
}
std::string short_name(const SceneObject& o) { return colour_of(o) + " " + shape_of(o); }

// Grid cell recomputed from the geometry.
int cell_from_xy(const SceneObject& o, int size) {
  const int col = static_cast<int>(std::floor(o.x * 3 / size));
  const int row = static_cast<int>(std::floor(o.y * 3 / size));
  return row * 3 + col;
}

std::string strip_article(const std::string& s) {
  if (s.rfind("a ", 0) == 0) return s.substr(2);
  if (s.rfind("an ", 0) == 0) return s.substr(3);
  return s;
}

const SceneObject* find_by(const std::vector<SceneObject>& objs, const std::string& name,
                           std::string (*key)(const SceneObject&)) {
  const SceneObject* hit = nullptr;
  for (const auto& o : objs)
    if (key(o) == name) {
      EXPECT_EQ(hit, nullptr) << "'" << name << "' names more than one object";
      hit = &o;
    }
  return hit;
}

std::array<int, 3> pixel(const RGBImage& img, int x, int y) {
  const uint8_t* p = &img.data[static_cast<size_t>((y * img.width + x) * 3)];
  return {p[0], p[1], p[2]};
}

double dist(std::array<int, 3> a, std::array<uint8_t, 3> b) {
  double s = 0;
  for (int c = 0; c < 3; ++c) s += (a[c] - b[c]) * double(a[c] - b[c]);
  return std::sqrt(s);
}

// Nearest palette colour, or -1 when the grey background colour is nearer.
int nearest_palette(std::array<int, 3> px) {
  int best = -1;
  double bd = dist(px, {128, 128, 128});
  for (int c = 0; c < kNumColours; ++c) {
    const double d = dist(px, colour_rgb(static_cast<Colour>(c)));
    if (d < bd) bd = d, best = c;
  }
  return best;
}

// Area of each shape in units of r², from the geometry documented in core/data/scenes.h.
double shape_area(Shape s) {
  const double pi = 3.14159265358979;
  switch (s) {
    case Shape::Circle: return pi * 0.95 * 0.95;
    case Shape::Square: return 1.4 * 1.4;
    case Shape::Triangle: return 3 * std::sqrt(3.0) / 4;
    case Shape::Star: return 5 * 0.45 * std::sin(36 * pi / 180);
    case Shape::Ring: return pi * (0.95 * 0.95 - 0.55 * 0.55);
    case Shape::Cross: return 2 * (0.6 * 1.8) - 0.36;
    case Shape::Diamond: return 2 * 0.65 * 0.95;
  }
  return 0;
}

// A fresh, empty scratch folder for one test.
fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("kvlens_test_scenes_" + std::to_string(getpid()) + "_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> s;
  for (const auto& e : fs::recursive_directory_iterator(dir)) s.insert(e.path().string());
  return s;
}

std::vector<Scene> many_scenes(uint64_t seed, int n, int size = 256) {
  std::vector<Scene> v;
  SceneOptions o;
  o.size = size;
  for (int i = 0; i < n; ++i) v.push_back(generate_scene(seed, i, o));
  return v;
}

}  // namespace

TEST(Scenes, NamesAndPaletteAreDistinct) {
  for (int i = 0; i < kNumShapes; ++i) EXPECT_EQ(shape_name(static_cast<Shape>(i)), kShapes[i]);
  for (int i = 0; i < kNumColours; ++i) EXPECT_EQ(colour_name(static_cast<Colour>(i)), kColours[i]);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(cell_name(i), kCells[i]);
  EXPECT_THROW(cell_name(9), InputError);
  EXPECT_THROW(count_word(0), InputError);
  for (int a = 0; a < kNumColours; ++a) {
    const auto ca = colour_rgb(static_cast<Colour>(a));
    for (int b = a + 1; b < kNumColours; ++b)
      EXPECT_GT(dist({ca[0], ca[1], ca[2]}, colour_rgb(static_cast<Colour>(b))), 80.0)
          << kColours[a] << " vs " << kColours[b];
    for (int g = 90; g <= 165; g += 5) EXPECT_GT(dist({g, g, g}, ca), 80.0) << kColours[a] << " vs grey " << g;
  }
  EXPECT_LT(size_radius(SizeClass::Small, 256), size_radius(SizeClass::Medium, 256) - 4);
  EXPECT_LT(size_radius(SizeClass::Medium, 256), size_radius(SizeClass::Large, 256) - 4);
}

TEST(Scenes, Deterministic) {
  const Scene a = generate_scene(7, 3), b = generate_scene(7, 3);
  EXPECT_EQ(a.image.data, b.image.data);
  EXPECT_EQ(a.captions, b.captions);
  ASSERT_EQ(a.questions.size(), b.questions.size());
  for (size_t i = 0; i < a.questions.size(); ++i) {
    EXPECT_EQ(a.questions[i].question, b.questions[i].question);
    EXPECT_EQ(a.questions[i].answer, b.questions[i].answer);
  }
  EXPECT_NE(a.image.data, generate_scene(8, 3).image.data);
  EXPECT_NE(a.image.data, generate_scene(7, 4).image.data);
  // Different seeds give different sets of scenes (not merely shifted noise).
  int same_caption = 0;
  for (int i = 0; i < 50; ++i) same_caption += generate_scene(1, i).captions[0] == generate_scene(2, i).captions[0];
  EXPECT_LT(same_caption, 5);
}

TEST(Scenes, BadArguments) {
  SceneOptions small;
  small.size = 16;
  EXPECT_THROW(generate_scene(0, 0, small), InputError);
  EXPECT_THROW(generate_scene(0, -1), InputError);
  EXPECT_THROW(canonical_caption({}), InputError);
}

TEST(Scenes, LayoutRules) {
  for (int size : {256, 224, 64}) {
    std::set<size_t> counts;
    for (const Scene& sc : many_scenes(11, 150, size)) {
      const auto& objs = sc.objects;
      ASSERT_GE(objs.size(), 1u);
      ASSERT_LE(objs.size(), 4u);
      counts.insert(objs.size());
      EXPECT_EQ(sc.image.width, size);
      EXPECT_EQ(sc.image.height, size);
      for (size_t i = 0; i < objs.size(); ++i) {
        const auto& o = objs[i];
        EXPECT_GE(o.x - o.radius, 0);
        EXPECT_GE(o.y - o.radius, 0);
        EXPECT_LE(o.x + o.radius, size);
        EXPECT_LE(o.y + o.radius, size);
        EXPECT_EQ(o.cell, cell_from_xy(o, size));
        EXPECT_DOUBLE_EQ(o.radius, size_radius(o.size, size));
        for (size_t j = i + 1; j < objs.size(); ++j) {
          const auto& p = objs[j];
          EXPECT_GT(std::hypot(o.x - p.x, o.y - p.y), o.radius + p.radius) << "overlap in scene " << sc.index;
          EXPECT_FALSE(o.shape == p.shape && o.colour == p.colour) << "duplicate in scene " << sc.index;
          EXPECT_NE(o.cell, p.cell);
          if (objs.size() >= 3) {
            EXPECT_GE(std::abs(o.x - p.x), 6.0 * size / 256 - 0.25) << "x near tie in scene " << sc.index;
          }
        }
      }
    }
    EXPECT_EQ(counts.size(), 4u) << "all object counts 1..4 should occur";
  }
}

TEST(Scenes, CaptionsNameObjectsAndCounts) {
  for (const Scene& sc : many_scenes(5, 200)) {
    ASSERT_EQ(sc.captions.size(), 5u);
    EXPECT_EQ(std::set<std::string>(sc.captions.begin(), sc.captions.end()).size(), 5u);
    const std::string& c0 = sc.captions[0];
    EXPECT_EQ(c0, canonical_caption(sc.objects));
    const int n = static_cast<int>(sc.objects.size());
    for (const auto& cap : sc.captions) {
      ASSERT_FALSE(cap.empty());
      EXPECT_EQ(cap.back(), '.');
      for (char ch : cap) EXPECT_FALSE(ch >= 'A' && ch <= 'Z') << cap;
      // Articles agree with the next word ("an orange", "a red").
      const std::string padded = " " + cap;
      for (size_t at = padded.find(" a"); at != std::string::npos; at = padded.find(" a", at + 1)) {
        const bool an = padded.compare(at, 4, " an ") == 0, a = padded.compare(at, 3, " a ") == 0;
        if (!an && !a) continue;
        const char next = padded[at + (an ? 4 : 3)];
        EXPECT_EQ(an, std::string("aeiou").find(next) != std::string::npos) << cap;
      }
      for (const auto& o : sc.objects) {
        EXPECT_NE(cap.find(colour_of(o)), std::string::npos) << cap;
        if (o.shape != Shape::Circle && o.shape != Shape::Cross) {  // these have synonyms
          EXPECT_NE(cap.find(shape_of(o)), std::string::npos) << cap;
        }
      }
      if (n >= 3) {
        EXPECT_NE(cap.find(kCounts[n - 1]), std::string::npos) << cap;
      }
    }
    for (const auto& o : sc.objects) EXPECT_NE(c0.find(describe(o)), std::string::npos) << c0;
    if (n == 1) {
      const std::string cell = kCells[cell_from_xy(sc.objects[0], 256)];
      EXPECT_NE(c0.find(" " + cell + "."), std::string::npos) << c0;
    }
    if (n >= 3) {
      EXPECT_EQ(c0.rfind(kCounts[n - 1] + " shapes: ", 0), 0u) << c0;
      // Objects are listed by increasing x.
      for (const auto& a : sc.objects)
        for (const auto& b : sc.objects)
          if (a.x < b.x) {
            EXPECT_LT(c0.find(describe(a)), c0.find(describe(b))) << c0;
          }
    }
  }
}

TEST(Scenes, TwoObjectRelationsAgreeWithGeometry) {
  int horizontal = 0, vertical = 0;
  for (const Scene& sc : many_scenes(9, 200)) {
    if (sc.objects.size() != 2) continue;
    const std::string c0 = sc.captions[0];
    std::string rel = " left of ";
    size_t at = c0.find(rel);
    if (at == std::string::npos) at = c0.find(rel = " above ");
    ASSERT_NE(at, std::string::npos) << c0;
    const std::string first = strip_article(c0.substr(0, at));
    const std::string second = strip_article(c0.substr(at + rel.size(), c0.size() - at - rel.size() - 1));
    const SceneObject* a = find_by(sc.objects, first, describe);
    const SceneObject* b = find_by(sc.objects, second, describe);
    ASSERT_TRUE(a && b && a != b) << c0;
    const double dx = b->x - a->x, dy = b->y - a->y;
    if (rel == " left of ") {
      ++horizontal;
      EXPECT_GT(dx, 0) << c0;
      EXPECT_GT(std::abs(dx), std::abs(dy) + 20) << c0;
    } else {
      ++vertical;
      EXPECT_GT(dy, 0) << c0;
      EXPECT_GT(std::abs(dy), std::abs(dx) + 20) << c0;
    }
  }
  EXPECT_GT(horizontal, 10);
  EXPECT_GT(vertical, 10);
}

TEST(Scenes, VqaAnswersAgreeWithObjects) {
  std::map<std::string, int> types;
  int exist_yes = 0, exist_no = 0;
  for (const Scene& sc : many_scenes(3, 200)) {
    const auto& objs = sc.objects;
    ASSERT_GE(sc.questions.size(), 3u);
    ASSERT_LE(sc.questions.size(), 6u);
    for (const auto& q : sc.questions) {
      ++types[q.type];
      const std::string& s = q.question;
      ASSERT_EQ(s.back(), '?') << s;
      if (q.type == "count") {
        EXPECT_EQ(s, "how many shapes are there?");
        EXPECT_EQ(q.answer, kCounts[objs.size() - 1]);
      } else if (q.type == "colour") {
        const std::string pre = "what colour is the ";
        ASSERT_EQ(s.rfind(pre, 0), 0u) << s;
        const SceneObject* o = find_by(objs, s.substr(pre.size(), s.size() - pre.size() - 1), shape_of);
        ASSERT_NE(o, nullptr) << s;
        EXPECT_EQ(q.answer, colour_of(*o)) << s;
      } else if (q.type == "exist") {
        const std::string pre = "is there ";
        ASSERT_EQ(s.rfind(pre, 0), 0u) << s;
        const std::string subject = strip_article(s.substr(pre.size(), s.size() - pre.size() - 1));
        bool present = false;
        for (const auto& o : objs) present |= subject == shape_of(o) || subject == short_name(o);
        EXPECT_EQ(q.answer, present ? "yes" : "no") << s;
        (present ? exist_yes : exist_no)++;
      } else if (q.type == "where") {
        const std::string pre = "where is the ";
        ASSERT_EQ(s.rfind(pre, 0), 0u) << s;
        const SceneObject* o = find_by(objs, s.substr(pre.size(), s.size() - pre.size() - 1), short_name);
        ASSERT_NE(o, nullptr) << s;
        EXPECT_EQ(q.answer, kCells[cell_from_xy(*o, 256)]) << s;
      } else if (q.type == "larger") {
        const std::string pre = "which is larger, the ";
        ASSERT_EQ(s.rfind(pre, 0), 0u) << s;
        const size_t orr = s.find(" or the ");
        ASSERT_NE(orr, std::string::npos) << s;
        const SceneObject* a = find_by(objs, s.substr(pre.size(), orr - pre.size()), short_name);
        const SceneObject* b = find_by(objs, s.substr(orr + 8, s.size() - orr - 9), short_name);
        ASSERT_TRUE(a && b) << s;
        ASSERT_NE(a->radius, b->radius) << s;
        EXPECT_EQ(q.answer, "the " + short_name(a->radius > b->radius ? *a : *b)) << s;
      } else {
        ADD_FAILURE() << "unknown question type " << q.type;
      }
    }
  }
  for (const char* t : {"count", "colour", "exist", "where", "larger"}) EXPECT_GT(types[t], 20) << t;
  EXPECT_GT(exist_yes, 0.35 * (exist_yes + exist_no));
  EXPECT_GT(exist_no, 0.35 * (exist_yes + exist_no));
}

TEST(Scenes, PixelsShowObjectsOnAGreyBackground) {
  bool saw_partial = false;
  for (const Scene& sc : many_scenes(21, 80)) {
    const RGBImage& img = sc.image;
    // Image corners are never covered: grey and far from every object colour.
    for (auto [x, y] : {std::pair{0, 0}, {img.width - 1, 0}, {0, img.height - 1}}) {
      const auto p = pixel(img, x, y);
      EXPECT_LE(std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]}), 2);
      EXPECT_EQ(nearest_palette(p), -1);
      for (int c = 0; c < kNumColours; ++c) EXPECT_GT(dist(p, colour_rgb(static_cast<Colour>(c))), 60.0);
    }
    for (const auto& o : sc.objects) {
      const auto rgb = colour_rgb(o.colour);
      const double px = o.shape == Shape::Ring ? o.x + 0.75 * o.radius : o.x;
      const auto p = pixel(img, static_cast<int>(px), static_cast<int>(o.y));
      EXPECT_LT(dist(p, rgb), 10.0) << describe(o) << " in scene " << sc.index;
      // Pixels mostly covered by the object (nearer its colour than the background) add up to
      // the shape's area.
      int covered = 0;
      const int x0 = static_cast<int>(o.x - o.radius) - 1, x1 = static_cast<int>(o.x + o.radius) + 1;
      const int y0 = static_cast<int>(o.y - o.radius) - 1, y1 = static_cast<int>(o.y + o.radius) + 1;
      for (int y = std::max(0, y0); y <= std::min(img.height - 1, y1); ++y)
        for (int x = std::max(0, x0); x <= std::min(img.width - 1, x1); ++x) {
          const auto q = pixel(img, x, y);
          const double d = dist(q, rgb);
          covered += d < dist(q, {128, 128, 128}) && d < 120;
          saw_partial |= d > 30 && d < 100 && nearest_palette(q) == static_cast<int>(o.colour);
        }
      const double area = shape_area(o.shape) * o.radius * o.radius;
      EXPECT_NEAR(covered, area, 0.12 * area) << describe(o) << " in scene " << sc.index;
    }
  }
  EXPECT_TRUE(saw_partial) << "edges should be anti-aliased";
}

TEST(Scenes, ColoursSurviveBicubicResizeTo224) {
  for (const Scene& sc : many_scenes(4, 60)) {
    const RGBImage small = resize_bicubic(sc.image, 224, 224);
    const double k = 224.0 / 256.0;
    for (const auto& o : sc.objects) {
      const double px = o.shape == Shape::Ring ? o.x + 0.75 * o.radius : o.x;
      const auto p = pixel(small, static_cast<int>(px * k), static_cast<int>(o.y * k));
      EXPECT_EQ(nearest_palette(p), static_cast<int>(o.colour)) << describe(o) << " in scene " << sc.index;
    }
    EXPECT_EQ(nearest_palette(pixel(small, 0, 0)), -1);
  }
}

TEST(Scenes, WritesASceneSet) {
  const fs::path root = scratch("set");
  const fs::path out = root / "nested" / "scenes";
  SceneOptions opts;
  opts.size = 128;
  const int n = 12;
  write_scene_set(out.string(), n, 42, false, opts);
  EXPECT_EQ(std::distance(fs::directory_iterator(root / "nested"), fs::directory_iterator{}), 1)
      << "no temporary folders left beside the set";
  std::ifstream f(out / "annotations.json");
  ASSERT_TRUE(f.good());
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["info"]["seed"], 42);
  EXPECT_EQ(j["info"]["n"], n);
  ASSERT_EQ(j["images"].size(), size_t{n});
  ASSERT_EQ(j["annotations"].size(), size_t{5 * n});
  std::set<int64_t> ann_ids;
  std::map<int64_t, std::vector<std::string>> caps;
  for (const auto& a : j["annotations"]) {
    ann_ids.insert(a["id"].get<int64_t>());
    caps[a["image_id"].get<int64_t>()].push_back(a["caption"].get<std::string>());
  }
  EXPECT_EQ(ann_ids.size(), size_t{5 * n});
  for (int i = 0; i < n; ++i) {
    const auto& im = j["images"][i];
    EXPECT_EQ(im["id"], i);
    EXPECT_EQ(im["width"], 128);
    const Scene sc = generate_scene(42, i, opts);
    const fs::path png = out / im["file_name"].get<std::string>();
    ASSERT_TRUE(fs::exists(png)) << png;
    const RGBImage back = load_image(png.string());
    EXPECT_EQ(back.data, sc.image.data) << png;
    EXPECT_EQ(caps[i], sc.captions);
    ASSERT_EQ(im["objects"].size(), sc.objects.size());
    for (size_t k = 0; k < sc.objects.size(); ++k) {
      EXPECT_EQ(im["objects"][k]["shape"], shape_of(sc.objects[k]));
      EXPECT_EQ(im["objects"][k]["cell"], kCells[sc.objects[k].cell]);
      EXPECT_DOUBLE_EQ(im["objects"][k]["x"].get<double>(), sc.objects[k].x);
    }
  }
  std::set<int64_t> qids;
  for (const auto& q : j["questions"]) {
    qids.insert(q["id"].get<int64_t>());
    EXPECT_GE(q["image_id"].get<int64_t>(), 0);
    EXPECT_LT(q["image_id"].get<int64_t>(), n);
    EXPECT_FALSE(q["answer"].get<std::string>().empty());
  }
  EXPECT_EQ(qids.size(), j["questions"].size());
  EXPECT_GE(j["questions"].size(), size_t{3 * n});

  // Existing non-empty folder: refused without force, content intact; replaced with force.
  const auto before = listing(out);
  EXPECT_THROW(write_scene_set(out.string(), 3, 1, false, opts), InputError);
  EXPECT_EQ(listing(out), before);
  write_scene_set(out.string(), 3, 1, true, opts);
  std::ifstream f2(out / "annotations.json");
  const nlohmann::json j2 = nlohmann::json::parse(f2);
  EXPECT_EQ(j2["info"]["seed"], 1);
  EXPECT_EQ(j2["images"].size(), 3u);
  EXPECT_FALSE(fs::exists(out / "images" / "000003.png")) << "old content must be gone";
  EXPECT_EQ(std::distance(fs::directory_iterator(root / "nested"), fs::directory_iterator{}), 1);
  fs::remove_all(root);
}

TEST(Scenes, BadOutputLeavesNothingBehind) {
  const fs::path root = scratch("bad");
  SceneOptions opts;
  opts.size = 64;
  std::ofstream(root / "a_file") << "x";
  fs::create_directories(root / "other");
  std::ofstream(root / "other" / "keep.txt") << "keep";
  const auto before = listing(root);
  auto expect_refused = [&](const fs::path& out, int64_t n, bool force, const SceneOptions& o) {
    EXPECT_THROW(write_scene_set(out.string(), n, 1, force, o), InputError) << out;
    EXPECT_EQ(listing(root), before) << out;
  };
  expect_refused(root / "new", 0, false, opts);
  expect_refused(root / "new", -5, false, opts);
  SceneOptions tiny;
  tiny.size = 8;
  expect_refused(root / "new", 2, false, tiny);
  expect_refused(root / "a_file", 2, true, opts);               // not a folder
  expect_refused(root / "a_file" / "sub", 2, false, opts);      // parent is a file
  expect_refused(root / "a_file" / "x" / "y", 2, false, opts);  // ancestor is a file
  expect_refused(root / "other", 2, false, opts);               // non-empty, no force
  expect_refused(root / "other", 2, true, opts);                // force, but not a scene set
  expect_refused(root / ".", 2, true, opts);
  if (geteuid() != 0) {  // root ignores permissions
    fs::create_directories(root / "locked");
    fs::permissions(root / "locked", fs::perms::owner_read | fs::perms::owner_exec);
    const auto before_locked = listing(root);
    EXPECT_THROW(write_scene_set((root / "locked" / "s").string(), 2, 1, false, opts), InputError);
    EXPECT_EQ(listing(root), before_locked);
    fs::permissions(root / "locked", fs::perms::owner_all);
  }
  fs::remove_all(root);
}

TEST(Scenes, CommandLine) {
  const fs::path root = scratch("cli");
  const std::string bin = KVLENS_BINARY;
  ASSERT_TRUE(fs::exists(bin)) << "build the kvlens target first: " << bin;
  auto run = [&](const std::string& args) {
    const int st = std::system((bin + " " + args + " >/dev/null 2>&1").c_str());
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  };
  const std::string out = (root / "s").string();
  EXPECT_EQ(run("scenes --n 0 --out " + out), 2);
  EXPECT_EQ(run("scenes --n -3 --out " + out), 2);
  EXPECT_EQ(run("scenes --n 2"), 2);
  EXPECT_EQ(run("scenes --n 2 --out " + out + " --size 10"), 2);
  EXPECT_EQ(run("scenes --n two --out " + out), 2);
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(run("scenes --n 2 --seed 5 --size 64 --out " + out), 0);
  EXPECT_TRUE(fs::exists(fs::path(out) / "images" / "000001.png"));
  EXPECT_EQ(run("scenes --n 2 --size 64 --out " + out), 2);  // exists, no --force
  EXPECT_EQ(run("scenes --n 2 --size 64 --force --out " + out), 0);
  EXPECT_EQ(run("scenes --help"), 0);
  fs::remove_all(root);
}
