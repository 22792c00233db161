// The window frame around the panels: layout, menu bar, keyboard shortcuts, status bar, and
// small widgets the panels share.
#include <GLFW/glfw3.h>
#include <imgui.h>
#include <imgui_stdlib.h>  // after imgui.h

#include <algorithm>
#include <cstdio>

#include "app/gui/panels.h"

namespace kvlens::gui {

PanelLayout layout_panels(ImVec2 size, float top) {
  PanelLayout l;
  const float k = figure_scale();  // the UI scale
  const float status = ImGui::GetFrameHeight() + 8 * k;
  const float W = size.x, H = size.y - top - status;
  const float c1 = std::max(340.0f * k, W * 0.24f), c2 = std::max(420.0f * k, W * 0.42f),
              c3 = std::max(300.0f * k, W - c1 - c2);
  const float x2 = c1, x3 = c1 + c2;
  // Model and Session hold about eleven and ten lines of widgets; the image takes the rest.
  const float line = ImGui::GetFrameHeightWithSpacing();
  float model_h = std::min(H * 0.3f, line * 9.4f), session_h = std::min(H * 0.28f, line * 8.6f);
  // The image keeps at least half the column; on a short window Model and Session give way (they
  // scroll).
  if (H - model_h - session_h < H * 0.5f) {
    const float shrink = H * 0.5f / (model_h + session_h);
    model_h *= shrink;
    session_h *= shrink;
  }
  const float image_h = H - model_h - session_h;
  l.image = {{0, top}, {c1, image_h}};
  l.model = {{0, top + image_h}, {c1, model_h}};
  l.session = {{0, top + image_h + model_h}, {c1, session_h}};
  // On a short window Captions, whose rows wrap to several lines, gets half the column.
  const float plots_h = H * (H < 900 * k ? 0.5f : 0.58f);
  l.plots = {{x2, top}, {c2, plots_h}};
  l.captions = {{x2, top + plots_h}, {c2, H - plots_h}};
  const float calib_h = H * 0.58f;
  l.calibration = {{x3, top}, {c3, calib_h}};
  l.methods = {{x3, top + calib_h}, {c3, H - calib_h}};
  l.status_pos = ImVec2(0, top + H);
  l.status_size = ImVec2(W, status);
  return l;
}

bool begin_panel(const char* title, const PanelRect& r) {
  ImGui::SetNextWindowPos(r.pos, ImGuiCond_Always);
  ImGui::SetNextWindowSize(r.size, ImGuiCond_Always);
  return ImGui::Begin(title, nullptr,
                      ImGuiWindowFlags_NoMove | ImGuiWindowFlags_NoResize | ImGuiWindowFlags_NoCollapse |
                          ImGuiWindowFlags_NoSavedSettings | ImGuiWindowFlags_NoBringToFrontOnFocus);
}

bool path_field(const char* id, const char* hint, std::string& path, std::string& shown) {
  ImGuiStorage* store = ImGui::GetStateStorage();
  const ImGuiID key = ImGui::GetID(id);
  int mode = store->GetInt(key, 0);  // 0: the file name shown, 1: editing asked, 2: editing
  if (mode == 0 && !path.empty()) {
    const size_t slash = path.find_last_of('/');
    const std::string name = slash == std::string::npos || slash + 1 == path.size() ? path : path.substr(slash + 1);
    shown = name;
    ImGui::PushStyleVar(ImGuiStyleVar_ButtonTextAlign, ImVec2(0.0f, 0.5f));
    ImGui::PushStyleColor(ImGuiCol_Button, ImGui::GetStyleColorVec4(ImGuiCol_FrameBg));
    ImGui::PushStyleColor(ImGuiCol_ButtonHovered, ImGui::GetStyleColorVec4(ImGuiCol_FrameBgHovered));
    const bool clicked = ImGui::Button((name + "###" + id).c_str(), ImVec2(ImGui::CalcItemWidth(), 0));
    ImGui::PopStyleColor(2);
    ImGui::PopStyleVar();
    if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s\n(click to edit the path)", path.c_str());
    if (clicked) store->SetInt(key, 1);
    return false;
  }
  if (mode == 1) {
    ImGui::SetKeyboardFocusHere();
    store->SetInt(key, 2);
  }
  const bool enter = ImGui::InputTextWithHint(id, hint, &path, ImGuiInputTextFlags_EnterReturnsTrue);
  shown = path;
  if (ImGui::IsItemHovered() && !path.empty()) ImGui::SetTooltip("%s", path.c_str());
  if (mode == 2 && (enter || ImGui::IsItemDeactivated())) store->SetInt(key, 0);
  return enter;
}

void help_marker(const char* text) {
  ImGui::SameLine();
  ImGui::TextDisabled("(?)");
  if (ImGui::IsItemHovered()) {
    ImGui::BeginTooltip();
    ImGui::PushTextWrapPos(ImGui::GetFontSize() * 32.0f);
    ImGui::TextUnformatted(text);
    ImGui::PopTextWrapPos();
    ImGui::EndTooltip();
  }
}

void token_slider(const char* id, App& app, int source, int& token, const char* prefix) {
  const Snapshot* s = app.st.results.get();
  const std::vector<std::string>* pieces = s && s->base ? &s->base->pieces : nullptr;
  if (source >= 0)
    if (const RunResult* r = app.any_result(source)) pieces = &r->pieces;
  const int n = pieces ? std::max(1, static_cast<int>(pieces->size()) - 1) : 1;
  token = std::clamp(token, 0, n - 1);
  const std::string tok = pieces && token < static_cast<int>(pieces->size()) ? (*pieces)[token] : "";
  ImGui::SetNextItemWidth(-1);
  slider_int(app, id, token, 0, n - 1, (std::string(prefix) + " %d: '" + tok + "'").c_str());
}

namespace {

// The right edge of what the current window shows.
float visible_right() { return ImGui::GetWindowPos().x + ImGui::GetWindowContentRegionMax().x; }

// The last item cut `text`: listed for this frame, and shown whole on hover.
void note_cut(App& app, const std::string& text) {
  app.st.cut_texts.push_back(text);
  if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", text.c_str());
}

}  // namespace

void fitted_text(App& app, const std::string& text, bool disabled, const ImVec4* colour) {
  // (the room to the right of the cursor: the window's, or a table cell's)
  const float right = std::min(visible_right(), ImGui::GetCursorScreenPos().x + ImGui::GetContentRegionAvail().x);
  if (colour) ImGui::PushStyleColor(ImGuiCol_Text, *colour);
  if (disabled)
    ImGui::TextDisabled("%s", text.c_str());
  else
    ImGui::TextUnformatted(text.c_str());
  if (colour) ImGui::PopStyleColor();
  if (ImGui::GetItemRectMax().x > right + 0.5f) note_cut(app, text);
}

void cut_if_wider(App& app, const std::string& text, float room) {
  if (ImGui::CalcTextSize(text.c_str()).x > room + 0.5f) note_cut(app, text);
}

bool fitted_selectable(App& app, const std::string& text, bool selected) {
  const float room = ImGui::GetContentRegionAvail().x;
  const bool clicked = ImGui::Selectable(text.c_str(), selected);
  cut_if_wider(app, text, room);
  return clicked;
}

namespace {

// The last framed item shows `text` in its width less `reserved` (a combo's arrow): where that
// cuts it, it is listed and shown whole on hover, above `help` (shown on hover either way).
void framed_tooltip(App& app, const std::string& text, float reserved, const std::string& help = "") {
  const float room = ImGui::GetItemRectSize().x - reserved - 2 * ImGui::GetStyle().FramePadding.x;
  const bool cut = !text.empty() && (ImGui::CalcTextSize(text.c_str()).x > room + 0.5f ||
                                     ImGui::GetItemRectMax().x > visible_right() + 0.5f);
  if (cut) app.st.cut_texts.push_back(text);
  if (!ImGui::IsItemHovered() || (help.empty() && !cut)) return;
  ImGui::BeginTooltip();
  ImGui::PushTextWrapPos(ImGui::GetFontSize() * 34.0f);
  if (cut) ImGui::TextUnformatted(text.c_str());
  if (!help.empty()) ImGui::TextDisabled("%s", help.c_str());
  ImGui::PopTextWrapPos();
  ImGui::EndTooltip();
}

}  // namespace

void preview_tooltip(App& app, const std::string& preview) { framed_tooltip(app, preview, ImGui::GetFrameHeight()); }

void help_tooltip(App& app, const std::string& preview, const std::string& help) {
  framed_tooltip(app, preview, ImGui::GetFrameHeight(), help);
}

namespace {

// ImGui's slider of an int or a float (`type`), then its shown value whole on hover where cut.
template <class T>
bool slider(App& app, const char* id, ImGuiDataType type, T& v, T lo, T hi, const char* format) {
  const bool changed = ImGui::SliderScalar(id, type, &v, &lo, &hi, format);
  char shown[256];
  std::snprintf(shown, sizeof shown, format, v);
  framed_tooltip(app, shown, 0.0f);
  return changed;
}

}  // namespace

bool slider_int(App& app, const char* id, int& v, int lo, int hi, const char* format) {
  return slider(app, id, ImGuiDataType_S32, v, lo, hi, format);
}

bool slider_float(App& app, const char* id, float& v, float lo, float hi, const char* format) {
  return slider(app, id, ImGuiDataType_Float, v, lo, hi, format);
}

float framed_width(const std::string& text) {
  return ImGui::CalcTextSize(text.c_str()).x + 2 * ImGui::GetStyle().FramePadding.x + 1.0f;
}

bool instance_combo(const char* label, App& app, int& id, const char* none, bool only_enabled) {
  std::string preview = none ? none : "";
  if (const MethodInstance* m = app.find(id)) preview = app.display_name(*m);
  bool changed = false;
  const bool open = ImGui::BeginCombo(label, preview.c_str());
  preview_tooltip(app, preview);
  if (open) {
    if (none && ImGui::Selectable(none, id == -1)) {
      id = -1;
      changed = true;
    }
    for (const MethodInstance& m : app.st.methods) {
      if (only_enabled && !m.enabled) continue;
      ImGui::PushID(m.id);
      if (ImGui::Selectable(app.display_name(m).c_str(), m.id == id)) {
        id = m.id;
        changed = true;
      }
      ImGui::PopID();
    }
    ImGui::EndCombo();
  }
  return changed;
}

void open_dialog(App& app, DialogPurpose purpose, const std::string& start) {
  FileDialog& d = app.st.dialog;
  d.purpose = purpose;
  d.want_open = true;
  d.error.clear();
  const size_t slash = start.rfind('/');
  if (start.empty()) {
    d.dir = ".";
    d.name.clear();
  } else if (slash == std::string::npos) {
    d.dir = ".";
    d.name = start;
  } else {
    d.dir = slash == 0 ? "/" : start.substr(0, slash);
    d.name = start.substr(slash + 1);
  }
}

namespace {

void save(App& app) {
  if (app.st.session_path.empty()) open_dialog(app, DialogPurpose::SaveSession, "session.json");
  else app.save_session(app.st.session_path);
}

}  // namespace

void menu_bar(App& app, Ui& ui) {
  if (!ImGui::BeginMainMenuBar()) return;
  if (ImGui::BeginMenu("File")) {
    if (ImGui::MenuItem("New session", "Ctrl+N")) app.new_session();
    if (ImGui::MenuItem("Open session…", "Ctrl+O")) open_dialog(app, DialogPurpose::OpenSession, app.st.session_path);
    if (ImGui::BeginMenu("Recent sessions", !app.st.recent_sessions.empty())) {
      for (const std::string& p : std::vector<std::string>(app.st.recent_sessions))
        if (ImGui::MenuItem(p.c_str())) app.open_session(p);
      ImGui::EndMenu();
    }
    if (ImGui::MenuItem("Save session", "Ctrl+S")) save(app);
    if (ImGui::MenuItem("Save session as…")) open_dialog(app, DialogPurpose::SaveSession, app.st.session_path);
    ImGui::Separator();
    if (ImGui::MenuItem("Open image…")) open_dialog(app, DialogPurpose::OpenImage, app.image_path());
    if (ImGui::MenuItem("Open model folder…")) open_dialog(app, DialogPurpose::OpenModel, app.model_dir() + "/");
    ImGui::Separator();
    if (ImGui::MenuItem("Export figures…", "Ctrl+E")) open_dialog(app, DialogPurpose::ExportFigures, app.st.export_opt.dir);
    if (ImGui::MenuItem("Export report JSON…")) open_dialog(app, DialogPurpose::ExportReport, app.st.export_opt.report_path);
    ImGui::Separator();
    if (ImGui::MenuItem("Quit", "Ctrl+Q")) app.st.quit = true;
    ImGui::EndMenu();
  }
  if (ImGui::BeginMenu("Edit")) {
    if (ImGui::MenuItem("Undo parameter change", "Ctrl+Z", false, !app.st.history.undo.empty())) app.undo();
    if (ImGui::MenuItem("Redo parameter change", "Ctrl+Y", false, !app.st.history.redo.empty())) app.redo();
    ImGui::EndMenu();
  }
  if (ImGui::BeginMenu("View")) {
    const Views before = app.st.views;
    ImGui::MenuItem("Link layer and head across panels", nullptr, &app.st.views.link);
    if (ImGui::IsItemHovered())
      ImGui::SetTooltip("on: the overlay, the Calibration panel and the heatmap show one layer (and head);\n"
                        "off: each panel keeps its own");
    link_views(app.st.views, before);
    ImGui::Separator();
    if (ImGui::BeginMenu("UI scale")) {
      for (float s : {0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f, 2.5f}) {
        const std::string name = std::to_string(static_cast<int>(std::lround(s * 100))) + " %";
        if (ImGui::MenuItem(name.c_str(), nullptr, std::abs(app.st.ui_scale - s) < 1e-3f)) set_ui_scale(app, s);
      }
      ImGui::EndMenu();
    }
    ImGui::EndMenu();
  }
  const std::string title = (app.st.session_path.empty() ? std::string("untitled session") : app.st.session_path) +
                            (app.st.dirty ? " •" : "");
  ImGui::SameLine(ImGui::GetWindowWidth() - ImGui::CalcTextSize(title.c_str()).x - 16);
  ImGui::TextDisabled("%s", title.c_str());
  ImGui::EndMainMenuBar();
}

void handle_shortcuts(App& app) {
  const ImGuiIO& io = ImGui::GetIO();
  if (!io.KeyCtrl) return;
  // Text fields keep Ctrl+Z / Ctrl+Y for their own editing.
  const bool typing = io.WantTextInput;
  if (ImGui::IsKeyPressed(GLFW_KEY_O, false)) open_dialog(app, DialogPurpose::OpenSession, app.st.session_path);
  if (ImGui::IsKeyPressed(GLFW_KEY_S, false)) save(app);
  if (ImGui::IsKeyPressed(GLFW_KEY_E, false)) open_dialog(app, DialogPurpose::ExportFigures, app.st.export_opt.dir);
  if (ImGui::IsKeyPressed(GLFW_KEY_N, false)) app.new_session();
  if (ImGui::IsKeyPressed(GLFW_KEY_Q, false)) app.st.quit = true;
  if (!typing && ImGui::IsKeyPressed(GLFW_KEY_Z, true)) app.undo();
  if (!typing && ImGui::IsKeyPressed(GLFW_KEY_Y, true)) app.redo();
}

void no_results(const App& app, const char* computing, const char* idle) {
  const std::string why = app.blocked();
  if (app.busy()) ImGui::TextDisabled("%s", computing);
  else if (!why.empty()) ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "no results: %s", why.c_str());
  else ImGui::TextDisabled("%s", idle);
}

void status_bar(App& app, ImVec2 pos, ImVec2 size) {
  ImGui::SetNextWindowPos(pos);
  ImGui::SetNextWindowSize(size);
  ImGui::PushStyleVar(ImGuiStyleVar_WindowPadding, ImVec2(8 * figure_scale(), 4 * figure_scale()));
  ImGui::Begin("##status", nullptr,
               ImGuiWindowFlags_NoDecoration | ImGuiWindowFlags_NoMove | ImGuiWindowFlags_NoSavedSettings |
                   ImGuiWindowFlags_NoBringToFrontOnFocus);
  const Snapshot* s = app.st.results.get();
  const Progress p = app.worker.progress();
  if (app.busy()) {
    const std::string stage = s && !s->stage.empty() ? s->stage : "starting";
    ImGui::Text("computing: %s", stage.c_str());
    ImGui::SameLine();
    const float frac = p.tokens_total > 0 ? static_cast<float>(p.tokens_done) / p.tokens_total : 0.0f;
    ImGui::ProgressBar(frac, ImVec2(160 * figure_scale(), 0), (std::to_string(p.tokens_done) + "/" + std::to_string(p.tokens_total) + " tokens").c_str());
  } else if (const std::string why = app.blocked(); !why.empty()) {
    ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "not ready");
    if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", why.c_str());
  } else {
    ImGui::TextUnformatted("ready");
  }
  const float k = figure_scale();  // the UI scale
  ImGui::SameLine(260 * k);
  if (app.st.timing.last_latency_ms >= 0) ImGui::Text("edit → result %.0f ms", app.st.timing.last_latency_ms);
  ImGui::SameLine(440 * k);
  // What a frame takes to make, not how often one is made (the app sleeps while nothing changes).
  ImGui::Text("frame %.0f ms", app.st.timing.frame_ms);
  if (ImGui::IsItemHovered())
    ImGui::SetTooltip("time to make one frame (%.0f frames/s at most); the app redraws only when something changes",
                      app.st.timing.frame_ms > 0 ? 1000.0 / app.st.timing.frame_ms : 0.0);
  if (!app.st.messages.empty()) {
    const Message& m = app.st.messages.back();
    ImGui::SameLine(560 * k);
    ImGui::TextColored(m.error ? ImVec4(0.75f, 0.1f, 0.1f, 1) : ImVec4(0.2f, 0.35f, 0.2f, 1), "%s", m.text.c_str());
    if (ImGui::IsItemHovered()) ImGui::SetTooltip("click: every message");
    if (ImGui::IsItemClicked()) app.st.log_open = true;
  }
  ImGui::End();
  ImGui::PopStyleVar();
}

}  // namespace kvlens::gui
