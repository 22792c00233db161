// The desktop app's controller: owns the state and the worker; panels read the state and call
// these to change it. Every change that affects results goes to the worker as a new setup.
// Bad input (a file that is not an image, a folder that is not a model, a corrupt or newer
// session, an out-of-range parameter, an unwritable export path) becomes a message in the app;
// nothing else changes.
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <utility>
#include <string>
#include <thread>
#include <vector>

#include "app/gui/state.h"
#include "app/figures/figures.h"
#include "app/figures/figures_report.h"
#include "app/lab/session.h"

namespace kvlens::gui {

class App {
 public:
  // `source_dir` holds the embedded model and the sample image.
  explicit App(std::string source_dir);
  ~App();  // cancels a running export and waits for it

  State st;
  Worker worker;

  double now() const;  // seconds since start
  void info(const std::string& text);
  void error(const std::string& text);

  // ----- inputs ---------------------------------------------------------------------------
  std::string model_dir() const;   // resolved ("" → the embedded model)
  std::string image_path() const;  // resolved ("" → the sample image)
  std::string default_model_dir() const;
  std::string default_image() const;
  void open_image(const std::string& path);  // checks the file decodes first
  void open_model(const std::string& path);  // a folder or an embedded model's name; checks for config.json first
  void set_prompt(const std::string& prompt, int max_new_tokens);
  void submit();  // hands the current setup to the worker

  // ----- method instances -----------------------------------------------------------------
  MethodInstance* find(int id);
  const MethodInstance* find(int id) const;
  int add_method(const Params& p, const std::string& label = "");
  void add_seed_methods();  // calibquant, zipcache, vlcache, lookm
  void remove_method(int id);
  void duplicate_method(int id);
  void move_method(int id, int delta);
  void set_enabled(int id, bool on);
  void set_label(int id, const std::string& label);
  // Validates through the method's schema; a refused value leaves the instance as it was and
  // shows the message ("calibquant: tau2 must be in [0, 8], got 9"). Returns whether applied.
  bool set_param(int id, const std::string& name, const std::string& value);
  bool apply_preset(int id, const std::string& preset);
  void reset_method(int id);
  // Its label, else its short spec; while an edit lasts (begin_edit … end_edit) the short spec
  // it had when the edit began, so that legends and export names hold still during a drag.
  std::string display_name(const MethodInstance& m) const;

  // Undo / redo of method and parameter changes. A drag is one step: begin_edit when it
  // starts, end_edit when it ends; single changes call both.
  void begin_edit();
  void end_edit();
  void undo();
  void redo();

  // ----- results --------------------------------------------------------------------------
  void poll();  // takes the worker's newest snapshot (once per frame)
  const RunResult* result(int id) const;          // computed with the instance's current values
  const RunResult* any_result(int id) const;      // the last computed, possibly older values
  int report_index(int id) const;                 // the instance's place in the report, or -1
  bool up_to_date() const;                        // every enabled instance computed for this setup
  bool busy() const;
  // Why nothing can be computed for the current setup (the model or the image did not load),
  // once the worker has tried; "" otherwise. Every panel that waits for results says it.
  std::string blocked() const;
  // A figure of the current report by key ("softmax_mse", "hist:<report index>:<layer>", ...),
  // built once per report; null while there is no report or the key does not apply.
  const fig::Figure* figure(const std::string& key);
  std::vector<fig::Figure> report_figures_all() const;
  std::vector<fig::Figure> shown_figures();  // the figures on screen now
  // The Calibration panel's figures for the chosen instance, layer and head, recalibrated from
  // the stored quantized scores with the instance's current values (recomputed when those
  // change; app/gui/calibration.cpp).
  const CalibrationView& calibration_view();

  // ----- sessions -------------------------------------------------------------------------
  Session to_session() const;
  nlohmann::json views_json() const;
  bool apply_views_json(const nlohmann::json& v, const std::string& where);
  // The same for a scripted selection: every field or none — a refused field leaves the views
  // as they were (the message names it) and returns false.
  bool select_views(const nlohmann::json& j, const std::string& where);
  bool open_session(const std::string& path);
  bool save_session(const std::string& path);
  void new_session();
  // The edit fields (image path, model folder, prompt, tokens, typed parameters) show the inputs.
  void sync_edits();
  void autosave();  // every 30 s while there are unsaved changes
  std::string state_dir() const;  // where recent files and the autosave live

  // ----- export ---------------------------------------------------------------------------
  // Starts writing `figures` to `dir` on a thread of its own (one export at a time): the UI stays
  // responsive, shows the progress and can cancel; poll() reports the end. False, with a
  // message, when nothing was started (no figures, an export already running).
  bool export_figures(const std::string& dir, const std::vector<fig::Figure>& figures);
  bool exporting() const;
  // Figures written and to write by the running export (0, 0 when none).
  std::pair<size_t, size_t> export_progress() const;
  void cancel_export();
  // Waits for the running export and reports it (a script's steps run in order).
  void wait_export();
  bool export_report(const std::string& path);

  void remember(std::vector<std::string>& list, const std::string& item);
  void save_recent();

 private:
  // A running export: its thread, the figures done of the total, and how it ended.
  struct ExportJob {
    std::thread thread;
    std::atomic<size_t> done{0};
    size_t total = 0, files = 0;
    std::atomic<bool> cancel{false}, finished{false};
    std::string dir, error;
  };
  std::unique_ptr<ExportJob> export_;
  void finish_export(bool wait);  // reports and forgets a finished export (waits for it with `wait`)
  void changed();  // method list edited: dirty, submit
  void load_recent();
  std::string source_dir_;
  std::chrono::steady_clock::time_point t0_;
};


// The UI scales View → UI scale offers between.
constexpr float kMinUiScale = 0.75f, kMaxUiScale = 2.5f;
// Sets the UI scale (clamped to the range above) and saves it with the recent files.
void set_ui_scale(App& app, float scale);

// With v.link, makes the panels' layers (and heads) one selection again after one of them moved
// since `before`: the one that moved is copied to the others (the first of overlay, calibration,
// heatmap when several did). Without v.link, nothing.
void link_views(Views& v, const Views& before);

// The figures shown in the Plots panel, in order: key and name.
struct PlotEntry {
  std::string key, name;
};
std::vector<PlotEntry> plot_entries(const App& app);

}  // namespace kvlens::gui
