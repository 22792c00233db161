// Plots panel: per-layer softmax MSE, KL and attention-output error, sparsity γ(l) in prefill
// and decode, CacheHitRate per scoring strategy by layer and by step, bytes per layer, the
// query × key attention heatmap with segment boundaries, and bytes against caption agreement for
// every instance — each a figure of the current report, drawn with the layout the exports use.
#include <algorithm>

#include "app/gui/panels.h"
#include "app/figures/figures_report.h"

namespace kvlens::gui {

void plots_panel(App& app, Ui& ui, const PanelRect& rect) {
  if (!begin_panel("Plots", rect)) {
    ImGui::End();
    return;
  }
  State& st = app.st;
  Views& v = st.views;
  const std::vector<PlotEntry> entries = plot_entries(app);
  v.plot = std::clamp(v.plot, 0, static_cast<int>(entries.size()) - 1);
  ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.45f);
  if (ImGui::BeginCombo("##plot", entries[v.plot].name.c_str())) {
    for (size_t i = 0; i < entries.size(); ++i)
      if (ImGui::Selectable(entries[i].name.c_str(), static_cast<int>(i) == v.plot)) v.plot = static_cast<int>(i);
    ImGui::EndCombo();
  }
  const Snapshot* s = st.results.get();
  const nlohmann::json* report = s && s->report ? s->report.get() : nullptr;
  std::string key = entries[v.plot].key;
  if (key == "hit_layer") {
    const int n = report ? static_cast<int>((*report)["cache_hit_rate"]["steps"].size()) : 1;
    v.hit_step = std::clamp(v.hit_step, 0, std::max(0, n - 1));
    const int step = report && n > 0 ? (*report)["cache_hit_rate"]["steps"][v.hit_step].get<int>() : 0;
    ImGui::SameLine();
    ImGui::SetNextItemWidth(-1);
    ImGui::SliderInt("##hitstep", &v.hit_step, 0, std::max(0, n - 1), ("decode step " + std::to_string(step)).c_str());
    key += ":" + std::to_string(v.hit_step);
  }
  if (key == "heatmap") {
    const int layers = s && s->model ? s->model->layers : 1;
    ImGui::SameLine();
    ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.45f);
    ImGui::SliderInt("##hmlayer", &v.layer, 0, std::max(0, layers - 1), "layer %d");
    ImGui::SameLine();
    ImGui::SetNextItemWidth(-1);
    instance_combo("##hmmethod", app, v.heatmap_method, "full cache", true);
    const int ri = v.heatmap_method >= 0 ? app.report_index(v.heatmap_method) : -1;
    key += ":" + std::to_string(v.layer) + ":" + std::to_string(ri);
  }
  const ImVec2 avail = ImGui::GetContentRegionAvail();
  if (const fig::Figure* f = app.figure(key)) {
    const ImVec2 at = ImGui::GetCursorScreenPos();
    st.drawn["plot"] = {at.x, at.y, avail.x, avail.y};
    draw_figure("##plot", *f, avail, st.zoom[f->id], ui.textures);
    st.figures.shown_keys.push_back(key);
  } else {
    no_results(app, "computing…", "no results yet");
  }
  ImGui::End();
}

}  // namespace kvlens::gui
