// The desktop app's state and worker without a window: a newer change cancels the run it
// replaces, values are validated by the schema, undo/redo treat a drag as one step, and a
// session round-trips through the shared schema.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <thread>

#include "tests/test_util.h"

#ifndef KVLENS_HAVE_GUI_APP
TEST(GuiApp, NeedsTheApp) { GTEST_SKIP() << "kvlens-gui is not built (KVLENS_GUI=OFF or its packages are missing)"; }
#else
#include "app/gui/app.h"
#include "app/gui/caption_diff.h"
#include "app/gui/overlay.h"
#include "core/errors.h"
#include "core/files.h"
#include "kernels/backends.h"

namespace kt = kvlens::testing;
using namespace kvlens;
using namespace kvlens::gui;

namespace {

bool wait_for(const std::function<bool()>& ok, double seconds = 120) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (ok()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

Setup base_setup() {
  Setup s;
  s.model_dir = kt::source_dir() + "/assets/models/kvlens-scenes-6m";
  s.image_path = kt::source_dir() + "/assets/images/scene_000.png";
  s.methods = {{1, parse_method_spec("kivi"), ""}};
  return s;
}

bool idle_at(const Worker& w, uint64_t v) {
  const auto s = w.latest();
  return s->setup_version == v && !s->busy;
}

// An App whose recent files and autosave go to a temporary folder.
struct TempHome {
  TempHome() {
    dir = kt::make_temp_dir("guiapp");
    setenv("XDG_STATE_HOME", (dir + "/state").c_str(), 1);
  }
  std::string dir;
};

}  // namespace

TEST(GuiWorker, ANewerChangeCancelsTheRunItReplaces) {
  Worker w;
  kvlens::Setup s = base_setup();
  uint64_t v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  const auto first = w.latest();
  ASSERT_EQ(first->runs.size(), 1u) << first->base_error << first->model_error;
  const int done = first->runs_done;

  // Two changes back to back: only the newer one is ever computed.
  s.methods[0].params = parse_method_spec("kivi:bits=4");
  w.submit(s);
  s.methods[0].params = parse_method_spec("kivi:group=16");
  v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  auto snap = w.latest();
  ASSERT_EQ(snap->runs.size(), 1u);
  EXPECT_EQ(snap->runs[0].spec, parse_method_spec("kivi:group=16").spec());
  EXPECT_EQ(snap->runs_done, done + 1);

  // A change while a run decodes cancels it between decode steps.
  const int cancelled = snap->runs_cancelled;
  s.methods[0].params = parse_method_spec("kivi:bits=4,group=8");
  w.submit(s);
  ASSERT_TRUE(wait_for([&] { return w.latest()->stage == "kivi:bits=4,group=8" && w.progress().tokens_done >= 2; }));
  s.methods[0].params = parse_method_spec("kivi:group=64");
  v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  snap = w.latest();
  EXPECT_EQ(snap->runs[0].spec, parse_method_spec("kivi:group=64").spec());
  EXPECT_EQ(snap->runs_done, done + 2);  // the run that was decoding never finished
  EXPECT_EQ(snap->runs_cancelled, cancelled + 1);
  // The report holds what the snapshot holds.
  ASSERT_TRUE(snap->report);
  EXPECT_EQ((*snap->report)["methods"][0]["spec"], snap->runs[0].spec);
}

TEST(GuiWorker, BadImageAndModelAreErrorsNotCrashes) {
  Worker w;
  kvlens::Setup s = base_setup();
  s.image_path = kt::source_dir() + "/README.md";
  uint64_t v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  EXPECT_NE(w.latest()->base_error.find("README.md"), std::string::npos) << w.latest()->base_error;
  EXPECT_TRUE(w.latest()->runs.empty());
  s.model_dir = kt::source_dir() + "/assets";
  v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  EXPECT_NE(w.latest()->model_error.find("config.json"), std::string::npos) << w.latest()->model_error;
  // Back to good inputs: results again.
  v = w.submit(base_setup());
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  EXPECT_EQ(w.latest()->runs.size(), 1u);
}

// The Model panel's two choices reach the worker: fp32 rows recompute the prefill and every
// method with exact rows (the full cache's bytes grow by the fp16 codes), and the backend choice
// reloads the model on that backend, or names why it cannot.
TEST(GuiWorker, KvRowsAndBackendReachTheRuns) {
  Worker w;
  kvlens::Setup s = base_setup();
  s.backend.kind = "cpu";
  uint64_t v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  auto snap = w.latest();
  ASSERT_TRUE(snap->model && snap->base && snap->base->ex) << snap->model_error << snap->base_error;
  EXPECT_EQ(snap->model->backend, "cpu");
  const double b16 = static_cast<double>(snap->base->ex->full.bytes_after_prefill.total());
  const int done = snap->runs_done;
  s.opt.kv_storage = RowStorage::Fp32;
  v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v); }));
  snap = w.latest();
  ASSERT_TRUE(snap->base && snap->base->ex) << snap->base_error;
  const double b32 = static_cast<double>(snap->base->ex->full.bytes_after_prefill.total());
  // Per row and KV head: 2·D values at 2 or 4 B plus a 4 B position.
  ASSERT_GT(2 * b16 - b32, 0);
  EXPECT_DOUBLE_EQ((b32 - b16) / (2 * b16 - b32), snap->model->head_dim);
  EXPECT_EQ(snap->runs_done, done + 1);  // the method ran again on the new prefill
  s.backend.kind = "cuda";
  v = w.submit(s);
  ASSERT_TRUE(wait_for([&] { return idle_at(w, v) && (w.latest()->model || !w.latest()->model_error.empty()); }));
  snap = w.latest();
  if (cuda_unavailable_reason().empty()) {
    ASSERT_TRUE(snap->model) << snap->model_error;
    EXPECT_EQ(snap->model->backend, "cuda");
  } else {
    EXPECT_FALSE(snap->model);
    EXPECT_NE(snap->model_error.find("cuda"), std::string::npos) << snap->model_error;
  }
}

TEST(GuiApp, ValuesUndoRedoAndSessions) {
  TempHome home;
  App app(kt::source_dir());
  app.add_seed_methods();
  ASSERT_EQ(app.st.methods.size(), 4u);
  const int id = app.st.methods[0].id;
  // Refused by the schema: a message, nothing changes.
  const std::string before = app.st.methods[0].params.spec();
  EXPECT_FALSE(app.set_param(id, "tau2", "9"));
  EXPECT_EQ(app.st.methods[0].params.spec(), before);
  EXPECT_NE(app.st.messages.back().text.find("calibquant: tau2 must be in [0, 8], got 9"), std::string::npos);
  EXPECT_FALSE(app.set_param(id, "bits", "1,tau1=5"));  // a value cannot carry other values
  // A drag is one undo step; single changes are one each.
  app.begin_edit();
  app.set_param(id, "tau2", "2.5");
  app.set_param(id, "tau2", "1.5");
  app.end_edit();
  app.begin_edit();
  app.set_param(id, "tau1", "0.5");
  app.end_edit();
  EXPECT_EQ(app.st.methods[0].params.str("tau2"), "1.5");
  app.undo();
  EXPECT_EQ(app.st.methods[0].params.str("tau1"), "0");
  EXPECT_EQ(app.st.methods[0].params.str("tau2"), "1.5");
  app.undo();
  EXPECT_EQ(app.st.methods[0].params.spec(), before);
  app.redo();
  EXPECT_EQ(app.st.methods[0].params.str("tau2"), "1.5");
  // Session round trip through the shared schema.
  app.set_label(app.st.methods[1].id, "ZipCache r=0.4");
  app.set_enabled(app.st.methods[2].id, false);
  app.st.views.layer = 2;
  app.st.views.head = 5;
  app.st.inputs.kv_storage = "fp32";
  const std::string path = home.dir + "/s.json";
  ASSERT_TRUE(app.save_session(path));
  const Session saved = load_session(path);
  EXPECT_EQ(saved.method_label(1), "ZipCache r=0.4");
  EXPECT_FALSE(saved.method_enabled(2));
  EXPECT_EQ(saved.views["layer"], 2);
  EXPECT_EQ(saved.kv_storage, "fp32");
  App other(kt::source_dir());
  ASSERT_TRUE(other.open_session(path));
  ASSERT_EQ(other.st.methods.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(other.st.methods[i].params.spec(), app.st.methods[i].params.spec());
    EXPECT_EQ(other.st.methods[i].label, app.st.methods[i].label);
    EXPECT_EQ(other.st.methods[i].enabled, app.st.methods[i].enabled);
  }
  EXPECT_EQ(other.st.views.layer, 2);
  EXPECT_EQ(other.st.views.head, 5);
  EXPECT_EQ(other.st.inputs.kv_storage, "fp32");
  EXPECT_EQ(other.views_json(), app.views_json());
  // A newer session is refused and the open one stays as it was.
  kt::write_file(home.dir + "/newer.json", "{\"kvlens_session\": 3}");
  EXPECT_FALSE(other.open_session(home.dir + "/newer.json"));
  EXPECT_EQ(other.st.methods.size(), 4u);
  EXPECT_NE(other.st.messages.back().text.find("version 3 is newer"), std::string::npos);
  // Bad views are named and skipped; the good ones apply.
  EXPECT_FALSE(other.apply_views_json({{"layer", 1}, {"head", "all"}, {"zoom", 3}}, "v.json"));
  EXPECT_EQ(other.st.views.layer, 1);
  EXPECT_EQ(other.st.views.head, 5);
  // Recent sessions are remembered in the state folder.
  EXPECT_TRUE(file_exists(home.dir + "/state/kvlens/recent.json"));
}

// After New, the input boxes show what the app analyses (the sample image, the default prompt),
// and the status line no longer shows the previous session's last message.
TEST(GuiApp, NewSessionResetsWhatTheFieldsShowAndTheStatus) {
  TempHome home;
  App app(kt::source_dir());
  app.st.edits.image_path = home.dir + "/typed.png";
  app.st.edits.model_dir = home.dir + "/typed-model";
  app.st.edits.prompt = "typed, not applied";
  app.st.edits.max_new_tokens = 7;
  app.st.edits.param_text["1/pooling"] = "typed";
  app.info("report written to " + home.dir + "/r.json");
  app.new_session();
  EXPECT_EQ(app.st.edits.image_path, app.st.inputs.image_path);
  EXPECT_EQ(app.st.edits.model_dir, app.st.inputs.model_dir);
  EXPECT_EQ(app.st.edits.prompt, std::string(kDefaultPrompt));
  EXPECT_EQ(app.st.edits.max_new_tokens, app.st.inputs.max_new_tokens);
  EXPECT_TRUE(app.st.edits.param_text.empty());
  ASSERT_FALSE(app.st.messages.empty());
  EXPECT_EQ(app.st.messages.back().text.find("report written"), std::string::npos) << app.st.messages.back().text;
  EXPECT_FALSE(app.st.messages.back().error);
}

// Opening a model by an embedded model's name opens its folder; an unknown name is an error and
// leaves the model as it was.
TEST(GuiApp, OpenModelTakesAnEmbeddedModelsName) {
  TempHome home;
  App app(kt::source_dir());
  app.open_model("kvlens-scenes-14m");
  EXPECT_EQ(app.st.inputs.model_dir, kt::source_dir() + "/assets/models/kvlens-scenes-14m");
  EXPECT_EQ(app.model_dir(), app.st.inputs.model_dir);
  app.open_model("kvlens-scenes-99m");
  EXPECT_EQ(app.st.inputs.model_dir, kt::source_dir() + "/assets/models/kvlens-scenes-14m");
  ASSERT_FALSE(app.st.messages.empty());
  EXPECT_TRUE(app.st.messages.back().error);
  EXPECT_NE(app.st.messages.back().text.find("kvlens-scenes-99m"), std::string::npos) << app.st.messages.back().text;
}

// The app's default model and sample image: KVLENS_MODEL's model (the tests' 4-layer one) with
// its own classic scene; unset, the 12-layer model with its rich scene; set wrong, an error shown
// at start (the app runs on, and that folder fails to load like any other).
TEST(GuiApp, DefaultModelAndImageFollowKvlensModel) {
  TempHome home;
  const std::string models = kt::source_dir() + "/assets/models/", images = kt::source_dir() + "/assets/images/";
  struct Restore {
    std::string was = std::getenv("KVLENS_MODEL") ? std::getenv("KVLENS_MODEL") : "";
    ~Restore() { was.empty() ? unsetenv("KVLENS_MODEL") : setenv("KVLENS_MODEL", was.c_str(), 1); }
  } restore;
  setenv("KVLENS_MODEL", "kvlens-scenes-6m", 1);
  {
    App app(kt::source_dir());
    EXPECT_EQ(app.model_dir(), models + "kvlens-scenes-6m");
    EXPECT_EQ(app.image_path(), images + "scene_000.png");
    EXPECT_TRUE(app.st.messages.empty());
  }
  unsetenv("KVLENS_MODEL");
  {
    App app(kt::source_dir());
    EXPECT_EQ(app.model_dir(), models + "kvlens-scenes-14m");
    EXPECT_EQ(app.image_path(), images + "rich_000.png");
    app.open_model("kvlens-scenes-6m");
    EXPECT_EQ(app.image_path(), images + "scene_000.png") << "the sample image follows the model opened";
  }
  setenv("KVLENS_MODEL", (home.dir + "/nothere").c_str(), 1);
  {
    App app(kt::source_dir());
    ASSERT_EQ(app.st.messages.size(), 1u);
    EXPECT_TRUE(app.st.messages[0].error);
    EXPECT_NE(app.st.messages[0].text.find("KVLENS_MODEL='" + home.dir + "/nothere' names no model folder"),
              std::string::npos)
        << app.st.messages[0].text;
    EXPECT_EQ(app.model_dir(), home.dir + "/nothere");
  }
}

// A session whose image file is gone: opening it ends on an error, and once the worker has tried,
// the app says why nothing is computed (the status bar, Captions, Plots and Methods read
// blocked()) instead of computing forever.
TEST(GuiApp, ASessionWhoseImageIsMissingSaysSo) {
  TempHome home;
  Session s;
  s.image = home.dir + "/gone.png";
  s.methods = {parse_method_spec("kivi")};
  save_session(home.dir + "/s.json", s);
  App app(kt::source_dir());
  ASSERT_TRUE(app.open_session(home.dir + "/s.json"));
  ASSERT_FALSE(app.st.messages.empty());
  EXPECT_TRUE(app.st.messages.back().error) << app.st.messages.back().text;
  EXPECT_NE(app.st.messages.back().text.find("missing input"), std::string::npos) << app.st.messages.back().text;
  ASSERT_TRUE(wait_for([&] {
    app.poll();
    return !app.busy();
  }));
  EXPECT_NE(app.blocked().find("gone.png"), std::string::npos) << app.blocked();
  EXPECT_FALSE(app.up_to_date());
  // An image that exists again: results, and nothing blocks.
  app.st.inputs.image_path = kt::source_dir() + "/assets/images/scene_000.png";
  app.submit();
  ASSERT_TRUE(wait_for([&] {
    app.poll();
    return app.up_to_date();
  }));
  EXPECT_EQ(app.blocked(), "");
}
// Overlays veil each patch by its value on a scale the colour bar draws: attention and rows
// merged from 0 to their largest value, kept share from 0 to 1, bits on log2(1 + bits) from the
// fewest present with the levels present as ticks; a patch at the top is left as it is, one at the bottom greyed and
// dimmed by the opacity. On a computed session each source's values are its recorder's and its
// diagnostics', and the hover lists the full cache and every method.
TEST(GuiApp, OverlaysVeilEachPatchByItsValueOnAScale) {
  const OverlayScale a = overlay_scale(Overlay::Attention, {0.0f, 0.1f, 0.4f});
  EXPECT_EQ(a.lo, 0.0);
  EXPECT_FLOAT_EQ(a.hi, 0.4f);
  EXPECT_DOUBLE_EQ(overlay_position(a, 0.4f), 1.0);
  EXPECT_NEAR(overlay_position(a, 0.2), 0.5, 1e-6);
  EXPECT_FLOAT_EQ(overlay_veil(a, 0.4f, 0.6f), 0.0f);
  EXPECT_FLOAT_EQ(overlay_veil(a, 0.0, 0.6f), 0.6f);
  EXPECT_NE(a.quantity.find("attention"), std::string::npos);
  const OverlayScale k = overlay_scale(Overlay::FateKept, {0.0f, 0.25f});
  EXPECT_EQ(k.hi, 1.0);  // a share, whatever the largest value
  const OverlayScale b = overlay_scale(Overlay::FateBits, {0.0f, 2.0f, 2.0f, 16.0f});
  EXPECT_TRUE(b.log2);
  EXPECT_EQ(b.levels, (std::vector<double>{0.0, 2.0, 16.0}));
  EXPECT_NEAR(overlay_position(b, 2.0), std::log2(3.0) / std::log2(17.0), 1e-12);
  // Nothing evicted: the bar starts at the fewest bits present, so 2 to 4 bits spread over it.
  const OverlayScale m = overlay_scale(Overlay::FateBits, {2.0f, 3.0f, 4.0f});
  EXPECT_EQ(m.lo, 2.0);
  EXPECT_EQ(m.hi, 4.0);
  EXPECT_DOUBLE_EQ(overlay_position(m, 2.0), 0.0);
  EXPECT_NEAR(overlay_position(m, 3.0), 1.0 / std::log2(3.0), 1e-12);
  EXPECT_EQ(overlay_scale(Overlay::FateBits, {1.0f, 1.0f}).lo, 0.0);  // one level: 0 to it
  EXPECT_TRUE(overlay_scale(Overlay::Attention, {0.0f, 0.0f}).empty());  // nothing to scale: no overlay
  // The veil: none leaves the colour, a full one a dim grey of its luminance, monotone between.
  unsigned char c0[3] = {230, 140, 40}, c1[3] = {230, 140, 40}, c2[3] = {230, 140, 40};
  apply_veil(0.0f, c0);
  apply_veil(0.5f, c1);
  apply_veil(1.0f, c2);
  EXPECT_TRUE(c0[0] == 230 && c0[1] == 140 && c0[2] == 40);
  const int grey = static_cast<int>(std::lround(0.4 * (0.299 * 230 + 0.587 * 140 + 0.114 * 40)));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(c2[i], grey) << i;
  EXPECT_TRUE(c1[0] < 230 && c1[0] > c2[0]);

  TempHome home;
  App app(kt::source_dir());
  app.st.methods.clear();
  const int id = app.add_method(parse_method_spec("snapkv:budget=0.3"));
  ASSERT_TRUE(wait_for([&] {
    app.poll();
    return app.up_to_date();
  }));
  Views& v = app.st.views;
  v.layer = 1;
  v.head = -1;
  v.token = 0;
  v.overlay = Overlay::Attention;
  const OverlayData full = overlay_of(app, -1), method = overlay_of(app, id);
  const Snapshot& snap = *app.st.results;
  EXPECT_EQ(full.values, snap.base->patches->attention(0, 1, -1));
  EXPECT_EQ(method.values, app.any_result(id)->patches->attention(0, 1, -1));
  EXPECT_FLOAT_EQ(static_cast<float>(full.scale.hi), *std::max_element(full.values.begin(), full.values.end()));
  EXPECT_NE(full.what.find("full cache"), std::string::npos) << full.what;
  EXPECT_EQ(overlay_sources(app), (std::vector<int>{-1, id}));
  v.overlay = Overlay::FateKept;
  v.overlay_source = id;
  const OverlayData kept = overlay_of(app, id);
  EXPECT_EQ(kept.values, app.any_result(id)->run->layers[1].fate_kept);
  EXPECT_TRUE(overlay_of(app, -1).values.empty());  // the full cache has no fate
  EXPECT_EQ(overlay_sources(app), (std::vector<int>{id}));
}

// Figures export on a thread of their own: export_figures returns at once, the progress counts
// figures, poll() reports the end; a cancelled export stops between figures and says how many
// were written (every file written is whole); a second export while one runs is refused.
TEST(GuiApp, ExportRunsOnItsOwnThreadAndCanBeCancelled) {
  TempHome home;
  App app(kt::source_dir());
  app.st.export_opt.png = true;
  app.st.export_opt.svg = true;
  app.st.export_opt.pdf = true;
  app.st.export_opt.csv = false;
  std::vector<fig::Figure> figs;
  for (int i = 0; i < 120; ++i) {
    fig::Figure f;
    f.id = "fig_" + std::to_string(i);
    f.title = "figure " + std::to_string(i);
    f.x.max = f.y.max = 1;
    fig::Series sr;
    sr.label = "line";
    sr.x = {0, 1};
    sr.y = {0, static_cast<double>(i) / 120};
    f.series.push_back(sr);
    figs.push_back(f);
  }
  auto count = [](const std::string& dir) {
    int n = 0;
    struct stat sb {};
    for (const char* ext : {".png", ".svg", ".pdf"})
      for (int i = 0; i < 120; ++i) n += ::stat((dir + "/fig_" + std::to_string(i) + ext).c_str(), &sb) == 0 ? 1 : 0;
    return n;
  };
  // A long export: a second one is refused while it runs; cancelled, it stops between figures
  // with each written file whole, and says how many it wrote.
  const std::string part = home.dir + "/part";
  ASSERT_TRUE(app.export_figures(part, figs));
  EXPECT_TRUE(app.exporting());
  EXPECT_FALSE(app.export_figures(home.dir + "/second", figs));
  EXPECT_NE(app.st.messages.back().text.find("one is running"), std::string::npos) << app.st.messages.back().text;
  app.cancel_export();
  ASSERT_TRUE(wait_for([&] {
    app.poll();
    return !app.exporting();
  }));
  const int written = count(part);
  EXPECT_LT(written, 120 * 3);
  EXPECT_EQ(written % 3, 0) << "a figure's formats are written together";
  for (int i = 0; i < written / 3; ++i) {
    const std::string png = kt::read_file(part + "/fig_" + std::to_string(i) + ".png");
    EXPECT_EQ(png.substr(1, 3), "PNG") << i;
  }
  EXPECT_NE(app.st.messages.back().text.find("export cancelled: " + std::to_string(written / 3) + " of 120 figures"),
            std::string::npos)
      << app.st.messages.back().text;
  // A short one to its end: every file, and the report once it is done.
  const std::string all = home.dir + "/all";
  ASSERT_TRUE(app.export_figures(all, std::vector<fig::Figure>(figs.begin(), figs.begin() + 12)));
  app.wait_export();
  EXPECT_FALSE(app.exporting());
  EXPECT_EQ(count(all), 12 * 3);
  EXPECT_NE(app.st.messages.back().text.find("12 figures (36 files) written to " + all), std::string::npos)
      << app.st.messages.back().text;
}

// A scripted selection is every field or none: one refused field leaves the views as they were.
// An automatic label (an instance's short spec) holds while an edit lasts, as a drag of its
// slider makes one: every set_param of the drag leaves the name the instance had when the edit
// began, and end_edit gives it the new one; an instance's own label is its name throughout.
TEST(GuiApp, AnAutomaticLabelHoldsWhileAnEditLasts) {
  TempHome home;
  App app(kt::source_dir());
  const int a = app.add_method(parse_method_spec("snapkv:budget=0.1"), "");
  const int b = app.add_method(parse_method_spec("h2o:budget=0.1"), "mine");
  const std::string before = app.display_name(*app.find(a));
  app.begin_edit();
  for (const char* v : {"0.15", "0.2", "0.3"}) {
    ASSERT_TRUE(app.set_param(a, "budget", v));
    ASSERT_TRUE(app.set_param(b, "budget", v));
    EXPECT_EQ(app.display_name(*app.find(a)), before) << v;
    EXPECT_EQ(app.display_name(*app.find(b)), "mine") << v;
  }
  app.end_edit();
  EXPECT_EQ(app.display_name(*app.find(a)), parse_method_spec("snapkv:budget=0.3").short_spec());
  EXPECT_NE(app.display_name(*app.find(a)), before);
  EXPECT_EQ(app.display_name(*app.find(b)), "mine");
  // Outside an edit a change renames at once.
  ASSERT_TRUE(app.set_param(a, "budget", "0.2"));
  EXPECT_EQ(app.display_name(*app.find(a)), parse_method_spec("snapkv:budget=0.2").short_spec());
  // An edit that comes back to where it began leaves no held name with the worker: once it has
  // caught up, the report names only the instance with a label of its own.
  app.begin_edit();
  ASSERT_TRUE(app.set_param(a, "budget", "0.3"));
  ASSERT_TRUE(app.set_param(a, "budget", "0.2"));
  app.end_edit();
  ASSERT_TRUE(wait_for([&] { return idle_at(app.worker, app.st.setup_version); }));
  const auto snap = app.worker.latest();
  ASSERT_TRUE(snap->report);
  int labelled = 0;
  for (const auto& m : (*snap->report)["methods"])
    if (m.contains("label")) {
      EXPECT_EQ(m["label"], "mine") << m.dump().substr(0, 200);
      ++labelled;
    }
  EXPECT_EQ(labelled, 1);
}

TEST(GuiApp, SelectIsAllOrNothing) {
  TempHome home;
  App app(kt::source_dir());
  app.add_seed_methods();
  ASSERT_TRUE(app.select_views({{"layer", 1}, {"head", 2}}, "select"));
  const nlohmann::json before = app.views_json();
  EXPECT_FALSE(app.select_views({{"layer", 3}, {"calib_method", "ZipCache r=0.4"}}, "select"));
  EXPECT_EQ(app.views_json(), before);
  EXPECT_EQ(app.st.views.layer, 1);
  EXPECT_NE(app.st.messages.back().text.find("calib_method"), std::string::npos) << app.st.messages.back().text;
  ASSERT_TRUE(app.select_views({{"layer", 3}}, "select"));
  EXPECT_EQ(app.st.views.layer, 3);
}

// Each panel keeps its own layer and head: choosing the overlay's moves neither the Calibration
// panel's nor the heatmap's. Linked, they are one selection: turning the link on takes the
// overlay's, and moving any then moves the others; unlinked again, they part. The selection and
// the link are saved with the views.
TEST(GuiApp, PanelsKeepTheirOwnLayerAndHeadUnlessLinked) {
  TempHome home;
  App app(kt::source_dir());
  app.add_seed_methods();
  Views& v = app.st.views;
  ASSERT_TRUE(app.select_views({{"layer", 2}, {"head", 1}}, "select"));
  EXPECT_EQ(v.calib_layer, 0);
  EXPECT_EQ(v.calib_head, -1);
  EXPECT_EQ(v.heatmap_layer, 0);
  ASSERT_TRUE(app.select_views({{"calib_layer", 3}, {"calib_head", -1}, {"heatmap_layer", 1}}, "select"));
  EXPECT_EQ(v.layer, 2);
  EXPECT_EQ(v.head, 1);
  ASSERT_TRUE(app.select_views({{"link_views", true}}, "select"));
  EXPECT_EQ(v.calib_layer, 2);
  EXPECT_EQ(v.heatmap_layer, 2);
  EXPECT_EQ(v.calib_head, 1);
  ASSERT_TRUE(app.select_views({{"calib_layer", 0}}, "select"));
  EXPECT_EQ(v.layer, 0);
  EXPECT_EQ(v.heatmap_layer, 0);
  ASSERT_TRUE(app.select_views({{"calib_head", -1}}, "select"));
  EXPECT_EQ(v.head, -1);
  // A panel's slider between frames (link_views after the frame's panels).
  Views before = v;
  v.heatmap_layer = 3;
  link_views(v, before);
  EXPECT_EQ(v.layer, 3);
  EXPECT_EQ(v.calib_layer, 3);
  const nlohmann::json saved = app.views_json();
  EXPECT_EQ(saved["link_views"], true);
  EXPECT_EQ(saved["calib_layer"], 3);
  ASSERT_TRUE(app.select_views({{"link_views", false}, {"layer", 1}}, "select"));
  EXPECT_EQ(v.calib_layer, 3);
  EXPECT_EQ(v.heatmap_layer, 3);
  before = v;
  v.calib_layer = 2;
  link_views(v, before);
  EXPECT_EQ(v.layer, 1);
  // Reopened views are the saved ones.
  App other(kt::source_dir());
  other.add_seed_methods();
  ASSERT_TRUE(other.apply_views_json(saved, "v.json"));
  EXPECT_EQ(other.views_json(), saved);
}
// The Captions panel's word diff: the differing words, what the full cache said in their
// place, words added, and words dropped (before a word, or at the end).
TEST(GuiApp, CaptionWordDiffNamesWhatTheFullCacheSaid) {
  auto diff = [](const std::string& a, const std::string& b) { return caption_word_diff(caption_words(a), caption_words(b)); };
  const auto d = diff("four shapes: a medium purple circle, a small green cross",
                      "four shapes: a medium black triangle and a small green cross");
  ASSERT_EQ(d.size(), 11u);
  for (size_t i : {0, 1, 2, 3, 7, 8, 9, 10}) EXPECT_FALSE(d[i].differs) << i;
  for (size_t i : {4, 5, 6}) EXPECT_TRUE(d[i].differs) << i;
  EXPECT_EQ(d[4].replaced, "purple circle,");
  EXPECT_EQ(d[5].replaced, "");
  for (const WordDiff& w : d) EXPECT_EQ(w.dropped + w.dropped_after, "");
  const auto dropped = diff("a b c d", "a d");
  ASSERT_EQ(dropped.size(), 2u);
  EXPECT_FALSE(dropped[1].differs);
  EXPECT_EQ(dropped[1].dropped, "b c");
  const auto added = diff("a d", "a b d");
  EXPECT_TRUE(added[1].differs);
  EXPECT_EQ(added[1].replaced, "");
  EXPECT_FALSE(added[2].differs);
  const auto tail = diff("a b c", "a");
  ASSERT_EQ(tail.size(), 1u);
  EXPECT_EQ(tail[0].dropped, "");
  EXPECT_EQ(tail[0].dropped_after, "b c");
  const auto both = diff("x b y", "b");  // dropped before the word, and after it
  ASSERT_EQ(both.size(), 1u);
  EXPECT_EQ(both[0].dropped, "x");
  EXPECT_EQ(both[0].dropped_after, "y");
  EXPECT_TRUE(diff("a b", "").empty());
  const auto all = diff("", "x y");
  EXPECT_TRUE(all[0].differs && all[1].differs);
  EXPECT_EQ(all[0].replaced, "");
}

#endif
