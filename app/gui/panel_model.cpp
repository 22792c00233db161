// Model panel: the model folder (path, recent, picker), load progress and errors, the facts a
// researcher sizes a cache by, and the prompt and generation length.
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
  if (path_field("##modeldir", "embedded model (kvlens-scenes-6m)", st.edits.model_dir))
    app.open_model(st.edits.model_dir);
  ImGui::SameLine();
  if (ImGui::Button("Load")) app.open_model(st.edits.model_dir);
  ImGui::SameLine();
  if (ImGui::Button("…##model")) open_dialog(app, DialogPurpose::OpenModel, app.model_dir() + "/");
  ImGui::SameLine();
  if (ImGui::BeginCombo("##recentmodel", "recent", ImGuiComboFlags_NoPreview)) {
    if (ImGui::Selectable("embedded model")) {
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
    if (ImGui::BeginCombo(label, value.c_str())) {
      for (const char* o : options)
        if (ImGui::Selectable(o, value == o) && value != o) {
          value = o;
          st.dirty = true;
          app.submit();
        }
      ImGui::EndCombo();
    }
    if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", tip);
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
    if (ImGui::BeginTable("##facts", 4, ImGuiTableFlags_SizingStretchProp)) {
      auto row = [](const char* a, const std::string& b, const char* c, const std::string& d) {
        ImGui::TableNextRow();
        ImGui::TableNextColumn();
        ImGui::TextDisabled("%s", a);
        ImGui::TableNextColumn();
        ImGui::TextUnformatted(b.c_str());
        ImGui::TableNextColumn();
        ImGui::TextDisabled("%s", c);
        ImGui::TableNextColumn();
        ImGui::TextUnformatted(d.c_str());
      };
      row("layers", std::to_string(f.layers), "heads", std::to_string(f.heads));
      row("KV heads", std::to_string(f.kv_heads), "head_dim", std::to_string(f.head_dim));
      row("visual tokens", std::to_string(f.visual_tokens) + " (" + std::to_string(f.patch_rows) + "×" +
                               std::to_string(f.patch_rows) + ")",
          "full cache at fp16", f.full_fp16_bytes > 0 ? std::to_string(f.full_fp16_bytes / 1024) + " KiB" : "…");
      if (s->base && s->base->ex)
        row("vision", std::to_string(static_cast<int>(s->base->ex->prefill.vision_ms)) + " ms on " + f.backend, "prefill",
            std::to_string(static_cast<int>(s->base->ex->prefill.prefill_ms)) + " ms");
      ImGui::EndTable();
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
