// Rich scenes (generator version 2): layout rules, the canonical caption rebuilt here from the
// object list with the grammar written out independently, the other captions, every question's
// answer against the geometry, the patterns and the small objects in the pixels, the written set
// and the command line.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/data/image.h"
#include "core/data/scenes.h"
#include "core/errors.h"
#include "tests/test_util.h"

namespace fs = std::filesystem;
namespace kt = kvlens::testing;
using namespace kvlens;

namespace {

const std::vector<std::string> kShapes = {"circle", "square", "triangle", "star", "ring", "cross", "diamond"};
const std::vector<std::string> kPlurals = {"circles", "squares", "triangles", "stars", "rings", "crosses", "diamonds"};
const std::vector<std::string> kColours = {"red", "green", "blue", "yellow", "purple", "orange", "white", "black"};
const std::vector<std::string> kSizes = {"small", "medium", "large", "tiny"};
const std::vector<std::string> kPatterns = {"plain", "striped", "dotted", "checked"};
const std::vector<std::string> kCells = {"top left", "top",    "top right",   "left",        "center",
                                         "right",    "bottom left", "bottom", "bottom right"};
const std::vector<std::string> kWhere = {"in the top left", "at the top",    "in the top right",
                                         "on the left",     "in the center", "on the right",
                                         "in the bottom left", "at the bottom", "in the bottom right"};
const std::vector<std::string> kCounts = {"one", "two", "three", "four", "five", "six", "seven", "eight", "nine"};

std::string shape_of(const SceneObject& o) { return kShapes[static_cast<int>(o.shape)]; }
std::string colour_of(const SceneObject& o) { return kColours[static_cast<int>(o.colour)]; }
std::string name_of(const SceneObject& o) { return colour_of(o) + " " + shape_of(o); }
std::string a_or_an(const std::string& s) { return (std::string("aeiou").find(s[0]) != std::string::npos ? "an " : "a ") + s; }
std::string described(const SceneObject& o) {
  const std::string p = o.pattern == Pattern::Solid ? "" : kPatterns[static_cast<int>(o.pattern)] + " ";
  return a_or_an(kSizes[static_cast<int>(o.size)] + " " + p + name_of(o));
}
int cell_from_xy(const SceneObject& o, int size) {
  return static_cast<int>(std::floor(o.y * 3 / size)) * 3 + static_cast<int>(std::floor(o.x * 3 / size));
}

struct View {
  std::vector<const SceneObject*> mains, group;
  const SceneObject* tiny = nullptr;
  const SceneObject* front = nullptr;
};
View view(const Scene& sc) {
  View v;
  for (const auto& o : sc.objects) {
    if (o.role == Role::Main) v.mains.push_back(&o);
    if (o.role == Role::Group) v.group.push_back(&o);
    if (o.role == Role::Tiny) v.tiny = &o;
    if (o.in_front_of >= 0) v.front = &o;
  }
  return v;
}

// The caption the grammar of core/data/scenes.h gives, built here from the objects.
std::string expected_caption(const Scene& sc) {
  const View v = view(sc);
  std::string s;
  if (v.front) {
    s = described(*v.front) + " in front of " + described(sc.objects[static_cast<size_t>(v.front->in_front_of)]);
  } else if (v.mains.size() == 1) {
    s = described(*v.mains[0]) + " " + kWhere[static_cast<size_t>(v.mains[0]->cell)];
  } else if (v.mains.size() == 2) {
    const SceneObject *a = v.mains[0], *b = v.mains[1];
    const int dc = std::abs(a->cell % 3 - b->cell % 3), dr = std::abs(a->cell / 3 - b->cell / 3);
    const bool horizontal = dc > dr;
    if (horizontal ? b->x < a->x : b->y < a->y) std::swap(a, b);
    s = described(*a) + (horizontal ? " left of " : " above ") + described(*b);
  } else {
    std::vector<const SceneObject*> m = v.mains;
    std::sort(m.begin(), m.end(), [](auto* a, auto* b) { return a->x < b->x; });
    s = described(*m[0]) + ", " + described(*m[1]) + " and " + described(*m[2]) + ", from left to right";
  }
  if (!v.group.empty())
    s += "; " + kCounts[v.group.size() - 1] + " small " + colour_of(*v.group[0]) + " " +
         kPlurals[static_cast<int>(v.group[0]->shape)];
  if (v.tiny) s += "; a tiny " + name_of(*v.tiny) + " " + kWhere[static_cast<size_t>(v.tiny->cell)];
  return s + ".";
}

std::vector<Scene> rich(uint64_t seed, int n, int size = 336) {
  SceneOptions o;
  o.version = kRichScenes;
  o.size = size;
  std::vector<Scene> v;
  for (int i = 0; i < n; ++i) v.push_back(generate_scene(seed, i, o));
  return v;
}

int nearest(const RGBImage& img, double x, double y, std::array<uint8_t, 3> a, std::array<uint8_t, 3> b) {
  const uint8_t* p = &img.data[static_cast<size_t>((static_cast<int>(y) * img.width + static_cast<int>(x)) * 3)];
  double da = 0, db = 0;
  for (int c = 0; c < 3; ++c) da += std::pow(p[c] - a[c], 2), db += std::pow(p[c] - b[c], 2);
  return da <= db ? 0 : 1;
}

}  // namespace

TEST(RichScenes, LayoutRules) {
  std::map<std::string, int> seen;
  for (int size : {336, 448}) {
    for (const Scene& sc : rich(3, 300, size)) {
      const View v = view(sc);
      ASSERT_GE(v.mains.size(), 1u);
      ASSERT_LE(v.mains.size(), 3u);
      EXPECT_TRUE(v.group.empty() || (v.group.size() >= 2 && v.group.size() <= 9)) << v.group.size();
      seen["mains " + std::to_string(v.mains.size())]++, seen["group " + std::to_string(v.group.size())]++;
      seen[v.tiny ? "tiny" : "no tiny"]++, seen[v.front ? "front" : "apart"]++;
      for (size_t i = 0; i < sc.objects.size(); ++i) {
        const auto& o = sc.objects[i];
        EXPECT_GE(o.x - o.radius, 0);
        EXPECT_GE(o.y - o.radius, 0);
        EXPECT_LE(o.x + o.radius, size);
        EXPECT_LE(o.y + o.radius, size);
        EXPECT_EQ(o.cell, cell_from_xy(o, size));
        EXPECT_DOUBLE_EQ(o.radius, size_radius(o.size, size, kRichScenes));
        if (o.role == Role::Main) {
          EXPECT_TRUE(o.size == SizeClass::Medium || o.size == SizeClass::Large);
          seen[kPatterns[static_cast<int>(o.pattern)]]++;
        } else {
          EXPECT_EQ(o.pattern, Pattern::Solid);
          EXPECT_EQ(o.size, o.role == Role::Tiny ? SizeClass::Tiny : SizeClass::Small);
        }
        for (size_t j = i + 1; j < sc.objects.size(); ++j) {
          const auto& p = sc.objects[j];
          const bool pair = p.in_front_of == static_cast<int>(i);
          const double d = std::hypot(o.x - p.x, o.y - p.y);
          if (pair) {
            EXPECT_LT(d, o.radius + p.radius) << "the pair does not overlap, scene " << sc.index;
            EXPECT_GT(d, o.radius / 2) << "the one behind is mostly hidden, scene " << sc.index;
            EXPECT_LE(p.radius, o.radius) << "the one in front is larger, scene " << sc.index;
          } else {
            EXPECT_GT(d, o.radius + p.radius) << "overlap in scene " << sc.index;
          }
          const bool same_kind = o.shape == p.shape && o.colour == p.colour;
          EXPECT_EQ(same_kind, o.role == Role::Group && p.role == Role::Group) << "kinds, scene " << sc.index;
        }
      }
      // The tiny one is smaller than one 14-px patch at 336 px.
      if (v.tiny) {
        EXPECT_LT(2 * v.tiny->radius, 14.0 * size / 336);
      }
    }
  }
  for (const char* k : {"mains 1", "mains 2", "mains 3", "group 0", "group 2", "group 9", "tiny", "no tiny", "front",
                        "apart", "plain", "striped", "dotted", "checked"})
    EXPECT_GT(seen[k], 0) << k << " never occurred";
}

TEST(RichScenes, CaptionsFollowTheGrammar) {
  for (const Scene& sc : rich(5, 300)) {
    ASSERT_EQ(sc.captions.size(), 5u);
    EXPECT_EQ(sc.captions[0], expected_caption(sc));
    EXPECT_EQ(sc.captions[0], rich_canonical_caption(sc.objects));
    EXPECT_EQ(std::set<std::string>(sc.captions.begin(), sc.captions.end()).size(), 5u);
    const View v = view(sc);
    for (const auto& cap : sc.captions) {
      EXPECT_EQ(cap.back(), '.');
      // No wording claims how many objects there are in all: the group and the tiny one count too.
      for (const char* claim : {"single", " only", "in all", "leftmost", "two shapes", "two objects", "three shapes",
                                "three objects", "one shape", "one object"})
        EXPECT_EQ(cap.find(claim), std::string::npos) << cap;
      for (const SceneObject* o : v.mains) EXPECT_NE(cap.find(colour_of(*o)), std::string::npos) << cap;
      if (!v.group.empty()) {
        EXPECT_NE(cap.find(kCounts[v.group.size() - 1] + " "), std::string::npos) << cap;
        EXPECT_NE(cap.find(colour_of(*v.group[0]) + " " + kPlurals[static_cast<int>(v.group[0]->shape)]), std::string::npos) << cap;
      }
      if (v.tiny) {
        EXPECT_NE(cap.find(name_of(*v.tiny)), std::string::npos) << cap;
        EXPECT_NE(cap.find(kWhere[static_cast<size_t>(v.tiny->cell)]), std::string::npos) << cap;
      }
      if (v.front) {
        EXPECT_TRUE(cap.find("front") != std::string::npos || cap.find("hid") != std::string::npos) << cap;
      }
    }
  }
  EXPECT_THROW(rich_canonical_caption({}), InputError);
}

TEST(RichScenes, AnswersAgreeWithTheObjects) {
  std::map<std::string, int> types;
  for (const Scene& sc : rich(7, 300)) {
    const View v = view(sc);
    ASSERT_GE(sc.questions.size(), 4u);
    ASSERT_LE(sc.questions.size(), 8u);
    auto by_name = [&](const std::string& name) -> const SceneObject* {
      const SceneObject* hit = nullptr;
      for (const auto& o : sc.objects)
        if (o.role != Role::Group && name_of(o) == name) {
          EXPECT_EQ(hit, nullptr) << name << " names two objects";
          hit = &o;
        }
      return hit;
    };
    for (const auto& q : sc.questions) {
      types[q.type]++;
      const std::string& s = q.question;
      SCOPED_TRACE(s + " -> " + q.answer);
      auto after = [&](const std::string& pre, const std::string& post) {
        EXPECT_EQ(s.rfind(pre, 0), 0u);
        return s.substr(pre.size(), s.size() - pre.size() - post.size());
      };
      if (q.type == "count") {
        ASSERT_FALSE(v.group.empty());
        EXPECT_EQ(after("how many ", " are there?"), colour_of(*v.group[0]) + " " + kPlurals[static_cast<int>(v.group[0]->shape)]);
        EXPECT_EQ(q.answer, kCounts[v.group.size() - 1]);
      } else if (q.type == "colour") {
        ASSERT_TRUE(v.tiny);
        EXPECT_EQ(after("what colour is the tiny ", "?"), shape_of(*v.tiny));
        EXPECT_EQ(q.answer, colour_of(*v.tiny));
      } else if (q.type == "shape") {
        ASSERT_TRUE(v.tiny);
        EXPECT_EQ(after("what shape is the tiny ", " object?"), colour_of(*v.tiny));
        EXPECT_EQ(q.answer, shape_of(*v.tiny));
      } else if (q.type == "where") {
        const SceneObject* o = s.rfind("where is the tiny ", 0) == 0 ? v.tiny : by_name(after("where is the ", "?"));
        ASSERT_TRUE(o);
        EXPECT_EQ(q.answer, kCells[static_cast<size_t>(cell_from_xy(*o, 336))]);
      } else if (q.type == "pattern") {
        const SceneObject* o = by_name(after("what pattern does the ", " have?"));
        ASSERT_TRUE(o);
        EXPECT_EQ(q.answer, kPatterns[static_cast<int>(o->pattern)]);
      } else if (q.type == "exist") {
        const bool tiny = s.rfind("is there a tiny ", 0) == 0;
        std::string what = tiny ? after("is there a tiny ", "?") : s.substr(s.find(' ', 9) + 1, s.size() - s.find(' ', 9) - 2);
        bool present = false;
        for (const auto& o : sc.objects) present |= name_of(o) == what && (!tiny || o.role == Role::Tiny);
        EXPECT_EQ(q.answer, present ? "yes" : "no");
        if (tiny && !v.group.empty()) {
          EXPECT_NE(what, name_of(*v.group[0])) << "a tiny one of the group's kind: the group's are small, not tiny";
        }
      } else if (q.type == "front") {
        ASSERT_TRUE(v.front);
        EXPECT_EQ(q.answer, "the " + name_of(*v.front));
        EXPECT_NE(s.find(name_of(sc.objects[static_cast<size_t>(v.front->in_front_of)])), std::string::npos);
      } else if (q.type == "relation") {
        // The objects the question names; the answer is one of them, and it is further left (or
        // higher up) than the others, by its centre and by its edge.
        std::vector<const SceneObject*> named;
        for (const auto& o : sc.objects) {
          bool in = false;
          for (const char* end : {" ", ",", "?"}) in |= s.find("the " + name_of(o) + end) != std::string::npos;
          if (in) named.push_back(&o);
        }
        ASSERT_GE(named.size(), 2u);
        const SceneObject* a = by_name(q.answer.substr(4));
        ASSERT_TRUE(a);
        EXPECT_TRUE(std::find(named.begin(), named.end(), a) != named.end());
        const bool up = s.find("higher up") != std::string::npos;
        EXPECT_TRUE(up || s.find("further left") != std::string::npos || s.find("furthest left") != std::string::npos);
        for (const SceneObject* m : named) {
          if (m == a) continue;
          EXPECT_LT(up ? a->y : a->x, up ? m->y : m->x);
          EXPECT_LT((up ? a->y : a->x) - a->radius, (up ? m->y : m->x) - m->radius);
        }
      } else if (q.type == "larger") {
        const SceneObject* a = by_name(q.answer.substr(4));
        ASSERT_TRUE(a);
        for (const SceneObject* m : v.mains)
          if (s.find("the " + name_of(*m) + "?") != std::string::npos || s.find("the " + name_of(*m) + " or") != std::string::npos) {
            EXPECT_GE(a->radius, m->radius);
          }
      } else {
        ADD_FAILURE() << "unknown type " << q.type;
      }
    }
  }
  for (const char* t : {"count", "colour", "shape", "where", "pattern", "exist", "front", "relation", "larger"})
    EXPECT_GT(types[t], 0) << t << " never asked";
}

// The pixels: the tiny and the group's objects show their colour at their centres (rings: on
// their band), a patterned object shows both its fill and its shade, the one in front covers
// the pair's overlap.
TEST(RichScenes, PixelsShowPatternsAndSmallObjects) {
  int patterned = 0;
  for (const Scene& sc : rich(9, 120)) {
    for (const auto& o : sc.objects) {
      const double dx = o.shape == Shape::Ring ? 0.75 * o.radius : 0.0;  // on the ring's band
      const auto fill = colour_rgb(o.colour);
      const uint8_t* p = &sc.image.data[static_cast<size_t>((static_cast<int>(o.y) * sc.image.width +
                                                             static_cast<int>(o.x + dx)) * 3)];
      if (o.role != Role::Main) {
        for (int c = 0; c < 3; ++c) EXPECT_NEAR(p[c], fill[c], 40) << "scene " << sc.index << " " << name_of(o);
        continue;
      }
      // (the overlapping pair is left out: either may cover the other's inner half)
      if (o.pattern == Pattern::Solid || o.shape == Shape::Ring || view(sc).front) continue;
      // Both colours inside the inner half of the disc.
      int n[2] = {0, 0};
      for (double y = o.y - o.radius / 2; y < o.y + o.radius / 2; y += 1)
        for (double x = o.x - o.radius / 2; x < o.x + o.radius / 2; x += 1)
          n[nearest(sc.image, x, y, fill, pattern_rgb(o.colour))]++;
      EXPECT_GT(n[0], 4) << "scene " << sc.index << ": no fill in a " << kPatterns[static_cast<int>(o.pattern)] << " " << name_of(o);
      EXPECT_GT(n[1], 4) << "scene " << sc.index << ": no shade in a " << kPatterns[static_cast<int>(o.pattern)] << " " << name_of(o);
      ++patterned;
    }
  }
  EXPECT_GT(patterned, 20);
  for (int c = 0; c < kNumColours; ++c) {
    const auto a = colour_rgb(static_cast<Colour>(c)), b = pattern_rgb(static_cast<Colour>(c));
    EXPECT_GT(std::abs(a[0] - b[0]) + std::abs(a[1] - b[1]) + std::abs(a[2] - b[2]), 120) << kColours[c];
  }
}

TEST(RichScenes, SetAndCommandLine) {
  const std::string out = kt::make_temp_dir("rich_set") + "/set";
  auto r = kt::run(kt::cli() + " scenes --n 12 --seed 4 --generator-version 2 --out " + out);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto j = kt::read_json(out + "/annotations.json");
  EXPECT_EQ(j["info"]["version"].get<int>(), 2);
  EXPECT_EQ(j["info"]["size"].get<int>(), 336);
  ASSERT_EQ(j["images"].size(), 12u);
  EXPECT_EQ(j["annotations"].size(), 60u);
  SceneOptions o;
  o.version = kRichScenes;
  o.size = 336;
  const Scene sc = generate_scene(4, 5, o);
  const auto& im = j["images"][5];
  ASSERT_EQ(im["objects"].size(), sc.objects.size());
  for (size_t i = 0; i < sc.objects.size(); ++i) {
    EXPECT_EQ(im["objects"][i]["pattern"].get<std::string>(), kPatterns[static_cast<int>(sc.objects[i].pattern)]);
    EXPECT_EQ(im["objects"][i]["role"].get<std::string>(), std::vector<std::string>({"main", "group", "tiny"})[static_cast<int>(sc.objects[i].role)]);
  }
  const RGBImage png = load_image(out + "/images/000005.png");
  EXPECT_EQ(png.data, sc.image.data);
  // A classic set's annotations name no version, pattern or role.
  const std::string classic = kt::make_temp_dir("rich_set") + "/classic";
  ASSERT_EQ(kt::run(kt::cli() + " scenes --n 2 --out " + classic).code, 0);
  const auto c = kt::read_json(classic + "/annotations.json");
  EXPECT_FALSE(c["info"].contains("version"));
  EXPECT_EQ(c["info"]["size"].get<int>(), 256);
  EXPECT_FALSE(c["images"][0]["objects"][0].contains("pattern"));
  // Bad input: exit 2, the option named.
  r = kt::run(kt::cli() + " scenes --n 2 --generator-version 3 --out " + classic + "_3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--generator-version"), std::string::npos) << r.output;
  r = kt::run(kt::cli() + " scenes --n 2 --size 32 --out " + classic + "_32");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("--size"), std::string::npos) << r.output;
  SceneOptions tiny_side;
  tiny_side.size = 32;
  EXPECT_NE(kt::error_of([&] { generate_scene(1, 0, tiny_side); }).find("scene size"), std::string::npos);
  SceneOptions rich_default;
  rich_default.version = kRichScenes;
  EXPECT_EQ(generate_scene(1, 0, rich_default).image.width, 336);
  EXPECT_EQ(generate_scene(1, 0).image.width, 256);
  std::vector<SceneObject> objs = generate_scene(1, 0, rich_default).objects;
  objs[0].in_front_of = static_cast<int>(objs.size());
  EXPECT_NE(kt::error_of([&] { rich_canonical_caption(objs); }).find("in_front_of"), std::string::npos);
  SceneOptions bad;
  bad.version = 0;
  EXPECT_NE(kt::error_of([&] { generate_scene(1, 0, bad); }).find("generator version"), std::string::npos);
  EXPECT_NE(kt::error_of([&] { size_radius(SizeClass::Tiny, 256); }).find("rich scenes only"), std::string::npos);
}
