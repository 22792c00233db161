// Model panel: the model folder (path, recent, picker), load progress and errors, the facts a
// researcher sizes a cache by, and the prompt and generation length.
#include <algorithm>
#include <filesystem>
#include <imgui.h>
#include <imgui_stdlib.h>  // after imgui.h

#include "app/gui/panels.h"
#include "app/lab/session.h"

namespace kvlens::gui {

void model_panel(App& app, Ui&, const PanelRect& rect) {
  if (!begin_panel("Model", rect)) {
    ImGui::End();
    return;
  }
  State& st = app.st;
  if (st.edits.model_dir.empty() && st.inputs.model_dir.empty()) st.edits.model_dir = "";
  ImGui::SetNextItemWidth(-150 * figure_scale());
  // The hint leads with the model's name, so a narrow window cuts the words after it.
  const std::string placeholder = std::filesystem::path(app.default_model_dir()).filename().string() + " (default)";
  if (path_field("##modeldir", placeholder.c_str(), st.edits.model_dir, st.shown["model_dir"]))
    app.open_model(st.edits.model_dir);
  ImGui::SameLine();
  if (ImGui::Button("Load")) app.open_model(st.edits.model_dir);
  ImGui::SameLine();
  if (ImGui::Button("…##model")) open_dialog(app, DialogPurpose::OpenModel, app.model_dir() + "/");
  ImGui::SameLine();
  if (ImGui::BeginCombo("##recentmodel", "recent", ImGuiComboFlags_NoPreview)) {
    if (ImGui::Selectable("default model")) {
      st.inputs.model_dir.clear();
      st.edits.model_dir.clear();
      app.submit();
    }
    for (const std::string& p : std::vector<std::string>(st.recent_models))
      if (ImGui::Selectable(p.c_str())) app.open_model(p);
    ImGui::EndCombo();
  }
  // Where the model runs and how uncompressed rows are stored: a change reloads the model or
  // recomputes the prefill and every method.
  auto choice = [&](const char* label, const char* tip, std::string& value, std::initializer_list<const char*> options) {
    ImGui::SetNextItemWidth(90 * figure_scale());
    const bool open = ImGui::BeginCombo(label, value.c_str());
    help_tooltip(app, value, tip);
    if (open) {
      for (const char* o : options)
        if (ImGui::Selectable(o, value == o) && value != o) {
          value = o;
          st.dirty = true;
          app.submit();
        }
      ImGui::EndCombo();
    }
  };
  choice("backend", "Where the model runs: auto (CUDA when a device is usable), cpu, cuda", st.inputs.backend,
         {"auto", "cpu", "cuda"});
  ImGui::SameLine();
  choice("KV rows", "Storage of uncompressed KV rows: fp16 (rounded to half precision, 2 B/value; the papers' full "
                    "cache) or fp32 (exact, 4 B/value). Diagnostics compare against the exact prefill either way",
         st.inputs.kv_storage, {"fp16", "fp32"});
  const Snapshot* s = st.results.get();
  if (s && !s->model_error.empty()) {
    ImGui::PushTextWrapPos(0);
    ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "%s", s->model_error.c_str());
    ImGui::PopTextWrapPos();
  } else if (!s || !s->model || s->model->dir != app.model_dir()) {
    ImGui::TextDisabled("loading %s…", app.model_dir().c_str());
  } else {
    const ModelFacts& f = *s->model;
    // The visual tokens of the image computed (an anyres model's depend on it), else the model's.
    const VisualLayout* layout = s->base && s->base->ex ? &s->base->ex->prefill.layout : nullptr;
    std::string visual = std::to_string(f.visual_tokens) + " (" + std::to_string(f.patch_rows) + "×" +
                         std::to_string(f.patch_rows) + ")";
    // An anyres model: this image's tiles and grids, short enough to stand uncut at 1280×800.
    std::string grid, tiles = f.tiling.substr(0, f.tiling.find(';'));
    if (layout && f.image_dependent) {
      visual = std::to_string(layout->n_tokens) + " for this image";
      for (const VisualGrid& g : layout->grids) {
        grid += (grid.empty() ? "" : ", ") + g.name + " " + std::to_string(g.rows) + "×" + std::to_string(g.cols);
        if (g.tile_side > 0)
          tiles = std::to_string((g.rows + 2 * g.cut_top) / g.tile_side) + "×" +
                  std::to_string((g.cols + 2 * g.cut_left) / g.tile_side) + " of " + tiles;
      }
    }
    std::vector<std::pair<std::string, std::string>> facts = {
        {"family", f.family.empty() ? "?" : f.family},
        {"layers", std::to_string(f.layers)},
        {"heads", std::to_string(f.heads)},
        {"KV heads", std::to_string(f.kv_heads)},
        {"head_dim", std::to_string(f.head_dim)},
        {"visual tokens", visual},
        {"full cache at fp16", f.full_fp16_bytes > 0 ? std::to_string(f.full_fp16_bytes / 1024) + " KiB" : "…"}};
    if (!grid.empty()) facts.insert(facts.begin() + 6, {"grids", grid});
    if (!tiles.empty()) facts.insert(facts.begin() + 6, {"tiles", tiles});
    if (s->base && s->base->ex) {
      facts.push_back({"vision", std::to_string(static_cast<int>(s->base->ex->prefill.vision_ms)) + " ms on " + f.backend});
      facts.push_back({"prefill", std::to_string(static_cast<int>(s->base->ex->prefill.prefill_ms)) + " ms"});
    }
    // Two facts a row where they fit side by side, else one: no value is cut (1280×800).
    // The width n facts a row need: each column as wide as its widest text, plus cell padding.
    const float pad = 2 * ImGui::GetStyle().CellPadding.x + ImGui::GetStyle().ItemSpacing.x;
    auto needed = [&](int n) {
      std::vector<float> col(static_cast<size_t>(2 * n), 0.0f);
      for (size_t i = 0; i < facts.size(); ++i) {
        const size_t c = 2 * (i % static_cast<size_t>(n));
        col[c] = std::max(col[c], ImGui::CalcTextSize(facts[i].first.c_str()).x);
        col[c + 1] = std::max(col[c + 1], ImGui::CalcTextSize(facts[i].second.c_str()).x);
      }
      float w = 0;
      for (float x : col) w += x + pad;
      return w;
    };
    const float avail = ImGui::GetContentRegionAvail().x;
    const int per_row = needed(2) <= avail ? 2 : 1;
    const float need_w = needed(per_row);
    const ImVec2 at = ImGui::GetCursorScreenPos();
    st.drawn["model_panel"] = {at.x, at.y, avail, 0};
    if (ImGui::BeginTable("##facts", 2 * per_row, ImGuiTableFlags_SizingFixedFit)) {
      for (size_t i = 0; i < facts.size(); ++i) {
        if (i % static_cast<size_t>(per_row) == 0) ImGui::TableNextRow();
        ImGui::TableNextColumn();
        ImGui::TextDisabled("%s", facts[i].first.c_str());
        ImGui::TableNextColumn();
        ImGui::TextUnformatted(facts[i].second.c_str());
      }
      ImGui::EndTable();
      // The width the facts need (all of them shown whole) and the height they take.
      st.drawn["model_facts"] = {at.x, at.y, need_w, ImGui::GetItemRectSize().y};
    }
  }
  ImGui::TextUnformatted("Prompt");
  ImGui::SetNextItemWidth(-1);
  ImGui::InputTextMultiline("##prompt", &st.edits.prompt, ImVec2(-1, ImGui::GetTextLineHeight() * 2.4f));
  ImGui::SetNextItemWidth(120 * figure_scale());
  ImGui::InputInt("max new tokens", &st.edits.max_new_tokens);
  ImGui::SameLine();
  const bool changed = st.edits.prompt != st.inputs.prompt || st.edits.max_new_tokens != st.inputs.max_new_tokens;
  ImGui::BeginDisabled(!changed);
  if (ImGui::Button("Apply")) app.set_prompt(st.edits.prompt, st.edits.max_new_tokens);
  ImGui::EndDisabled();
  ImGui::End();
}

}  // namespace kvlens::gui
