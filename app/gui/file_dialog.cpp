// The file picker: a path field over the listing of one folder, for opening and saving sessions,
// opening images and model folders, and choosing where exports go.
#include <algorithm>
#include <filesystem>

#include "app/gui/panels.h"
#include <imgui.h>
#include <imgui_stdlib.h>  // after imgui.h

namespace kvlens::gui {

namespace fs = std::filesystem;

namespace {

const char* title_of(DialogPurpose p) {
  switch (p) {
    case DialogPurpose::OpenSession: return "Open session";
    case DialogPurpose::SaveSession: return "Save session as";
    case DialogPurpose::OpenImage: return "Open image";
    case DialogPurpose::OpenModel: return "Open model folder";
    case DialogPurpose::ExportFigures: return "Export figures to folder";
    case DialogPurpose::ExportReport: return "Export report JSON";
    case DialogPurpose::None: break;
  }
  return "File";
}

bool wants_folder(DialogPurpose p) { return p == DialogPurpose::OpenModel || p == DialogPurpose::ExportFigures; }

bool shown(DialogPurpose p, const fs::directory_entry& e) {
  std::error_code ec;
  if (e.is_directory(ec)) return true;
  if (wants_folder(p)) return false;
  const std::string ext = e.path().extension().string();
  if (p == DialogPurpose::OpenImage)
    return ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp" || ext == ".gif" || ext == ".ppm" || ext == ".pgm";
  return ext == ".json";
}

std::string join(const std::string& dir, const std::string& name) {
  if (name.empty()) return dir;
  if (!name.empty() && name[0] == '/') return name;
  return dir == "/" ? "/" + name : dir + "/" + name;
}

// Runs what the dialog was opened for; true when done (the dialog closes).
bool finish(App& app, DialogPurpose p, const std::string& path) {
  switch (p) {
    case DialogPurpose::OpenSession: return app.open_session(path);
    case DialogPurpose::SaveSession: return app.save_session(path);
    case DialogPurpose::OpenImage: {
      const size_t before = app.st.messages.size();
      app.open_image(path);
      return app.st.messages.size() == before;
    }
    case DialogPurpose::OpenModel: {
      const size_t before = app.st.messages.size();
      app.open_model(path);
      return app.st.messages.size() == before;
    }
    case DialogPurpose::ExportFigures:
      app.st.export_opt.dir = path;
      return app.export_figures(path, app.st.export_opt.all ? app.report_figures_all() : app.shown_figures());
    case DialogPurpose::ExportReport:
      app.st.export_opt.report_path = path;
      return app.export_report(path);
    case DialogPurpose::None: break;
  }
  return true;
}

}  // namespace

void file_dialog(App& app) {
  FileDialog& d = app.st.dialog;
  if (d.want_open) {
    ImGui::OpenPopup("##file_dialog");
    d.want_open = false;
  }
  ImGui::SetNextWindowSize(ImVec2(620 * figure_scale(), 460 * figure_scale()), ImGuiCond_Appearing);
  if (!ImGui::BeginPopupModal("##file_dialog", nullptr, ImGuiWindowFlags_NoSavedSettings)) return;
  ImGui::TextUnformatted(title_of(d.purpose));
  ImGui::Separator();
  ImGui::Text("Folder: %s", d.dir.c_str());
  if (d.purpose == DialogPurpose::ExportFigures) {
    ImGui::Checkbox("PNG", &app.st.export_opt.png);
    ImGui::SameLine();
    ImGui::Checkbox("SVG", &app.st.export_opt.svg);
    ImGui::SameLine();
    ImGui::Checkbox("PDF", &app.st.export_opt.pdf);
    ImGui::SameLine();
    ImGui::Checkbox("CSV data", &app.st.export_opt.csv);
    ImGui::SameLine();
    ImGui::Checkbox("every figure (off: those on screen)", &app.st.export_opt.all);
  }
  ImGui::BeginChild("##listing", ImVec2(0, -ImGui::GetFrameHeightWithSpacing() * 2.6f), true);
  std::error_code ec;
  if (ImGui::Selectable("..")) {
    d.dir = fs::absolute(fs::path(d.dir), ec).parent_path().string();
    if (d.dir.empty()) d.dir = "/";
  }
  std::vector<fs::directory_entry> entries;
  for (fs::directory_iterator it(d.dir, ec), end; !ec && it != end; it.increment(ec))
    if (shown(d.purpose, *it) && it->path().filename().string()[0] != '.') entries.push_back(*it);
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    std::error_code e1, e2;
    const bool da = a.is_directory(e1), db = b.is_directory(e2);
    return da != db ? da : a.path().filename() < b.path().filename();
  });
  for (const fs::directory_entry& e : entries) {
    std::error_code e2;
    const bool dir = e.is_directory(e2);
    const std::string name = e.path().filename().string();
    if (ImGui::Selectable(((dir ? "[dir] " : "") + name).c_str(), d.name == name, ImGuiSelectableFlags_AllowDoubleClick)) {
      if (dir && ImGui::IsMouseDoubleClicked(ImGuiMouseButton_Left)) {
        d.dir = join(d.dir, name);
        d.name.clear();
      } else {
        d.name = name;
      }
    }
  }
  if (ec) ImGui::TextDisabled("cannot list %s (%s)", d.dir.c_str(), ec.message().c_str());
  ImGui::EndChild();
  bool go = ImGui::InputText("Name", &d.name, ImGuiInputTextFlags_EnterReturnsTrue);
  ImGui::SameLine();
  go = ImGui::Button(wants_folder(d.purpose) && d.name.empty() ? "Use this folder" : "OK") || go;
  ImGui::SameLine();
  if (ImGui::Button("Cancel") || ImGui::IsKeyPressed(ImGui::GetKeyIndex(ImGuiKey_Escape))) {
    d.purpose = DialogPurpose::None;
    ImGui::CloseCurrentPopup();
  }
  if (go && d.purpose != DialogPurpose::None) {
    const std::string path = join(d.dir, d.name);
    const size_t before = app.st.messages.size();
    if (finish(app, d.purpose, path)) {
      d.purpose = DialogPurpose::None;
      ImGui::CloseCurrentPopup();
    } else if (app.st.messages.size() > before) {
      d.error = app.st.messages.back().text;
    }
  }
  if (!d.error.empty()) ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "%s", d.error.c_str());
  ImGui::EndPopup();
}

}  // namespace kvlens::gui
