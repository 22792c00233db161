// Plots panel: per-layer softmax MSE, KL and attention-output error, sparsity γ(l) in prefill
// and decode, CacheHitRate per scoring strategy by layer and by step, bytes per layer, the
// query × key attention heatmap with segment boundaries, and bytes against caption agreement for
// every instance — each a figure of the current report, drawn with the layout the exports use —
// small multiples of a generated token's attention over the patches (layers × heads), and the
// comparison table of every instance, sortable by any column.
#include <algorithm>
#include <cmath>

#include "app/gui/panels.h"
#include "app/figures/figures_report.h"

namespace kvlens::gui {

namespace {

// Every method of the report in one table, sorted by the column whose header was clicked last
// (Views::table_sort); a row's name selects the method in the other panels.
void comparison_table(App& app, const nlohmann::json& report) {
  Views& v = app.st.views;
  fig::ComparisonTable t = fig::comparison_table(report);
  const int nc = static_cast<int>(t.columns.size());
  const ImGuiTableFlags flags = ImGuiTableFlags_Sortable | ImGuiTableFlags_RowBg | ImGuiTableFlags_BordersInnerH |
                                ImGuiTableFlags_ScrollY | ImGuiTableFlags_ScrollX | ImGuiTableFlags_Resizable |
                                ImGuiTableFlags_SizingFixedFit;  // each column as wide as its content
  const ImVec2 at = ImGui::GetCursorScreenPos(), avail = ImGui::GetContentRegionAvail();
  app.st.drawn["table"] = {at.x, at.y, avail.x, avail.y};
  if (!ImGui::BeginTable("##comparison", nc, flags)) return;
  ImGui::TableSetupScrollFreeze(1, 1);
  for (int c = 0; c < nc; ++c) {
    ImGuiTableColumnFlags cf = ImGuiTableColumnFlags_PreferSortAscending;
    if (t.columns[static_cast<size_t>(c)].key == v.table_sort)
      cf |= ImGuiTableColumnFlags_DefaultSort | (v.table_descending ? ImGuiTableColumnFlags_PreferSortDescending : 0);
    ImGui::TableSetupColumn(t.columns[static_cast<size_t>(c)].name.c_str(), cf);
  }
  // The headers, each with what its column holds on hover.
  ImGui::TableNextRow(ImGuiTableRowFlags_Headers);
  for (int c = 0; c < nc; ++c) {
    ImGui::TableSetColumnIndex(c);
    ImGui::TableHeader(t.columns[static_cast<size_t>(c)].name.c_str());
    if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", t.columns[static_cast<size_t>(c)].about.c_str());
  }
  if (ImGuiTableSortSpecs* ss = ImGui::TableGetSortSpecs(); ss && ss->SpecsDirty && ss->SpecsCount > 0) {
    v.table_sort = t.columns[static_cast<size_t>(ss->Specs[0].ColumnIndex)].key;
    v.table_descending = ss->Specs[0].SortDirection == ImGuiSortDirection_Descending;
    ss->SpecsDirty = false;
  }
  fig::sort_comparison(t, v.table_sort, v.table_descending);
  const auto& runs = app.st.results->runs;  // in report order
  for (const fig::ComparisonTable::Row& r : t.rows) {
    const int id = r.method < static_cast<int>(runs.size()) ? runs[static_cast<size_t>(r.method)].id : -1;
    ImGui::PushID(r.method);
    ImGui::TableNextRow();
    ImGui::TableNextColumn();
    if (ImGui::Selectable(r.name.c_str(), id >= 0 && v.method == id, ImGuiSelectableFlags_SpanAllColumns) && id >= 0)
      v.method = id;
    for (size_t c = 0; c < r.values.size(); ++c) {
      ImGui::TableNextColumn();
      const double x = r.values[c];
      const std::string& key = t.columns[c + 1].key;
      if (std::isnan(x)) {
        ImGui::TextDisabled(key == "diverges_at" ? "never" : "—");
      } else if (key == "kv_kib" || key == "diverges_at") {
        ImGui::Text("%.0f", x);
      } else if (key == "ratio") {
        ImGui::Text("%.2f×", x);
      } else if (key == "compress_ms" || key == "decode_ms") {
        ImGui::Text("%.1f", x);
      } else {
        ImGui::TextUnformatted(fig::format_value(x).c_str());
        if (ImGui::IsItemHovered()) ImGui::SetTooltip("%.6g", x);
      }
    }
    ImGui::PopID();
  }
  ImGui::EndTable();
}

}  // namespace

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
  const bool open = ImGui::BeginCombo("##plot", entries[v.plot].name.c_str());
  preview_tooltip(app, entries[v.plot].name);
  if (open) {
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
    ImGui::SliderInt("##hmlayer", &v.heatmap_layer, 0, std::max(0, layers - 1), "layer %d");
    v.heatmap_layer = std::clamp(v.heatmap_layer, 0, std::max(0, layers - 1));
    ImGui::SameLine();
    ImGui::SetNextItemWidth(-1);
    instance_combo("##hmmethod", app, v.heatmap_method, "full cache", true);
    const int ri = v.heatmap_method >= 0 ? app.report_index(v.heatmap_method) : -1;
    key += ":" + std::to_string(v.heatmap_layer) + ":" + std::to_string(ri);
  }
  if (key == "table") {
    if (report) {
      ImGui::SameLine();
      if (ImGui::Button("copy as CSV")) {
        fig::ComparisonTable t = fig::comparison_table(*report);
        fig::sort_comparison(t, v.table_sort, v.table_descending);
        ImGui::SetClipboardText(fig::comparison_csv(t).c_str());
        app.info("comparison table copied as CSV (" + std::to_string(t.rows.size()) + " rows)");
      }
      comparison_table(app, *report);
    } else {
      no_results(app, "computing…", "no results yet");
    }
    ImGui::End();
    return;
  }
  if (key == "multiples") {
    ImGui::SameLine();
    ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.45f);
    instance_combo("##mulsrc", app, v.multiples_source, "full cache", true);
    ImGui::SameLine();
    token_slider("##multok", app, v.multiples_source, v.multiples_token, "token");
    key += ":" + std::to_string(v.multiples_source) + ":" + std::to_string(v.multiples_token);
  }
  const ImVec2 avail = ImGui::GetContentRegionAvail();
  if (const fig::Figure* f = app.figure(key)) {
    const ImVec2 at = ImGui::GetCursorScreenPos();
    st.drawn["plot"] = {at.x, at.y, avail.x, avail.y};
    draw_figure("##plot", *f, avail, st.zoom[f->id], ui.textures, &st.plot_y);
    st.plot_figure = f->id;
    st.figures.shown_keys.push_back(key);
  } else {
    no_results(app, "computing…", "no results yet");
  }
  ImGui::End();
}

}  // namespace kvlens::gui
