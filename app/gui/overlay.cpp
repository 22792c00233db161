#include "app/gui/overlay.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "app/gui/app.h"

namespace kvlens::gui {

OverlayScale overlay_scale(Overlay kind, const std::vector<float>& values) {
  OverlayScale s;
  float mx = 0;
  for (float x : values)
    if (std::isfinite(x)) mx = std::max(mx, x);
  switch (kind) {
    case Overlay::None: return s;
    case Overlay::Attention:
      s.quantity = "attention probability of the patch";
      s.hi = mx;
      break;
    case Overlay::FateKept:
      s.quantity = "share of KV heads keeping the patch";
      s.hi = 1;
      break;
    case Overlay::FateMerged:
      s.quantity = "rows merged into the patch (mean over KV heads)";
      s.hi = mx;
      break;
    case Overlay::FateBits: {
      s.quantity = "bits of the patch's kept keys (0: evicted)";
      s.hi = mx;
      s.log2 = true;
      std::set<double> seen;
      for (float x : values)
        if (std::isfinite(x)) seen.insert(std::round(static_cast<double>(x) * 100) / 100);
      s.levels.assign(seen.begin(), seen.end());
      // From the fewest bits present (0 where a patch is evicted), so that mixed precisions
      // spread over the bar; a single level keeps 0 as its other end.
      if (s.levels.size() > 1) s.lo = s.levels.front();
      break;
    }
  }
  return s;
}

double overlay_position(const OverlayScale& s, double value) {
  if (s.empty() || !std::isfinite(value)) return 0.0;
  const double t = s.log2 ? std::log2(1 + std::max(value - s.lo, 0.0)) / std::log2(1 + (s.hi - s.lo))
                          : (value - s.lo) / (s.hi - s.lo);
  return std::clamp(t, 0.0, 1.0);
}

float overlay_veil(const OverlayScale& s, double value, float opacity) {
  return std::clamp(opacity, 0.0f, 1.0f) * static_cast<float>(1.0 - overlay_position(s, value));
}

void apply_veil(float veil, unsigned char* rgb) {
  if (veil <= 0) return;
  // Luminance, dimmed to 40 %: what a veiled patch tends to.
  const float grey = 0.4f * (0.299f * rgb[0] + 0.587f * rgb[1] + 0.114f * rgb[2]);
  for (int c = 0; c < 3; ++c) rgb[c] = static_cast<unsigned char>(std::lround(rgb[c] + (grey - rgb[c]) * veil));
}

VisualGrid overlay_grid(const Snapshot& s) {
  if (s.base && s.base->ex)
    if (const VisualGrid* g = s.base->ex->prefill.layout.finest()) return *g;
  VisualGrid g;
  if (!s.model) return g;
  g.rows = g.cols = g.row_stride = s.model->patch_rows;
  g.first = s.model->patch_first;
  return g;
}

OverlayData overlay_of(const App& app, int source) {
  OverlayData o;
  const Views& v = app.st.views;
  const Snapshot* s = app.st.results.get();
  if (!s || !s->base || v.overlay == Overlay::None) return o;
  const MethodInstance* m = source >= 0 ? app.find(source) : nullptr;
  const std::string who = source < 0 ? "full cache" : m ? app.display_name(*m) : "?";
  if (v.overlay == Overlay::Attention) {
    const VisualAttentionRecorder* rec = s->base->patches.get();
    if (source >= 0) {
      const RunResult* r = app.any_result(source);
      rec = r ? r->patches.get() : nullptr;
    }
    if (!rec) return o;
    o.values = rec->attention(v.token, v.layer, v.head);
    o.what = "attention of generated token " + std::to_string(v.token) + ", " + who + ", layer " +
             std::to_string(v.layer) + (v.head < 0 ? ", mean over heads" : ", head " + std::to_string(v.head));
  } else {
    const RunResult* r = source >= 0 ? app.any_result(source) : nullptr;
    if (!r || v.layer >= static_cast<int>(r->run->layers.size())) return o;
    const LayerDiagnostics& d = r->run->layers[v.layer];
    const std::string at = ", " + who + ", layer " + std::to_string(v.layer);
    if (v.overlay == Overlay::FateKept) {
      o.values = d.fate_kept;
      o.what = "share of KV heads keeping each patch" + at;
    } else if (v.overlay == Overlay::FateBits) {
      o.values = d.fate_bits;
      o.what = "mean bits of kept rows (0 = evicted)" + at;
    } else {
      o.values = d.fate_merged;
      o.what = "rows merged into each patch" + at;
    }
  }
  o.scale = overlay_scale(v.overlay, o.values);
  return o;
}

std::vector<int> overlay_sources(const App& app) {
  std::vector<int> ids;
  if (app.st.views.overlay == Overlay::Attention) ids.push_back(-1);
  for (const MethodInstance& m : app.st.methods)
    if (app.any_result(m.id)) ids.push_back(m.id);
  return ids;
}

}  // namespace kvlens::gui
