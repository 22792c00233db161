// The Calibration panel's figures, computed from the state (so scripted checks see exactly what
// the panel draws): the visual score histograms of one instance, layer and head, recalibrated
// from the stored quantized scores with the instance's current values, and g(x).
#include <algorithm>
#include <cstdio>

#include "app/gui/app.h"
#include "core/errors.h"
#include "app/figures/figures_report.h"

namespace kvlens::gui {

const CalibrationView& App::calibration_view() {
  Views& v = st.views;
  if (!find(v.calib_method)) {
    v.calib_method = -1;
    for (const MethodInstance& m : st.methods)
      if (v.calib_method < 0 && m.enabled && calibration_of(m.params)) v.calib_method = m.id;
    if (v.calib_method < 0 && !st.methods.empty()) v.calib_method = st.methods.front().id;
  }
  CalibrationView& cv = st.calibration;
  const MethodInstance* m = find(v.calib_method);
  const RunResult* r = m ? any_result(m->id) : nullptr;
  if (!m || !r || v.calib_layer < 0 || v.calib_layer >= static_cast<int>(r->run->layers.size())) {
    cv = CalibrationView{};
    return cv;
  }
  char keybuf[64];
  std::snprintf(keybuf, sizeof keybuf, "%p/%d/%d/", static_cast<const void*>(r->run.get()), v.calib_layer, v.calib_head);
  const std::string key = keybuf + m->params.spec() + "/" + display_name(*m);
  if (cv.key == key) return cv;
  cv.key = key;
  const std::optional<fig::Calibration> calib = calibration_of(m->params);
  const VisualScores& stored = r->run->layers[v.calib_layer].visual_score_samples;
  VisualScores now = stored;
  try {
    now = retransform_visual_scores(stored, v.calib_layer, *make_policy(m->params));
  } catch (const InputError& e) {
    error(e.what());
  }
  const int head = v.calib_head < static_cast<int>(now.quantized.size()) ? v.calib_head : -1;
  const ScoreHistogram h = visual_score_histogram(now, head, 40);
  cv.calibrated = h.calibrated;
  // Each shown head's γ, δ (g(x) draws a line a head, as the method calibrates), and their span.
  std::vector<double> gs, ds;
  double g = 1e300, d = -1e300;
  const ScoreRanges ranges = score_range_by_head(now);
  for (size_t hd = 0; hd < now.quantized.size(); ++hd) {
    if (head >= 0 && static_cast<int>(hd) != head) continue;
    gs.push_back(ranges.gamma[hd]);
    ds.push_back(ranges.delta[hd]);
    if (now.quantized[hd].empty()) continue;
    g = std::min(g, ranges.gamma[hd]);
    d = std::max(d, ranges.delta[hd]);
  }
  cv.gamma = g;
  cv.delta = d;
  const std::string where = display_name(*m) + ", layer " + std::to_string(v.calib_layer) + ", " +
                            (head < 0 ? std::string("all heads") : "head " + std::to_string(head));
  // File names carry the method, layer and head, so exports of other views do not overwrite them.
  const std::string tag = "_" + fig::slug(display_name(*m)) + "_l" + std::to_string(v.calib_layer) +
                          (head < 0 ? "" : "_h" + std::to_string(head));
  cv.histogram = fig::score_histogram_figure(h, "calibration_histogram" + tag, "Visual scores: " + where,
                                             head >= 0 ? calib : std::nullopt, g, d);
  if (head < 0 && calib)
    cv.histogram.note += "; g(x) per head, τ1 = " + fig::format_value(calib->tau1) + ", τ2 = " + fig::format_value(calib->tau2);
  cv.has_transfer = calib.has_value() && d > g;
  if (cv.has_transfer) cv.transfer = fig::transfer_curves_figure(gs, ds, *calib, "calibration_transfer" + tag, "g(x): " + where);
  for (fig::Figure* f : {&cv.histogram, &cv.transfer}) {
    f->method = display_name(*m);
    f->layer = v.calib_layer;
    f->head = head;
  }
  return cv;
}

}  // namespace kvlens::gui
