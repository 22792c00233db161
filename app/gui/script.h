// Headless runs: `kvlens-gui --script steps.json` drives the app without a person. A script is
// {"steps": [{"do": "...", ...}, ...]}; every step is checked when the file is read (an unknown
// step or a wrong argument is refused naming the step), then the steps run between frames:
//
//   open_image {path}            open_model {path}           open_session {path}
//   save_session {path}          new_session                 export_report {path}
//   add_method {spec, label?}    remove_method {method}      set_enabled {method, enabled}
//   set_param {method, name, value}                          undo / redo
//   drag_param {method, name, from, to, frames}   a slider drag: one value per frame, then release
//   select {plot?, layer?, head?, method?, calib_method?, calib_layer?, calib_head?, heatmap_method?,
//           heatmap_layer?, link_views?, overlay?, token?, table_sort?, ...}
//                                every field or none: a refused field fails the script; layer and
//                                head are the overlay's (each panel keeps its own unless linked)
//   plot_view {hide?, show?, y_scale?, y_range?}   the Plots panel's figure as its legend clicks,
//                                right-click menu ("as built" / "linear" / "log") and Shift+wheel
//                                set it: series labels to hide or show, the y scale, [low, high]
//   ui_scale {value}             View → UI scale (0.75 – 2.5; saved like the menu's)
//   show_log {open?}             the message log in its own window (open: true by default)
//   wait_results {timeout_s?}    every enabled method computed for the current setup, shown (fails
//                                at once when the model or the image cannot be loaded)
//   frames {n}                   render n frames
//   hover {over, x, y}           the mouse over a drawn item (dump_state's "drawn" names; "" = let go)
//                                at fractions x, y of its width and height, then 3 frames;
//                                dump_state's "hover_readout" holds what its readout shows
//   screenshot {path}            the window as PNG, after the frame settles
//   export_figures {dir, formats?, csv?, all?, wait?}
//                                on the export's own thread; the next step once it has ended,
//                                or at once with wait false (its progress bar then drawn)
//   cancel_export                stops a running export between figures, then waits for it
//   dump_state {path}            the app's state and results as JSON (for checks): the inputs
//                                analysed, the "fields" the input boxes hold and "fields_shown"
//                                what the path fields show, busy, blocked, what "Add" offers,
//                                the parameters' shown names, where things were "drawn", and
//                                the "export" running ({running, done, total})
//   expect_message {contains}    a message since the last check must contain the text (else exit 1)
//   timing {label}               prints "kvlens-gui timing: ..." (edit → result latency, frame rates)
//   quit
//
// "method" is an index into the method list or a method's label.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "app/gui/app.h"

namespace kvlens::gui {

class Script {
 public:
  // Reads and checks a script; throws InputError naming the file and step.
  static Script load(const std::string& path);
  // A script of one screenshot once results are in (for --screenshot without --script).
  static Script screenshot_only(const std::string& path);

  // Called once per frame before the UI is built: runs steps until one has to wait for frames.
  void before_frame(App& app);
  // The screenshot to take after this frame renders ("" = none).
  std::string screenshot_path() const { return shot_ready_ ? shot_path_ : std::string(); }
  void screenshot_taken();
  bool done() const { return pc_ >= steps_.size() && !waiting(); }
  // Waiting for the worker with nothing to draw in between: the app may sleep until it reports.
  bool idle() const { return waiting_results_ && drag_.is_null() && wait_frames_ == 0 && shot_path_.empty(); }
  bool failed() const { return failed_; }
  const std::string& failure() const { return failure_; }

 private:
  bool waiting() const { return wait_frames_ > 0 || !shot_path_.empty(); }
  void fail(const std::string& what);
  int method_id(App& app, const nlohmann::json& ref);
  void run(App& app, const nlohmann::json& step);

  std::string file_;
  std::vector<nlohmann::json> steps_;
  size_t pc_ = 0;
  int wait_frames_ = 0;
  bool waiting_results_ = false;
  double wait_deadline_ = 0;
  int settled_frames_ = 0;
  std::string shot_path_;
  bool shot_ready_ = false;
  // drag_param in progress
  nlohmann::json drag_;
  int drag_frame_ = 0;
  std::vector<std::string> drag_shown_;  // the dragged instance's distinct names during the drag
  size_t messages_seen_ = 0;
  bool failed_ = false;
  std::string failure_;
};

}  // namespace kvlens::gui
