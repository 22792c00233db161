// kvlens-gui driven headless (--script) under Xvfb with Mesa: the screenshot shows an image and
// a plot; exported figures decode (PNG), parse (SVG) and render (PDF); a saved session reopens
// to the same state and the same report, and runs in the CLI to the same report; a parameter
// change moves the calibrated histogram at once and the softmax MSE once re-decoded; bad input
// becomes a message while the app keeps running and nothing is lost.
#include <gtest/gtest.h>

#include <filesystem>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <random>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/compress/method.h"
#include "core/data/image.h"
#include "core/files.h"
#include "app/lab/session.h"
#include "tests/test_util.h"
#include "tests/app/gui/gui_driver.h"

#ifdef KVLENS_HAVE_EXPAT
#include <expat.h>
#endif

namespace kt = kvlens::testing;
using kvlens::RGBImage;
using nlohmann::json;
using kt::kGui;
using kt::load;

namespace {


json without_timings(json r) {
  r.erase("timings_ms");
  for (auto& m : r["methods"]) m.erase("timings_ms");
  return r;
}

struct Pixels {
  int differing = 0, total = 0;
  size_t colours = 0;
};

// Pixels of a region that differ from `bg` by more than `tol` in some channel, and its distinct colours.
Pixels region(const RGBImage& img, const json& rect, std::array<int, 3> bg, int tol) {
  Pixels p;
  std::set<uint32_t> colours;
  const int x0 = static_cast<int>(rect[0].get<double>()), y0 = static_cast<int>(rect[1].get<double>());
  const int w = static_cast<int>(rect[2].get<double>()), h = static_cast<int>(rect[3].get<double>());
  for (int y = std::max(0, y0); y < std::min(img.height, y0 + h); ++y)
    for (int x = std::max(0, x0); x < std::min(img.width, x0 + w); ++x) {
      const uint8_t* q = &img.data[(static_cast<size_t>(y) * img.width + x) * 3];
      ++p.total;
      bool d = false;
      for (int c = 0; c < 3; ++c) d = d || std::abs(q[c] - bg[c]) > tol;
      p.differing += d;
      colours.insert(q[0] << 16 | q[1] << 8 | q[2]);
    }
  p.colours = colours.size();
  return p;
}

bool svg_parses(const std::string& text) {
#ifdef KVLENS_HAVE_EXPAT
  XML_Parser p = XML_ParserCreate(nullptr);
  const bool ok = XML_Parse(p, text.data(), static_cast<int>(text.size()), 1) == XML_STATUS_OK;
  XML_ParserFree(p);
  return ok && text.find("<svg") != std::string::npos;
#else
  return text.find("<svg") != std::string::npos && text.find("</svg>") != std::string::npos;
#endif
}

}  // namespace

TEST(Gui, ScriptedSessionScreenshotsExportsAndLiveCalibration) {
  const std::string dir = kt::make_temp_dir("gui");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"calib_method", 0}, {"calib_layer", 1}, {"calib_head", 2}, {"plot", "softmax_mse"}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "screenshot"}, {"path", "main.png"}},
                        {{"do", "dump_state"}, {"path", "before.json"}},
                        {{"do", "set_param"}, {"method", 0}, {"name", "tau2"}, {"value", 1}},
                        {{"do", "dump_state"}, {"path", "moved.json"}},  // same frame: no new result yet
                        {{"do", "wait_results"}},
                        {{"do", "dump_state"}, {"path", "after.json"}},
                        {{"do", "export_figures"}, {"dir", "figs"}, {"formats", "png,svg,pdf"}, {"all", false}},
                        {{"do", "export_report"}, {"path", "r1.json"}},
                        {{"do", "save_session"}, {"path", "s.json"}},
                        {{"do", "dump_state"}, {"path", "saved.json"}},
                        {{"do", "open_image"}, {"path", kt::source_dir() + "/assets/images/scene_002.png"}},
                        {{"do", "new_session"}},
                        {{"do", "dump_state"}, {"path", "new.json"}},
                        {{"do", "open_session"}, {"path", "s.json"}},
                        {{"do", "wait_results"}},
                        {{"do", "export_report"}, {"path", "r2.json"}},
                        {{"do", "dump_state"}, {"path", "reopened.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  ASSERT_EQ(r.code, 0) << r.output;

  // The screenshot: the whole window, an image in the Image panel, a plot in the Plots panel.
  const RGBImage shot = kvlens::load_image(dir + "/main.png");
  EXPECT_EQ(shot.width, 1680);
  EXPECT_EQ(shot.height, 1050);
  const json before = load(dir + "/before.json");
  const std::array<int, 3> window_bg{249, 249, 250}, white{255, 255, 255};
  const json all = {0, 0, shot.width, shot.height};
  EXPECT_GT(region(shot, all, window_bg, 3).colours, 300u) << "the screenshot looks blank";
  ASSERT_TRUE(before["drawn"].contains("image"));
  ASSERT_TRUE(before["drawn"].contains("plot"));
  const Pixels img = region(shot, before["drawn"]["image"], window_bg, 6);
  EXPECT_GT(img.differing, img.total * 9 / 10) << "the image region shows the background";
  EXPECT_GT(img.colours, 300u);
  const Pixels plot = region(shot, before["drawn"]["plot"], white, 40);  // lines, text, grid
  EXPECT_GT(plot.differing, plot.total / 100) << "the plot region is empty";
  EXPECT_GT(region(shot, before["drawn"]["plot"], window_bg, 3).differing, plot.total / 2);
  const Pixels hist = region(shot, before["drawn"]["calibration_histogram"], white, 40);
  EXPECT_GT(hist.differing, hist.total / 50) << "the calibration histogram is empty";

  // After New the input boxes show what the app analyses, and the last message is not the
  // previous session's ("report written", "session saved").
  const json fresh = load(dir + "/new.json");
  EXPECT_EQ(fresh["fields"], fresh["inputs"]);
  EXPECT_EQ(fresh["fields"]["image_path"].get<std::string>().find("scene_002"), std::string::npos)
      << "the image opened before New is still in its box";
  ASSERT_FALSE(fresh["messages"].empty());
  const std::string last = fresh["messages"].back()["text"].get<std::string>();
  EXPECT_EQ(last.find("written"), std::string::npos) << last;
  EXPECT_EQ(last.find("saved"), std::string::npos) << last;

  // τ2 moved: the calibrated histogram changes at once, recomputed from the stored quantized
  // scores before any re-decode came back; the MSE of that method changes once it is
  // re-decoded; the other methods keep theirs.
  const json moved = load(dir + "/moved.json"), after = load(dir + "/after.json");
  EXPECT_FALSE(moved["up_to_date"].get<bool>());
  EXPECT_EQ(moved["results"], before["results"]);  // the old results are still the ones shown
  EXPECT_NE(moved["calibration"]["calibrated"], before["calibration"]["calibrated"]);
  EXPECT_EQ(moved["calibration"]["gamma"], before["calibration"]["gamma"]);  // same stored quantized scores
  ASSERT_EQ(after["results"].size(), 4u);
  EXPECT_NE(after["results"][0]["mean_softmax_mse"], before["results"][0]["mean_softmax_mse"]);
  EXPECT_NE(after["results"][0]["spec"], before["results"][0]["spec"]);
  for (int i = 1; i < 4; ++i) EXPECT_EQ(after["results"][i]["mean_softmax_mse"], before["results"][i]["mean_softmax_mse"]);
  EXPECT_TRUE(after["up_to_date"].get<bool>());

  // Exports: the figures on screen (plot, histogram, transfer curve) in every format; the
  // calibration figures' names carry the method, layer and head.
  auto exported = [&](const std::string& prefix, const std::string& suffix) {
    std::vector<std::string> ids;
    for (const auto& e : std::filesystem::directory_iterator(dir + "/figs")) {
      const std::string n = e.path().filename().string();
      if (n.size() > prefix.size() + suffix.size() + 4 && n.rfind(prefix, 0) == 0 &&
          n.compare(n.size() - suffix.size() - 4, suffix.size() + 4, suffix + ".png") == 0)
        ids.push_back(n.substr(0, n.size() - 4));
    }
    return ids;
  };
  const std::vector<std::string> hist_ids = exported("calibration_histogram_", "_l1_h2"),
                                 transfer_ids = exported("calibration_transfer_", "_l1_h2");
  ASSERT_EQ(hist_ids.size(), 1u) << "one histogram of the selected method, layer 1, head 2";
  ASSERT_EQ(transfer_ids.size(), 1u);
  EXPECT_EQ(hist_ids[0].substr(std::string("calibration_histogram_").size()),
            transfer_ids[0].substr(std::string("calibration_transfer_").size()));
  int pngs = 0;
  for (const std::string& id : {std::string("softmax_mse_by_layer"), hist_ids[0], transfer_ids[0]}) {
    const std::string base = dir + "/figs/" + id;
    const RGBImage png = kvlens::load_image(base + ".png");
    EXPECT_GT(png.width, 100) << id;
    ++pngs;
    EXPECT_TRUE(svg_parses(kt::read_file(base + ".svg"))) << id;
    EXPECT_FALSE(kt::read_file(base + ".csv").empty()) << id;
    if (kt::run("command -v pdftoppm").code == 0) {
      const auto pdf = kt::run("pdftoppm -png -r 50 -singlefile " + base + ".pdf " + base + "_pdf");
      EXPECT_EQ(pdf.code, 0) << pdf.output;
      EXPECT_GT(kvlens::load_image(base + "_pdf.png").width, 100) << id;
    }
  }
  EXPECT_EQ(pngs, 3);

  // The saved session reopens to the same state and the same report.
  json saved = load(dir + "/saved.json"), reopened = load(dir + "/reopened.json");
  for (json* d : {&saved, &reopened})
    for (json& m : (*d)["methods"]) m.erase("id");  // (ids are the app's own, new on reopening)
  for (const char* k : {"methods", "views", "inputs"}) EXPECT_EQ(saved[k], reopened[k]) << k;
  const json r1 = load(dir + "/r1.json"), r2 = load(dir + "/r2.json");
  EXPECT_EQ(without_timings(r1), without_timings(r2));
  const json s = load(dir + "/s.json");
  EXPECT_EQ(s["kvlens_session"], 2);
  EXPECT_FALSE(s["model_hash"].get<std::string>().empty());
  EXPECT_EQ(s["results"]["methods"].size(), 4u);
  // ... and runs in the CLI to the same report.
  const auto cli = kt::run(kt::cli() + " run --session " + dir + "/s.json --attention-maps --report " + dir + "/r3.json");
  ASSERT_EQ(cli.code, 0) << cli.output;
  EXPECT_EQ(without_timings(load(dir + "/r3.json")), without_timings(r1));
}

// The comparison table (Plots → "Comparison table"): every method's numbers, sorted by the
// column a script (or a click on its header) chose, drawn in the Plots panel; the sort is part of
// the views a session saves; a column it does not have is refused and changes nothing.
TEST(Gui, ComparisonTableSortedByAColumnAndSaved) {
  const std::string dir = kt::make_temp_dir("gui_table");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"plot", "table"}, {"table_sort", "mse"}, {"table_descending", true}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "screenshot"}, {"path", "table.png"}},
                        {{"do", "dump_state"}, {"path", "mse.json"}},
                        {{"do", "select"}, {"table_sort", "kv_kib"}, {"table_descending", false}},
                        {{"do", "dump_state"}, {"path", "bytes.json"}},
                        {{"do", "save_session"}, {"path", "s.json"}},
                        {{"do", "select"}, {"table_sort", "cider"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  EXPECT_NE(r.code, 0) << "a refused select fails the script";
  EXPECT_NE(r.output.find("cider"), std::string::npos) << r.output;
  auto column = [](const json& d, const std::string& key) {
    const json& cols = d["comparison_table"]["columns"];
    for (size_t i = 0; i < cols.size(); ++i)
      if (cols[i] == key) return static_cast<int>(i) - 1;  // values follow the method column
    return -2;
  };
  auto values = [&](const json& d, const std::string& key) {
    std::vector<double> v;
    const int c = column(d, key);
    for (const json& row : d["comparison_table"]["rows"]) v.push_back(row["values"][static_cast<size_t>(c)].get<double>());
    return v;
  };
  const json mse = load(dir + "/mse.json"), bytes = load(dir + "/bytes.json");
  ASSERT_EQ(mse["comparison_table"]["rows"].size(), mse["results"].size());
  ASSERT_GE(mse["results"].size(), 2u);
  EXPECT_EQ(mse["comparison_table"]["sort"], "mse");
  EXPECT_TRUE(mse["comparison_table"]["descending"].get<bool>());
  const std::vector<double> m = values(mse, "mse");
  EXPECT_TRUE(std::is_sorted(m.rbegin(), m.rend())) << mse["comparison_table"].dump();
  // The same numbers as the results the app reports, in another order.
  std::vector<double> reported;
  for (const json& x : mse["results"]) reported.push_back(x["mean_softmax_mse"].get<double>());
  std::vector<double> shown = m;
  std::sort(reported.begin(), reported.end());
  std::sort(shown.begin(), shown.end());
  EXPECT_EQ(shown, reported);
  const std::vector<double> b = values(bytes, "kv_kib");
  EXPECT_TRUE(std::is_sorted(b.begin(), b.end())) << bytes["comparison_table"].dump();
  EXPECT_EQ(bytes["views"]["table_sort"], "kv_kib");
  // Saved with the session's views.
  const json s = load(dir + "/s.json");
  EXPECT_EQ(s["views"]["table_sort"], "kv_kib");
  EXPECT_EQ(s["views"]["table_descending"], false);
  // Drawn: the table's region is not blank.
  const RGBImage shot = kvlens::load_image(dir + "/table.png");
  ASSERT_TRUE(mse["drawn"].contains("table"));
  const std::array<int, 3> window_bg{249, 249, 250};
  const Pixels t = region(shot, mse["drawn"]["table"], window_bg, 6);
  EXPECT_GT(t.differing, t.total / 50) << "the table region is empty";
}

// An instance without a label of its own goes by its short spec; while a slider of it is dragged
// that name holds still (panels, legends, export names), and at release it takes the new value:
// drag_param sees one name over the drag, the instance is shown by the new one right after, and
// once the results are in, the figures' legends name the new value and not the old.
TEST(Gui, AutomaticLabelsHoldWhileDragging) {
  const std::string dir = kt::make_temp_dir("gui_drag_label");
  const std::string before = kvlens::parse_method_spec("snapkv:budget=0.1").short_spec();
  const std::string after = kvlens::parse_method_spec("snapkv:budget=0.3").short_spec();
  ASSERT_NE(before, after);
  const json steps = {{"steps",
                       {{{"do", "add_method"}, {"spec", "snapkv:budget=0.1"}},
                        {{"do", "wait_results"}},
                        {{"do", "drag_param"}, {"method", before}, {"name", "budget"}, {"from", 0.1}, {"to", 0.3},
                         {"frames", 6}},
                        {{"do", "dump_state"}, {"path", "dragged.json"}},
                        {{"do", "wait_results"}},
                        {{"do", "dump_state"}, {"path", "released.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  ASSERT_EQ(r.code, 0) << r.output;
  const json d = load(dir + "/dragged.json"), e = load(dir + "/released.json");
  EXPECT_EQ(d["drag_shown"], json::array({before})) << "one name over the whole drag";
  ASSERT_FALSE(d["methods"].empty());
  EXPECT_EQ(d["methods"].back()["shown"], after);
  EXPECT_EQ(d["methods"].back()["label"], "");
  const json& legend = e["legend"];
  EXPECT_NE(std::find(legend.begin(), legend.end(), json(after)), legend.end()) << legend.dump();
  EXPECT_EQ(std::find(legend.begin(), legend.end(), json(before)), legend.end()) << legend.dump();
}

// A plot is looked at as the researcher chooses (plot_view: what legend clicks, the right-click
// menu and Shift + wheel set): a hidden series leaves the plot and the y axis refits to the rest,
// the y scale switches between log and linear, a y range zooms; the app reports the axis as drawn.
// An unknown scale is refused and fails the script.
TEST(Gui, PlotViewHidesSeriesAndSwitchesTheYScale) {
  const std::string dir = kt::make_temp_dir("gui_plot_view");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"plot", "softmax_mse"}},
                        {{"do", "frames"}, {"n", 2}},
                        {{"do", "dump_state"}, {"path", "built.json"}},
                        {{"do", "plot_view"}, {"hide", {"vlcache"}}, {"y_scale", "linear"}},
                        {{"do", "frames"}, {"n", 2}},
                        {{"do", "screenshot"}, {"path", "linear.png"}},
                        {{"do", "dump_state"}, {"path", "linear.json"}},
                        {{"do", "plot_view"}, {"show", {"vlcache"}}, {"y_scale", "log"}, {"y_range", {1e-5, 1e-3}}},
                        {{"do", "frames"}, {"n", 2}},
                        {{"do", "dump_state"}, {"path", "zoomed.json"}},
                        {{"do", "select"}, {"plot", "multiples"}, {"multiples_source", 0}, {"multiples_token", 1}},
                        {{"do", "frames"}, {"n", 2}},
                        {{"do", "screenshot"}, {"path", "multiples.png"}},
                        {{"do", "dump_state"}, {"path", "multiples.json"}},
                        {{"do", "plot_view"}, {"y_scale", "logarithmic"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  EXPECT_NE(r.code, 0) << "an unknown y scale fails the script";
  EXPECT_NE(r.output.find("logarithmic"), std::string::npos) << r.output;
  const json built = load(dir + "/built.json"), linear = load(dir + "/linear.json"), zoomed = load(dir + "/zoomed.json");
  ASSERT_TRUE(built.contains("plot_view")) << built.dump();
  EXPECT_EQ(built["plot_view"]["figure"], "softmax_mse_by_layer");
  EXPECT_TRUE(built["plot_view"]["hidden"].empty());
  EXPECT_TRUE(built["plot_view"]["y_drawn"]["log"].get<bool>()) << "softmax MSE spans decades: log as built";
  EXPECT_EQ(linear["plot_view"]["hidden"], json::array({"vlcache"}));
  EXPECT_EQ(linear["plot_view"]["y_scale"], "linear");
  EXPECT_FALSE(linear["plot_view"]["y_drawn"]["log"].get<bool>());
  EXPECT_LE(linear["plot_view"]["y_drawn"]["min"].get<double>(), 0.0);
  EXPECT_TRUE(zoomed["plot_view"]["hidden"].empty());
  EXPECT_TRUE(zoomed["plot_view"]["y_drawn"]["log"].get<bool>());
  EXPECT_NEAR(zoomed["plot_view"]["y_drawn"]["min"].get<double>(), 1e-5, 1e-11);
  EXPECT_NEAR(zoomed["plot_view"]["y_drawn"]["max"].get<double>(), 1e-3, 1e-9);
  const RGBImage shot = kvlens::load_image(dir + "/linear.png");
  const std::array<int, 3> white{255, 255, 255};
  const Pixels plot = region(shot, linear["drawn"]["plot"], white, 40);
  EXPECT_GT(plot.differing, plot.total / 100) << "the plot region is empty";
  // Small multiples of the first method's generated token 1 over the patches: drawn, mostly
  // colour (tiles), named after the method and token.
  const json mult = load(dir + "/multiples.json");
  EXPECT_EQ(mult["views"]["plot"], "multiples");
  EXPECT_EQ(mult["views"]["multiples_token"], 1);
  const std::string id = mult["plot_view"]["figure"].get<std::string>();
  EXPECT_EQ(id.rfind("attention_patches_", 0), 0u) << id;
  EXPECT_NE(id.find("_t1"), std::string::npos) << id;
  const RGBImage ms = kvlens::load_image(dir + "/multiples.png");
  const Pixels tiles = region(ms, mult["drawn"]["plot"], white, 40);
  EXPECT_GT(tiles.differing, tiles.total / 5) << "the tiles are missing";
}

// The message log opens in a window of its own, tall enough to read whatever the layout leaves
// the Session panel, listing every message (two refused inputs here).
// At 1280×800 the Calibration panel is shorter than its two figures want: each keeps at least
// kMinFigureHeight (the panel scrolls) instead of g(x) shrinking to a strip; the Model panel is
// narrower than its facts two a row: one a row, none cut; the image keeps kMinImageSide; the
// Image panel's slider values are whole; what the widths cut shows whole on hover; Captions gets
// half the column (whole rows of the full cache and two instances at least).
TEST(Gui, CalibrationFiguresKeepTheirHeightAt1280x800) {
  const std::string dir = kt::make_temp_dir("gui_small");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"calib_method", 0}, {"calib_layer", 1}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "small.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "1920x1200", " --size 1280x800");
  ASSERT_EQ(r.code, 0) << r.output;
  const json st = load(dir + "/small.json");
  ASSERT_TRUE(st["drawn"].contains("calibration_histogram")) << st["drawn"].dump();
  ASSERT_TRUE(st["drawn"].contains("calibration_transfer")) << "calibquant (1 bit) calibrates: g(x) is drawn";
  EXPECT_GE(st["drawn"]["calibration_histogram"][3].get<double>(), 180.0);
  EXPECT_GE(st["drawn"]["calibration_transfer"][3].get<double>(), 180.0);
  // The Model panel's facts fit its width (one a row where two do not), none cut.
  ASSERT_TRUE(st["drawn"].contains("model_facts") && st["drawn"].contains("model_panel")) << st["drawn"].dump();
  EXPECT_LE(st["drawn"]["model_facts"][2].get<double>(), st["drawn"]["model_panel"][2].get<double>());
  EXPECT_GT(st["drawn"]["model_facts"][3].get<double>(), 0.0);
  // The image keeps a usable size: at least 240 px, or the panel's width where that is less.
  ASSERT_TRUE(st["drawn"].contains("image") && st["drawn"].contains("image_panel")) << st["drawn"].dump();
  EXPECT_GE(st["drawn"]["image"][2].get<double>(), std::min(240.0, st["drawn"]["image_panel"][2].get<double>()));
  EXPECT_GE(st["drawn"]["image_panel"][2].get<double>(), 240.0) << "the left column at 1280x800";
  // Texts the widths cut show their whole on hover, here the Calibration panel's result line and
  // the overlay's choice; the status bar gives the time to make a frame.
  const json& cut = st["cut_texts"];
  EXPECT_TRUE(std::any_of(cut.begin(), cut.end(), [](const json& t) {
    return t.get<std::string>().rfind("softmax MSE: layer 1 ", 0) == 0 && t.get<std::string>().find("caption") != std::string::npos;
  })) << cut.dump();
  EXPECT_NE(std::find(cut.begin(), cut.end(), "attention of a token"), cut.end()) << cut.dump();
  // The Image panel's sliders are as wide as their values: none is cut (the combos beside them
  // take what is left).
  for (const char* value : {"opacity 0.60", "layer 0", "mean of heads"})
    EXPECT_EQ(std::find(cut.begin(), cut.end(), value), cut.end()) << "a slider's value cut: " << value << " in " << cut.dump();
  // and a Captions cell's numbers and header, in the narrow third column
  EXPECT_TRUE(std::any_of(cut.begin(), cut.end(), [](const json& t) { return t.get<std::string>().rfind("compress ", 0) == 0; }))
      << cut.dump();
  EXPECT_NE(std::find(cut.begin(), cut.end(), "KV bytes · MSE · time"), cut.end()) << cut.dump();
  EXPECT_GT(st["frame_ms"].get<double>(), 0.0);
  // Captions shows the full cache's row and at least two instances' rows whole.
  ASSERT_TRUE(st["drawn"].contains("captions_view")) << st["drawn"].dump();
  const json& view = st["drawn"]["captions_view"];
  const double top = view[1].get<double>(), bottom = top + view[3].get<double>();
  int whole = 0;
  for (const auto& [key, r] : st["drawn"].items())
    if (key.rfind("caption row ", 0) == 0 && r[1].get<double>() >= top && r[1].get<double>() + r[3].get<double>() <= bottom)
      ++whole;
  EXPECT_GE(whole, 3) << st["drawn"].dump();
  EXPECT_EQ(st["plot_magnification"].get<double>(), 1.0) << "no more room than an exported figure's";
}

// At 1280x720, the smallest size the app is made for: every overlay (attention of a generated
// token, and each method's token fate: bits, kept share, merged rows) is drawn with its colour
// bar under the image, over every patch, with its quantity named and its scale's ends apart; and
// the image, the plots, Calibration's figures and Captions keep usable sizes.
TEST(Gui, EveryOverlayHasAColourBarAndThePanelsFitAt1280x720) {
  const std::string dir = kt::make_temp_dir("gui_720");
  const std::vector<std::pair<std::string, int>> overlays = {{"attention", -1}, {"fate_bits", 1}, {"fate_kept", 2},
                                                             {"fate_merged", 3}};
  json steps = {{"steps", {{{"do", "wait_results"}}}}};
  for (size_t i = 0; i < overlays.size(); ++i) {
    steps["steps"].push_back({{"do", "select"}, {"overlay", overlays[i].first}, {"overlay_source", overlays[i].second}});
    steps["steps"].push_back({{"do", "frames"}, {"n", 3}});
    steps["steps"].push_back({{"do", "dump_state"}, {"path", "o" + std::to_string(i) + ".json"}});
  }
  steps["steps"].push_back({{"do", "quit"}});
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "1600x1000", " --size 1280x720");
  ASSERT_EQ(r.code, 0) << r.output;
  for (size_t i = 0; i < overlays.size(); ++i) {
    SCOPED_TRACE(overlays[i].first);
    const json st = load(dir + "/o" + std::to_string(i) + ".json");
    const json& d = st["drawn"];
    ASSERT_TRUE(d.contains("image_colorbar")) << d.dump();
    EXPECT_GE(d["image_colorbar"][2].get<double>(), 100.0) << "the bar's width";
    EXPECT_GT(d["image_colorbar"][3].get<double>(), 4.0) << "the bar's height";
    const json& ov = st["overlay"];
    EXPECT_EQ(ov["patches"].get<int>(), 196) << "one value a patch of the 14x14 grid";
    EXPECT_FALSE(ov["quantity"].get<std::string>().empty());
    EXPECT_FALSE(ov["what"].get<std::string>().empty());
    EXPECT_LT(ov["lo"].get<double>(), ov["hi"].get<double>());
    EXPECT_GE(d["image"][2].get<double>(), 200.0) << "the image's side";
    EXPECT_GE(d["plot"][3].get<double>(), 150.0) << "the plot's height";
    EXPECT_GE(d["calibration_histogram"][3].get<double>(), 150.0);
    EXPECT_GE(d["captions_view"][3].get<double>(), 100.0);
  }
}

// Per-view selection through the running app: the overlay's layer and head leave the Calibration
// panel's alone (what each panel computed says which layer it shows), until "link views" joins
// them; unlinking keeps each where it is.
TEST(Gui, PanelsShowTheirOwnLayerUnlessLinked) {
  const std::string dir = kt::make_temp_dir("gui_views");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"overlay", "attention"}, {"layer", 2}, {"head", 1}, {"calib_layer", 3}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "a.json"}},
                        {{"do", "select"}, {"link_views", true}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "b.json"}},
                        {{"do", "select"}, {"link_views", false}, {"layer", 0}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "c.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  ASSERT_EQ(r.code, 0) << r.output;
  // The Calibration view's key holds its layer and head ("…/layer/head/spec/label").
  auto calib = [](const json& st) {
    const std::string k = st["calibration"]["key"].get<std::string>();
    const size_t a = k.find('/'), b = k.find('/', a + 1), c = k.find('/', b + 1);
    return std::make_pair(std::stoi(k.substr(a + 1, b - a - 1)), std::stoi(k.substr(b + 1, c - b - 1)));
  };
  const json a = load(dir + "/a.json"), b = load(dir + "/b.json"), c = load(dir + "/c.json");
  EXPECT_NE(a["overlay"]["what"].get<std::string>().find("layer 2, head 1"), std::string::npos) << a["overlay"].dump();
  EXPECT_EQ(calib(a), std::make_pair(3, -1)) << "the overlay's selection moved the Calibration panel";
  EXPECT_EQ(calib(b), std::make_pair(2, 1)) << "linked views follow the shared layer and head";
  EXPECT_NE(b["overlay"]["what"].get<std::string>().find("layer 2, head 1"), std::string::npos);
  EXPECT_NE(c["overlay"]["what"].get<std::string>().find("layer 0, head 1"), std::string::npos) << c["overlay"].dump();
  EXPECT_EQ(calib(c), std::make_pair(2, 1)) << "unlinked, the Calibration panel stays where it was";
}

// The mouse over a patch reads that patch's value for every method, the shown one marked; let go,
// the readout is gone.
TEST(Gui, HoveringAPatchReadsEveryMethodsValue) {
  const std::string dir = kt::make_temp_dir("gui_hover");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"overlay", "fate_bits"}, {"overlay_source", 1}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "hover"}, {"over", "image"}, {"x", 0.5}, {"y", 0.5}},
                        {{"do", "dump_state"}, {"path", "on.json"}},
                        {{"do", "hover"}, {"over", ""}, {"x", 0}, {"y", 0}},
                        {{"do", "dump_state"}, {"path", "off.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  ASSERT_EQ(r.code, 0) << r.output;
  const json on = load(dir + "/on.json")["hover_readout"];
  ASSERT_EQ(on.size(), 5u) << on.dump() << ": the patch, then the four seed methods";
  EXPECT_EQ(on[0].get<std::string>().rfind("patch row 7, column 7 (visual token ", 0), 0u) << on.dump();
  EXPECT_EQ(std::count_if(on.begin(), on.end(), [](const json& l) { return l.get<std::string>().find("(shown)") != std::string::npos; }), 1);
  EXPECT_TRUE(load(dir + "/off.json")["hover_readout"].empty());
}

// At 3840×2160 (UI scale 1) a figure given more room than the exports' 720 × 450 grows with its
// panel (text, lines and markers), as the exported figure reads at its size.
TEST(Gui, FiguresGrowWithTheirPanelAt3840x2160) {
  const std::string dir = kt::make_temp_dir("gui_4k");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "select"}, {"plot", "multiples"}},
                        {{"do", "frames"}, {"n", 2}},
                        {{"do", "dump_state"}, {"path", "big.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "3900x2200", " --size 3840x2160");
  ASSERT_EQ(r.code, 0) << r.output;
  const json st = load(dir + "/big.json");
  EXPECT_EQ(st["ui_scale"].get<double>(), 1.0);
  ASSERT_TRUE(st["drawn"].contains("plot")) << st["drawn"].dump();
  const double w = st["drawn"]["plot"][2].get<double>(), h = st["drawn"]["plot"][3].get<double>();
  EXPECT_NEAR(st["plot_magnification"].get<double>(), std::clamp(std::min(w / 720, h / 450), 1.0, 3.0), 1e-6);
  EXPECT_GT(st["plot_magnification"].get<double>(), 1.5);
}

// At 1280×800 the Methods panel scrolls an instance just added into view (its header is drawn,
// the first one's no longer); "Add" offers a compression method, not the full cache; parameters
// are named as the papers write them (τ1, not tau1); the path fields show the file's name (the
// whole path on hover); and an image of a caption dataset gives the comparison table CIDEr-D.
TEST(Gui, MethodsPanelAndPathFieldsShowWhatAResearcherReads) {
  const std::string dir = kt::make_temp_dir("gui_methods");
  // An image of a scene set: its reference captions give the comparison table a CIDEr-D column.
  const kt::RunResult set = kt::run(kt::cli() + " scenes --n 3 --out " + dir + "/set");
  ASSERT_EQ(set.code, 0) << set.output;
  const std::string image = dir + "/set/images/000001.png";
  json steps = {{"steps",
                 {{{"do", "open_image"}, {"path", image}},
                  {{"do", "open_model"}, {"path", kt::source_dir() + "/assets/models/kvlens-scenes-6m"}},
                  {{"do", "wait_results"}}}}};
  for (const char* spec : {"snapkv", "h2o", "lookm", "pyramidkv", "streamingllm", "zipcache", "kivi", "uniform",
                           "calibquant:bits=2", "vlcache"})
    steps["steps"].push_back({{"do", "add_method"}, {"spec", spec}});
  steps["steps"].push_back({{"do", "frames"}, {"n", 3}});
  steps["steps"].push_back({{"do", "dump_state"}, {"path", "methods.json"}});
  steps["steps"].push_back({{"do", "quit"}});
  kt::RunResult r;
  RUN_GUI_SIZED_OR_SKIP(dir, steps, r, "1920x1200", " --size 1280x800");
  ASSERT_EQ(r.code, 0) << r.output;
  const json st = load(dir + "/methods.json");
  const json& ms = st["methods"];
  ASSERT_GE(ms.size(), 11u);
  const std::string last = "method " + std::to_string(ms.back()["id"].get<int>());
  const std::string first = "method " + std::to_string(ms.front()["id"].get<int>());
  EXPECT_TRUE(st["drawn"].contains(last)) << "the instance just added is in view: " << st["drawn"].dump();
  EXPECT_FALSE(st["drawn"].contains(first)) << "the list is longer than the panel (so it scrolled)";
  EXPECT_NE(st["add_choice"], "full");
  const json& cq = st["params_shown"]["calibquant"];
  for (const char* name : {"τ1", "τ2"}) EXPECT_NE(std::find(cq.begin(), cq.end(), name), cq.end()) << cq.dump();
  EXPECT_EQ(std::find(cq.begin(), cq.end(), "tau1"), cq.end()) << cq.dump();
  EXPECT_EQ(st["fields_shown"]["image_path"], "000001.png");
  EXPECT_EQ(st["fields_shown"]["model_dir"], "kvlens-scenes-6m");
  EXPECT_EQ(st["fields"]["image_path"], image) << "the field holds the whole path";
  const json& cols = st["comparison_table"]["columns"];
  const auto c = std::find(cols.begin(), cols.end(), "cider_d");
  ASSERT_NE(c, cols.end()) << cols.dump();
  for (const json& row : st["comparison_table"]["rows"])
    EXPECT_TRUE(row["values"][static_cast<size_t>(c - cols.begin()) - 1].is_number()) << row.dump();
}

TEST(Gui, LogWindowListsEveryMessage) {
  const std::string dir = kt::make_temp_dir("gui_log");
  kt::write_file(dir + "/corrupt.json", "{\"kvlens_session\": 2, \"methods\": [");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "open_session"}, {"path", "corrupt.json"}},
                        {{"do", "open_image"}, {"path", "nope.png"}},
                        {{"do", "show_log"}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "screenshot"}, {"path", "log.png"}},
                        {{"do", "dump_state"}, {"path", "log.json"}},
                        {{"do", "show_log"}, {"open", false}},
                        {{"do", "dump_state"}, {"path", "closed.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  ASSERT_EQ(r.code, 0) << r.output;
  const json d = load(dir + "/log.json");
  EXPECT_TRUE(d["log_open"].get<bool>());
  EXPECT_FALSE(load(dir + "/closed.json")["log_open"].get<bool>());
  ASSERT_TRUE(d["drawn"].contains("log"));
  EXPECT_GE(d["drawn"]["log"][3].get<double>(), 200.0) << "the log window's list is at least 200 px tall";
  int errors = 0;
  for (const json& m : d["messages"]) errors += m["error"].get<bool>();
  EXPECT_GE(errors, 2);
  const RGBImage shot = kvlens::load_image(dir + "/log.png");
  const std::array<int, 3> window_bg{249, 249, 250};
  const Pixels text = region(shot, d["drawn"]["log"], window_bg, 30);
  EXPECT_GT(text.differing, 200u) << "the log window shows no text";
}

// View → UI scale: fonts and widgets grow with it (the frame height doubles at 200 %), it is
// saved beside the recent files and the next start uses it; --ui-scale sets it for one run
// without saving it; a scale out of range is refused.
TEST(Gui, UiScaleGrowsTheUiAndIsSaved) {
  const std::string dir = kt::make_temp_dir("gui_scale");
  const json steps = {{"steps",
                       {{{"do", "frames"}, {"n", 2}},
                        {{"do", "dump_state"}, {"path", "one.json"}},
                        {{"do", "ui_scale"}, {"value", 2.0}},
                        {{"do", "frames"}, {"n", 3}},
                        {{"do", "dump_state"}, {"path", "two.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  ASSERT_EQ(r.code, 0) << r.output;
  const json one = load(dir + "/one.json"), two = load(dir + "/two.json");
  EXPECT_EQ(one["ui_scale"], 1.0);
  EXPECT_EQ(two["ui_scale"], 2.0);
  EXPECT_NEAR(two["frame_height"].get<double>(), 2 * one["frame_height"].get<double>(), 2.0);
  // The next start: the saved scale.
  const json again = {{"steps", {{{"do", "frames"}, {"n", 2}}, {{"do", "dump_state"}, {"path", "three.json"}}, {{"do", "quit"}}}}};
  RUN_GUI_OR_SKIP(dir, again, r);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(load(dir + "/three.json")["ui_scale"], 2.0);
  // Refused out of range, nothing changed.
  const json bad = {{"steps", {{{"do", "ui_scale"}, {"value", 9}}}}};
  RUN_GUI_OR_SKIP(dir, bad, r);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("value"), std::string::npos) << r.output;
}

TEST(Gui, BadInputIsAMessageAndNothingIsLost) {
  const std::string dir = kt::make_temp_dir("guibad");
  kt::write_file(dir + "/notanimage.png", "plain text, not pixels");
  kt::write_file(dir + "/corrupt.json", "{\"methods\": [");
  kt::write_file(dir + "/newer.json", "{\"kvlens_session\": 3, \"methods\": [\"kivi\"]}");
  kt::write_file(dir + "/missing_image.json",
                 "{\"kvlens_session\": 2, \"image\": \"" + dir + "/gone.png\", \"max_new_tokens\": 4, \"methods\": [\"kivi\"]}");
  const json steps = {{"steps",
                       {{{"do", "wait_results"}},
                        {{"do", "open_image"}, {"path", "notanimage.png"}},
                        {{"do", "expect_message"}, {"contains", "notanimage.png"}},
                        {{"do", "open_model"}, {"path", dir}},
                        {{"do", "expect_message"}, {"contains", "not a model folder"}},
                        {{"do", "open_session"}, {"path", "corrupt.json"}},
                        {{"do", "expect_message"}, {"contains", "corrupt.json: not valid JSON"}},
                        {{"do", "open_session"}, {"path", "newer.json"}},
                        {{"do", "expect_message"}, {"contains", "session version 3 is newer than this kvlens reads (version 2)"}},
                        {{"do", "export_report"}, {"path", "/proc/kvlens_no/r.json"}},
                        {{"do", "expect_message"}, {"contains", "/proc/kvlens_no/r.json"}},
                        {{"do", "export_figures"}, {"dir", "/proc/kvlens_no"}, {"formats", "png"}},
                        {{"do", "expect_message"}, {"contains", "/proc/kvlens_no"}},
                        {{"do", "set_param"}, {"method", 0}, {"name", "tau2"}, {"value", 9}},
                        {{"do", "expect_message"}, {"contains", "calibquant: tau2 must be in [0, 8], got 9"}},
                        {{"do", "dump_state"}, {"path", "after_errors.json"}},
                        {{"do", "screenshot"}, {"path", "after_errors.png"}},
                        {{"do", "open_session"}, {"path", "missing_image.json"}},
                        {{"do", "expect_message"}, {"contains", "gone.png not found"}},
                        {{"do", "frames"}, {"n", 20}},
                        {{"do", "dump_state"}, {"path", "missing.json"}},
                        {{"do", "quit"}}}}};
  kt::RunResult r;
  RUN_GUI_OR_SKIP(dir, steps, r);
  ASSERT_EQ(r.code, 0) << r.output;  // every expected message came, and the app ran to the end
  const json st = load(dir + "/after_errors.json");
  ASSERT_EQ(st["methods"].size(), 4u);
  EXPECT_NE(st["methods"][0]["spec"].get<std::string>().find("tau2=3"), std::string::npos);  // refused value not applied
  EXPECT_EQ(st["inputs"]["image_path"], "");  // still the sample image
  EXPECT_EQ(st["inputs"]["model_dir"], "");   // still the embedded model
  EXPECT_TRUE(st["up_to_date"].get<bool>());
  EXPECT_GT(kvlens::load_image(dir + "/after_errors.png").width, 0);
  // A session whose image is gone opens, says so, and stays editable.
  const json m = load(dir + "/missing.json");
  ASSERT_EQ(m["methods"].size(), 1u);
  EXPECT_EQ(m["inputs"]["max_new_tokens"], 4);
  // A refused selection fails the script at that step (the steps after it never run); so does
  // waiting for results that cannot come (the session's image is gone).
  for (const auto& [name, script, says] : std::vector<std::tuple<std::string, json, std::string>>{
           {"select", {{"steps", {{{"do", "select"}, {"layer", 1}, {"calib_method", "a label"}}, {{"do", "dump_state"}, {"path", "never.json"}}}}},
            "calib_method"},
           {"blocked", {{"steps", {{{"do", "open_session"}, {"path", "missing_image.json"}}, {{"do", "wait_results"}}, {{"do", "dump_state"}, {"path", "never.json"}}}}},
            "nothing can be computed"}}) {
    kt::RunResult f;
    RUN_GUI_OR_SKIP(dir, script, f);
    EXPECT_NE(f.code, 0) << name << ": " << f.output;
    EXPECT_NE(f.output.find(says), std::string::npos) << name << ": " << f.output;
    EXPECT_FALSE(kvlens::file_exists(dir + "/never.json")) << name;
  }
  // A script with an unknown step is refused before anything runs.
  kt::write_file(dir + "/bad_script.json", "{\"steps\": [{\"do\": \"fly\"}]}");
  const auto bad = kt::run(std::string(kGui) + " --script " + dir + "/bad_script.json");
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.output.find("unknown step 'fly'"), std::string::npos) << bad.output;
}

// SIGKILL while the app saves its session over and over: the session file on disk is always
// a complete session (the save goes through the atomic writer).
TEST(Gui, KilledSessionSavesLeaveThePreviousSessionValid) {
  const std::string dir = kt::make_temp_dir("guikill");
  json first = {{"steps", {{{"do", "wait_results"}}, {{"do", "save_session"}, {"path", "s.json"}}, {{"do", "quit"}}}}};
  kt::RunResult out;
  RUN_GUI_OR_SKIP(dir, first, out);
  ASSERT_EQ(out.code, 0) << out.output;
  ASSERT_NO_THROW(kvlens::session_from_json(load(dir + "/s.json"), "s.json"));
  // A script that alternates τ2 and saves after every change, for longer than we let it run.
  json loop = {{"steps", {{{"do", "wait_results"}}}}};
  for (int i = 0; i < 400; ++i) {
    loop["steps"].push_back({{"do", "set_param"}, {"method", 0}, {"name", "tau2"}, {"value", i % 2 ? 3 : 2}});
    loop["steps"].push_back({{"do", "save_session"}, {"path", "s.json"}});
    loop["steps"].push_back({{"do", "frames"}, {"n", 3}});
  }
  loop["steps"].push_back({{"do", "quit"}});
  kt::write_file(dir + "/loop.json", loop.dump());
  std::mt19937 rng(3);
  int changed = 0;  // kills that came after the app had saved something new
  std::string previous = kt::read_file(dir + "/s.json");
  for (int i = 0; i < 3; ++i) {
    const pid_t pid = fork();
    if (pid == 0) {
      const std::string cmd = "cd " + dir + " && HOME=" + dir + " XDG_STATE_HOME=" + dir +
                              "/state exec xvfb-run -a -s '-screen 0 1280x800x24' " + kGui + " --script loop.json >/dev/null 2>&1";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
      _exit(127);
    }
    // Kill while the app saves again and again: once its first save of this run has landed (so a
    // loaded machine cannot make every kill come before any save), after a random delay.
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(90);
    while (kt::read_file(dir + "/s.json") == previous && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 400));
    kt::run(std::string("pkill -KILL -f '") + kGui + " --script loop.json'");
    waitpid(pid, nullptr, 0);
    const std::string text = kt::read_file(dir + "/s.json");
    ASSERT_TRUE(json::accept(text)) << "session file left half-written";
    EXPECT_NO_THROW(kvlens::session_from_json(json::parse(text), "s.json"));
    changed += text != previous;
    previous = text;
  }
  EXPECT_GE(changed, 1) << "the app was killed before it saved anything: the test did not exercise a save";
}
