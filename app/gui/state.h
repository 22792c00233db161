// The desktop app's state: plain structs, owned by the App (app/gui/app.h) and read by the
// panels. Nothing here runs the model; the worker's results arrive as a Snapshot.
#pragma once
#include <optional>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "app/lab/worker.h"
#include "app/figures/figures.h"
#include "app/lab/session.h"
#include "core/compress/method.h"

namespace kvlens::gui {

// One method instance as the researcher set it up.
struct MethodInstance {
  int id = 0;  // stable while the app runs
  Params params;
  std::string label;  // "" = its short spec
  bool enabled = true;
  std::string error;  // the last refused edit, shown under its widgets
};

enum class Overlay { None, Attention, FateKept, FateBits, FateMerged };

// Selections: what the panels show. Saved in the session's "views".
// Each panel keeps its own layer and head: the Image panel's overlay (layer, head), the
// Calibration panel's (calib_layer, calib_head) and the attention heatmap's (heatmap_layer).
// With `link` they are one selection: moving any moves the others (link_views).
struct Views {
  int method = -1;        // selected instance id (-1 = the first)
  int layer = 0;          // the overlay's layer
  int head = -1;          // the overlay's head; -1 = the mean of heads
  int calib_layer = 0;
  int calib_head = -1;    // -1 = all heads pooled
  int heatmap_layer = 0;
  bool link = false;
  int plot = 0;           // index into the Plots panel's list
  int hit_step = 0;       // CacheHitRate step index
  int heatmap_method = -1;  // attention heatmap: -1 = full cache, else an instance id
  int calib_method = -1;  // Calibration panel: instance id (-1 = the first calibrating one)
  Overlay overlay = Overlay::Attention;
  float overlay_opacity = 0.6f;
  bool patch_grid = true;
  int token = 0;          // generated token whose attention the Image panel shows
  int overlay_source = -1;  // attention of: -1 = full cache, else an instance id
  int multiples_source = -1;  // small multiples over the patches: -1 = full cache, else an instance id
  int multiples_token = 0;    // ... of this generated token
  std::string table_sort = "method";  // the comparison table's sort column (fig::comparison_table)
  bool table_descending = false;
};

// The setup the worker computes from. Paths are as the user gave them ("" = the embedded model
// or sample image).
// The run options a session saves (prompt, template, tokens, KV row storage, diagnostics),
// plus what the app keeps beside them.
struct Inputs : SessionRun {
  std::string model_dir, image_path;
  std::string backend = "auto";      // where the model runs: auto | cpu | cuda (not saved in sessions)
};

struct Message {
  bool error = false;
  std::string text;
  double time = 0;  // seconds since start
};

enum class DialogPurpose { None, OpenSession, SaveSession, OpenImage, OpenModel, ExportFigures, ExportReport };

// The file picker popup (a path field over a listing of one folder).
struct FileDialog {
  DialogPurpose purpose = DialogPurpose::None;
  bool want_open = false;  // open the popup on the next frame
  std::string dir, name, error;
};

struct ExportOptions {
  std::string dir = "figures";
  bool png = true, svg = true, pdf = true, csv = true;
  bool all = true;  // every figure of the report, or only those shown now
  std::string report_path = "report.json";
};

// Text fields being typed into (applied on Enter / Apply, not per keystroke).
struct Edits {
  std::string image_path, model_dir, prompt;
  int max_new_tokens = kDefaultMaxNewTokens;
  std::map<std::string, std::string> param_text;  // "id/name" → text of a String parameter
  std::string active_text;                        // the key of the field being typed into
  int add_method = 0;                             // index into methods() for "Add"
};

// Parameter-change history for Ctrl+Z / Ctrl+Y: snapshots of the method list.
struct History {
  std::vector<std::vector<MethodInstance>> undo, redo;
  bool editing = false;                   // a drag is under way
  bool sent = false;                      // a setup (with labels held) went to the worker during it
  std::vector<MethodInstance> before;     // the list when it began
};

// The figures built from the current report, rebuilt when a new report arrives.
struct FigureCache {
  uint64_t report_serial = 0;
  std::map<std::string, fig::Figure> by_key;
  // What is on screen this frame (for "export the figures shown"): report figures by key, and
  // the figures computed live (calibration).
  std::vector<std::string> shown_keys;
  std::vector<fig::Figure> shown_live;
};

// The Calibration panel's figures, recomputed when their inputs change (key).
struct CalibrationView {
  std::string key;
  fig::Figure histogram, transfer;
  bool has_transfer = false;
  std::vector<int64_t> calibrated;  // the calibrated counts shown (for scripted checks)
  double gamma = 0, delta = 0;
};

struct Timing {
  // Edit → updated caption and plots, per edit: when the edit was made (seconds), and the
  // latency once the result is shown.
  std::map<int, double> pending;  // instance id → edit time
  std::vector<double> latencies_ms;
  double last_latency_ms = -1;
  // Frames drawn while the worker computes and the controls are being moved (a drag), for the
  // frame rate under load: their count, their time, and the UI thread's time to build each
  // (NewFrame to Render, without the driver's rasterizing).
  int busy_frames = 0;
  double busy_seconds = 0;
  std::vector<double> build_ms;
  bool measuring = false;  // set by the driver while a drag runs
  int frames = 0;
  // The time to make one frame (the app's work, building it, rasterizing, presenting) — not the
  // time between frames: the app draws only when something changes. A moving average.
  double frame_ms = 0;
};

struct State {
  Inputs inputs;
  std::vector<MethodInstance> methods;
  int next_id = 1;
  int scroll_to_method = -1;  // an instance the user just added: the Methods panel brings it into view once
  std::vector<int> edit_order;  // instance ids, most recently edited first
  uint64_t setup_version = 0;   // the last setup handed to the worker

  std::shared_ptr<const Snapshot> results;  // the worker's newest snapshot
  Views views;
  std::map<std::string, fig::View> zoom;    // figure id → how it is looked at (zoom, y scale, hidden series)
  // The figure the Plots panel drew last (its id) and its y axis as drawn.
  std::string plot_figure;
  fig::Axis plot_y;

  std::string session_path, session_name, session_description;
  bool dirty = false;
  double last_autosave = 0;
  nlohmann::json saved_results;  // results summary of the session as it was opened
  std::string expect_model_hash;  // the opened session's model hash, checked once the model loads
  std::vector<std::string> recent_sessions, recent_images, recent_models;
  // The UI scale: fonts, widgets and figure text (View → UI scale; saved beside the recent files).
  float ui_scale = 1.0f;
  bool ui_scale_saved = false;  // a UI scale chosen earlier (View → UI scale) was loaded

  std::vector<Message> messages;
  FileDialog dialog;
  ExportOptions export_opt;
  Edits edits;
  History history;
  FigureCache figures;
  CalibrationView calibration;
  Timing timing;
  // Where the image and the figures were drawn in the last frame (x, y, width, height), for
  // scripted checks of screenshots; "model_facts" holds the width the Model panel's facts need and
  // "model_panel" the width it has.
  std::map<std::string, std::vector<float>> drawn;
  // What a field showed in the last frame where it differs from what it holds (a path field's
  // file name: "image_path", "model_dir").
  std::map<std::string, std::string> shown;
  // Texts the panels' widths cut in the last frame (each shows the whole on hover).
  std::vector<std::string> cut_texts;
  // The lines of the readout the last frame showed on hover (a patch's values), if any.
  std::vector<std::string> hover_readout;
  // Where a script points the mouse (pixels in the window), while it does.
  std::optional<std::pair<float, float>> script_pointer;
  bool quit = false;
  bool log_open = false;  // the message log in a window of its own
};

}  // namespace kvlens::gui
