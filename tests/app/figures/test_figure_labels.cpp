// How figure text is laid out when figures are drawn (fig::draw): scatter point labels and notes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "app/figures/figures.h"
#include "tests/report_fixture.h"

using namespace kvlens;
using namespace kvlens::fig;
using kvlens::testing::measure;

// Scatter point labels: none covers another (two points a pixel apart, a third close by), a
// label moved away from its point is tied to it by a leader, and a label that would run past the
// plot's right edge sits left of its point.
TEST(Figures, PointLabelsDoNotCoverEachOtherOrLeaveThePlot) {
  Figure f;
  f.id = "labels";
  f.x.min = 0, f.x.max = 10, f.y.min = 0, f.y.max = 1;
  const std::vector<std::pair<double, std::string>> pts = {{2.0, "first method"}, {2.01, "second method"},
                                                           {2.05, "third"}, {9.9, "near the edge"}};
  for (const auto& [x, name] : pts) {
    Series s;
    s.kind = SeriesKind::Scatter;
    s.label = name;
    s.x = {x};
    s.y = {0.5};
    s.point_labels = {name};
    f.series.push_back(s);
  }
  const Frame fr = draw(f, 500, 300, measure);
  struct Box {
    std::string text;
    Rect r;
    int halign;
  };
  std::vector<Box> boxes;
  for (const Prim& p : fr.prims) {
    if (p.type != Prim::Type::Text) continue;
    for (const auto& pt : pts)
      if (p.text == pt.second && p.valign == 1) {
        const double w = measure(p.text, p.size), h = p.size * 1.25;
        const double x0 = p.halign < 0 ? p.pts[0].x : p.pts[0].x - w;
        boxes.push_back({p.text, Rect{x0, p.pts[0].y - h, x0 + w, p.pts[0].y}, p.halign});
      }
  }
  ASSERT_EQ(boxes.size(), pts.size());
  // A label moved off its place (right of its point, its baseline 2 px above the point's centre)
  // has a leader from the rim of its own point's marker to the side of the label that faces it;
  // a label in its place has none.
  std::vector<const Prim*> leaders;
  for (const Prim& p : fr.prims)
    if (p.type == Prim::Type::Polyline && p.pts.size() == 2 && p.width < 1) leaders.push_back(&p);
  int moved = 0;
  for (const Box& b : boxes) {
    const double x = pts[static_cast<size_t>(&b - boxes.data())].first;
    const double px = fr.plot.x0 + (x - fr.x.min) / (fr.x.max - fr.x.min) * (fr.plot.x1 - fr.plot.x0);
    const double py = fr.plot.y1 - (0.5 - fr.y.min) / (fr.y.max - fr.y.min) * (fr.plot.y1 - fr.plot.y0);
    if (std::abs(b.r.y1 - (py - 2)) < 1e-6) continue;  // in its place
    ++moved;
    const bool tied = std::any_of(leaders.begin(), leaders.end(), [&](const Prim* l) {
      const Point a = l->pts[0], e = l->pts[1];
      return std::abs(std::hypot(a.x - px, a.y - py) - 4.5) < 1e-6 && std::abs(e.x - (b.halign < 0 ? b.r.x0 : b.r.x1)) < 1.5 &&
             e.y > b.r.y0 && e.y < b.r.y1;
    });
    EXPECT_TRUE(tied) << b.text << " was moved off its point without a leader to it";
  }
  EXPECT_GE(moved, 2) << "points a pixel apart should move labels";
  EXPECT_EQ(leaders.size(), static_cast<size_t>(moved)) << "a leader for every moved label and no other";
  for (size_t i = 0; i < boxes.size(); ++i)
    for (size_t j = i + 1; j < boxes.size(); ++j) {
      const Rect& a = boxes[i].r;
      const Rect& b = boxes[j].r;
      EXPECT_FALSE(a.x0 < b.x1 && b.x0 < a.x1 && a.y0 < b.y1 && b.y0 < a.y1) << boxes[i].text << " covers " << boxes[j].text;
    }
  const Box& edge = boxes.back();
  EXPECT_EQ(edge.text, "near the edge");
  EXPECT_EQ(edge.halign, 1);
  EXPECT_LE(edge.r.x1, fr.plot.x1);
}


// A note longer than the figure is wide wraps at spaces: its lines, in order, are the note's
// words, each within the figure's width, drawn at the note's size; a wide figure keeps it on
// one line.
TEST(Figures, LongNotesWrapToTheFiguresWidth) {
  Figure f;
  f.id = "note";
  f.x.min = 0, f.x.max = 1, f.y.min = 0, f.y.max = 1;
  f.note = "scores of the visual keys at the first decode step, shared bins; g(x) per head, tau1 = 0, tau2 = 3";
  auto note_lines = [&](double W) {
    const Frame fr = draw(f, W, 300, measure);
    std::vector<std::string> lines;
    double size = 0;
    for (const Prim& p : fr.prims)
      if (p.type == Prim::Type::Text && f.note.find(p.text) != std::string::npos && p.text.size() > 3) {
        lines.push_back(p.text);
        size = p.size;
        EXPECT_LE(measure(p.text, p.size), W) << p.text;
      }
    EXPECT_GT(size, 0.0);
    return lines;
  };
  const std::vector<std::string> narrow = note_lines(260), wide = note_lines(2000);
  ASSERT_GE(narrow.size(), 2u);
  std::string joined;
  for (const std::string& l : narrow) joined += (joined.empty() ? "" : " ") + l;
  EXPECT_EQ(joined, f.note);
  EXPECT_EQ(wide, std::vector<std::string>{f.note});
}
