// Session / export panel: the session's name and description; new, open, save, save as,
// recent; exporting figures (all of the report, or those on screen) as PNG / SVG / PDF with
// their data as CSV, and the report JSON; whether the reopened session reproduces its saved
// results; and the message log (every refused input is listed here).
#include <imgui.h>
#include <imgui_stdlib.h>  // after imgui.h

#include "app/gui/panels.h"

namespace kvlens::gui {

namespace {

// Compares the saved results summary with the report now: same captions and MSE.
std::string saved_vs_now(const App& app) {
  const nlohmann::json& saved = app.st.saved_results;
  if (!saved.is_object() || !saved.contains("methods") || !app.st.results) return "";
  if (const std::string why = app.blocked(); !why.empty()) return "saved results: not recomputed (" + why + ")";
  if (!app.st.results->report) return "";
  if (!app.up_to_date()) return "saved results: recomputing…";
  const nlohmann::json& rep = *app.st.results->report;
  const auto& a = saved["methods"];
  const auto& b = rep["methods"];
  if (!a.is_array() || a.size() != b.size()) return "saved results: different method count";
  int same = 0;
  for (size_t i = 0; i < a.size(); ++i)
    same += a[i].value("caption", std::string()) == b[i]["caption"].get<std::string>() ? 1 : 0;
  return "saved results: " + std::to_string(same) + " of " + std::to_string(a.size()) + " captions reproduced";
}

}  // namespace

void session_panel(App& app, Ui&, const PanelRect& rect) {
  if (!begin_panel("Session · export", rect)) {
    ImGui::End();
    return;
  }
  State& st = app.st;
  ImGui::SetNextItemWidth(-90);
  if (ImGui::InputTextWithHint("name", "session name", &st.session_name)) st.dirty = true;
  if (ImGui::Button("New")) app.new_session();
  ImGui::SameLine();
  if (ImGui::Button("Open…")) open_dialog(app, DialogPurpose::OpenSession, st.session_path);
  ImGui::SameLine();
  if (ImGui::Button("Save")) {
    if (st.session_path.empty()) open_dialog(app, DialogPurpose::SaveSession, "session.json");
    else app.save_session(st.session_path);
  }
  ImGui::SameLine();
  if (ImGui::Button("Save as…")) open_dialog(app, DialogPurpose::SaveSession, st.session_path);
  ImGui::SameLine();
  if (ImGui::BeginCombo("##recentsess", "recent", ImGuiComboFlags_NoPreview)) {
    for (const std::string& p : std::vector<std::string>(st.recent_sessions))
      if (ImGui::Selectable(p.c_str())) app.open_session(p);
    ImGui::EndCombo();
  }
  const std::string cmp = saved_vs_now(app);
  if (!cmp.empty()) ImGui::TextDisabled("%s", cmp.c_str());
  ImGui::Separator();
  ImGui::Checkbox("PNG", &st.export_opt.png);
  ImGui::SameLine();
  ImGui::Checkbox("SVG", &st.export_opt.svg);
  ImGui::SameLine();
  ImGui::Checkbox("PDF", &st.export_opt.pdf);
  ImGui::SameLine();
  ImGui::Checkbox("CSV", &st.export_opt.csv);
  ImGui::SetNextItemWidth(-1);
  ImGui::InputTextWithHint("##exportdir", "folder for figures", &st.export_opt.dir);
  if (app.exporting()) {  // on its own thread: the progress and a way out
    const auto [done, total] = app.export_progress();
    const std::string label = std::to_string(done) + " of " + std::to_string(total) + " figures";
    ImGui::ProgressBar(total ? static_cast<float>(done) / total : 0.0f, ImVec2(-90, 0), label.c_str());
    const ImVec2 bar = ImGui::GetItemRectMin(), size = ImGui::GetItemRectSize();
    st.drawn["export_progress"] = {bar.x, bar.y, size.x, size.y};
    ImGui::SameLine();
    if (ImGui::Button("Cancel##export")) app.cancel_export();
  } else {
    if (ImGui::Button("Export all figures")) app.export_figures(st.export_opt.dir, app.report_figures_all());
    ImGui::SameLine();
    if (ImGui::Button("Export shown")) app.export_figures(st.export_opt.dir, app.shown_figures());
  }
  ImGui::SameLine();
  if (ImGui::Button("Report JSON…")) open_dialog(app, DialogPurpose::ExportReport, st.export_opt.report_path);
  ImGui::Separator();
  if (ImGui::SmallButton(("log (" + std::to_string(st.messages.size()) + ")…").c_str())) st.log_open = true;
  if (ImGui::IsItemHovered()) ImGui::SetTooltip("every message in a window of its own");
  ImGui::BeginChild("##log", ImVec2(0, 0), false);
  message_list(st.messages);
  ImGui::EndChild();
  ImGui::End();
}

void message_list(const std::vector<Message>& messages) {
  for (auto it = messages.rbegin(); it != messages.rend(); ++it) {
    ImGui::PushTextWrapPos(0);
    if (it->error) ImGui::TextColored(ImVec4(0.72f, 0.1f, 0.1f, 1), "%6.1f s  %s", it->time, it->text.c_str());
    else ImGui::TextDisabled("%6.1f s  %s", it->time, it->text.c_str());
    ImGui::PopTextWrapPos();
  }
}

void log_window(App& app) {
  State& st = app.st;
  if (!st.log_open) return;
  const ImGuiViewport* vp = ImGui::GetMainViewport();
  ImGui::SetNextWindowSize(ImVec2(std::min(760.0f, vp->Size.x * 0.8f), std::min(420.0f, vp->Size.y * 0.6f)),
                           ImGuiCond_Appearing);
  ImGui::SetNextWindowPos(ImVec2(vp->Pos.x + vp->Size.x * 0.5f, vp->Pos.y + vp->Size.y * 0.5f), ImGuiCond_Appearing,
                          ImVec2(0.5f, 0.5f));
  if (ImGui::Begin("Log (newest first)", &st.log_open, ImGuiWindowFlags_NoSavedSettings | ImGuiWindowFlags_NoCollapse)) {
    if (ImGui::SmallButton("copy all")) {
      std::string all;
      for (const Message& m : st.messages) all += (m.error ? "error: " : "") + m.text + "\n";
      ImGui::SetClipboardText(all.c_str());
    }
    ImGui::Separator();
    const ImVec2 at = ImGui::GetCursorScreenPos(), avail = ImGui::GetContentRegionAvail();
    st.drawn["log"] = {at.x, at.y, avail.x, avail.y};
    ImGui::BeginChild("##logall", ImVec2(0, 0), false);
    message_list(st.messages);
    ImGui::EndChild();
  }
  ImGui::End();
}

}  // namespace kvlens::gui
