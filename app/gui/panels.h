// The desktop app's panels, one function (and one file) each. A panel reads App::st and calls
// App's methods to change it; none runs the model.
#pragma once
#include <string>

#include <imgui.h>

#include "app/gui/app.h"
#include "app/gui/figure_imgui.h"

namespace kvlens::gui {

// What the panels share besides the state: GPU textures and the drop target of the window.
struct Ui {
  TextureCache textures;
  ImFont* mono = nullptr;
};

struct PanelRect {
  ImVec2 pos, size;
};

// Where each panel sits in a window of `size` below a menu bar of `top` pixels.
struct PanelLayout {
  PanelRect image, model, session, plots, captions, calibration, methods;
  ImVec2 status_pos, status_size;
};
PanelLayout layout_panels(ImVec2 size, float top);

// Begins a fixed panel window; call ImGui::End() after (also when it returns false).
bool begin_panel(const char* title, const PanelRect& r);

void menu_bar(App& app, Ui& ui);
void image_panel(App& app, Ui& ui, const PanelRect& r);
void model_panel(App& app, Ui& ui, const PanelRect& r);
void session_panel(App& app, Ui& ui, const PanelRect& r);
void methods_panel(App& app, Ui& ui, const PanelRect& r);
void calibration_panel(App& app, Ui& ui, const PanelRect& r);
void plots_panel(App& app, Ui& ui, const PanelRect& r);
void captions_panel(App& app, Ui& ui, const PanelRect& r);
void status_bar(App& app, ImVec2 pos, ImVec2 size);
// The message log, newest first, each with its time since start (the Session panel's tail and
// the log window).
void message_list(const std::vector<Message>& messages);
// The log in a window of its own, resizable, while st.log_open (the Session panel's "log…",
// a click on the status bar's message, or the script's show_log).
void log_window(App& app);
void file_dialog(App& app);
// Ctrl+O, Ctrl+S, Ctrl+E, Ctrl+Z, Ctrl+Y, Ctrl+N, Ctrl+Q.
void handle_shortcuts(App& app);

// Small shared widgets.
void help_marker(const char* text);
// A path field: the file name (the whole path on hover) until clicked, then the path to edit.
// True when Enter was pressed in it. `shown` gets the text the field shows.
bool path_field(const char* id, const char* hint, std::string& path, std::string& shown);
// A line of text (greyed with `disabled`, else in `colour` when given); where the panel's width
// cuts it, hovering shows the whole line, and it is listed in st.cut_texts for the frame.
void fitted_text(App& app, const std::string& text, bool disabled = false, const ImVec4* colour = nullptr);
// A selectable row whose label its width cuts shows the whole label on hover (a cut text).
bool fitted_selectable(App& app, const std::string& text, bool selected);
// After an item that shows `text` in `room` pixels: where it is wider, it is listed as cut and
// shown whole on hover.
void cut_if_wider(App& app, const std::string& text, float room);
// Right after a combo (or another framed item) showing `preview`: where its width cuts the
// preview, hovering shows the whole of it (listed as cut too).
void preview_tooltip(App& app, const std::string& preview);
// The same for a combo with help: hovering shows the help, and the preview above it where cut.
void help_tooltip(App& app, const std::string& preview, const std::string& help);
// ImGui's SliderInt / SliderFloat showing the value by `format`; where the slider's width cuts
// what it shows, hovering shows the whole of it (listed as cut too).
bool slider_int(App& app, const char* id, int& v, int lo, int hi, const char* format);
bool slider_float(App& app, const char* id, float& v, float lo, float hi, const char* format);
// The width of a framed item (a slider, an input) that shows `text` whole.
float framed_width(const std::string& text);
// A method parameter's name as the Methods panel shows it (as the papers write it: tau1 → τ1).
std::string shown_name(const std::string& name);
// What a panel without results shows: `computing` while the worker runs, why nothing can be
// computed (in red) when the setup is blocked, else `idle`.
void no_results(const App& app, const char* computing, const char* idle);
void open_dialog(App& app, DialogPurpose purpose, const std::string& start);
// A combo over the method instances; `none` (may be null) adds a first entry for id -1.
bool instance_combo(const char* label, App& app, int& id, const char* none, bool only_enabled);
// A slider over the generated tokens of `source` (-1 = the full cache), each shown as its text
// ("<prefix> 3: '_a'"); `token` is clamped to them. Takes the rest of the line.
void token_slider(const char* id, App& app, int source, int& token, const char* prefix);

}  // namespace kvlens::gui
