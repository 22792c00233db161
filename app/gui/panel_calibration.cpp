// Calibration panel (tuning τ1/τ2 by eye): for one method instance, layer and head, the
// pre-softmax score histograms of the visual keys (exact, quantized, quantized + calibrated) on
// shared bins, and CalibQuant's map g(x) as a transfer curve from [γ, δ] to [γ−τ1, δ−τ2].
// Moving τ1/τ2 recomputes the calibrated histogram at once from the stored quantized scores
// (no decode); the caption and softmax MSE follow when the worker's re-decode finishes.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "app/gui/panels.h"
#include "core/errors.h"
#include "app/figures/figures_report.h"
#include "core/numbers.h"

namespace kvlens::gui {

namespace {

bool tau_slider(App& app, int id, const char* name, const Params& p) {
  // The range and help of τ come from the method of the stage that calibrates.
  const std::optional<Params> stage = calibration_stage(p);
  const ParamSpec* spec = nullptr;
  if (stage)
    for (const ParamSpec& s : find_method(stage->method()).params)
      if (s.name == name) spec = &s;
  if (!spec || !p.has(name)) return false;
  std::string text = p.str(name);
  if (text == "default") text = spec->def;
  float v = static_cast<float>(parse_real(text, name, -1e9, 1e9));
  const std::string label = std::string(name[3] == '1' ? "τ1" : "τ2") + "##calib";
  ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.42f);
  const bool changed = ImGui::SliderFloat(label.c_str(), &v, static_cast<float>(spec->min), static_cast<float>(spec->max), "%.2f");
  if (ImGui::IsItemHovered()) ImGui::SetTooltip("%s", spec->help.c_str());
  if (ImGui::IsItemActivated()) app.begin_edit();
  if (changed) {
    char b[32];
    std::snprintf(b, sizeof b, "%.6g", v);
    app.set_param(id, name, b);
  }
  if (ImGui::IsItemDeactivated()) app.end_edit();
  return changed;
}

}  // namespace

void calibration_panel(App& app, Ui& ui, const PanelRect& rect) {
  if (!begin_panel("Calibration", rect)) {
    ImGui::End();
    return;
  }
  State& st = app.st;
  Views& v = st.views;
  app.calibration_view();  // picks the instance when none is chosen
  ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.42f);
  instance_combo("method##calib", app, v.calib_method, nullptr, true);
  const Snapshot* s = st.results.get();
  const int layers = s && s->model ? s->model->layers : 1, heads = s && s->model ? s->model->heads : 1;
  ImGui::SameLine();
  ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.45f);
  slider_int(app, "##clayer", v.calib_layer, 0, std::max(0, layers - 1), "layer %d");
  ImGui::SameLine();
  ImGui::SetNextItemWidth(-1);
  slider_int(app, "##chead", v.calib_head, -1, std::max(0, heads - 1), v.calib_head < 0 ? "all heads" : "head %d");
  v.calib_layer = std::clamp(v.calib_layer, 0, std::max(0, layers - 1));
  v.calib_head = std::clamp(v.calib_head, -1, std::max(0, heads - 1));
  const MethodInstance* m = app.find(v.calib_method);
  if (!m) {
    ImGui::TextDisabled("add a method (calibquant) to tune its calibration");
    ImGui::End();
    return;
  }
  const std::optional<fig::Calibration> calib = calibration_of(m->params);
  if (calib) {
    tau_slider(app, m->id, "tau1", m->params);
    ImGui::SameLine();
    tau_slider(app, m->id, "tau2", m->params);
  } else {
    ImGui::TextDisabled("%s does not calibrate its scores (no g(x)); its histograms are shown as they are",
                        app.display_name(*m).c_str());
  }
  const RunResult* r = app.any_result(m->id);
  if (!r || v.calib_layer >= static_cast<int>(r->run->layers.size())) {
    ImGui::TextDisabled("%s", app.busy() ? "waiting for the first run of this method…" : "no result for this method");
    ImGui::End();
    return;
  }
  const CalibrationView& cv = app.calibration_view();
  // What the re-decode gives, once it is back.
  const RunResult* now = app.result(m->id);
  const int ri = app.report_index(m->id);
  if (now && ri >= 0 && s->report) {
    const auto& mj = (*s->report)["methods"][ri];
    fitted_text(app, "softmax MSE: layer " + std::to_string(v.calib_layer) + " " +
                         fig::format_value(mj["layers"][v.calib_layer]["softmax_mse"].get<double>()) + " · mean " +
                         fig::format_value(mj["mean_softmax_mse"].get<double>()) + " · caption " +
                         (mj["same_as_full"].get<bool>() ? "= full cache" : "≠ full cache"));
  } else {
    ImGui::TextColored(ImVec4(0.55f, 0.4f, 0.05f, 1), "histogram recalibrated from stored scores; re-decoding for caption and MSE…");
  }
  // The histogram takes 58 % of the room and g(x) the rest, each at least kMinFigureHeight
  // (scaled with the UI): where the panel is shorter (1280×800), it scrolls instead of squeezing
  // a plot to a strip.
  const ImVec2 avail = ImGui::GetContentRegionAvail();
  const float spacing = ImGui::GetStyle().ItemSpacing.y, min_h = kMinFigureHeight * figure_scale();
  const float hh = std::max(cv.has_transfer ? avail.y * 0.58f : avail.y, min_h);
  const ImVec2 at = ImGui::GetCursorScreenPos();
  st.drawn["calibration_histogram"] = {at.x, at.y, avail.x, hh};
  draw_figure("##calibhist", cv.histogram, ImVec2(avail.x, hh), st.zoom[cv.histogram.id], ui.textures);
  st.figures.shown_live.push_back(cv.histogram);
  if (cv.has_transfer) {
    const float th = std::max(avail.y - hh - spacing, min_h);
    const ImVec2 tat = ImGui::GetCursorScreenPos();
    st.drawn["calibration_transfer"] = {tat.x, tat.y, avail.x, th};
    draw_figure("##calibtransfer", cv.transfer, ImVec2(avail.x, th), st.zoom[cv.transfer.id], ui.textures);
    st.figures.shown_live.push_back(cv.transfer);
  }
  ImGui::End();
}

}  // namespace kvlens::gui
