// Image panel: open an image (path, recent files, drag and drop onto the window), the
// preprocessed image the vision tower sees with its patch grid, and overlays with opacity: the
// attention of one generated token over the patches (a layer, a head or the mean), or the
// token fate of a method (kept share, bits, rows merged in).
#include <imgui.h>
#include <imgui_stdlib.h>  // after imgui.h

#include <algorithm>
#include <cmath>

#include "app/gui/panels.h"
#include "app/figures/figures.h"
#include "core/numbers.h"

namespace kvlens::gui {

namespace {

uint64_t key_of(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h | (1ull << 63);
}

// Per visual token values of the chosen overlay, and their maximum; empty when not available.
std::vector<float> overlay_values(App& app, std::string& what) {
  const Views& v = app.st.views;
  const Snapshot* s = app.st.results.get();
  if (!s || !s->base) return {};
  if (v.overlay == Overlay::Attention) {
    const VisualAttentionRecorder* rec = s->base->patches.get();
    std::string who = "full cache";
    if (v.overlay_source >= 0) {
      const RunResult* r = app.any_result(v.overlay_source);
      if (!r) return {};
      rec = r->patches.get();
      who = app.find(v.overlay_source) ? app.display_name(*app.find(v.overlay_source)) : "?";
    }
    if (!rec) return {};
    what = "attention of generated token " + std::to_string(v.token) + ", " + who + ", layer " + std::to_string(v.layer) +
           (v.head < 0 ? ", mean over heads" : ", head " + std::to_string(v.head));
    return rec->attention(v.token, v.layer, v.head);
  }
  if (v.overlay == Overlay::None) return {};
  const int id = v.overlay_source >= 0 ? v.overlay_source : v.method;
  const RunResult* r = app.any_result(id);
  if (!r || v.layer >= static_cast<int>(r->run->layers.size())) return {};
  const LayerDiagnostics& d = r->run->layers[v.layer];
  const MethodInstance* m = app.find(id);
  const std::string who = m ? app.display_name(*m) : "?";
  if (v.overlay == Overlay::FateKept) {
    what = "share of KV heads keeping each patch, " + who + ", layer " + std::to_string(v.layer);
    return d.fate_kept;
  }
  if (v.overlay == Overlay::FateBits) {
    what = "mean bits of kept rows (0 = evicted), " + who + ", layer " + std::to_string(v.layer);
    return d.fate_bits;
  }
  what = "rows merged into each patch, " + who + ", layer " + std::to_string(v.layer);
  return d.fate_merged;
}

}  // namespace

void image_panel(App& app, Ui& ui, const PanelRect& rect) {
  if (!begin_panel("Image", rect)) {
    ImGui::End();
    return;
  }
  State& st = app.st;
  Views& v = st.views;
  // Open: path, recent, picker; dropping a file onto the window opens it too.
  ImGui::SetNextItemWidth(-150);
  if (ImGui::InputTextWithHint("##imgpath", "sample image (assets/images/scene_000.png)", &st.edits.image_path,
                               ImGuiInputTextFlags_EnterReturnsTrue))
    app.open_image(st.edits.image_path);
  ImGui::SameLine();
  if (ImGui::Button("Open")) app.open_image(st.edits.image_path);
  ImGui::SameLine();
  if (ImGui::Button("…##img")) open_dialog(app, DialogPurpose::OpenImage, app.image_path());
  ImGui::SameLine();
  if (ImGui::BeginCombo("##recentimg", "recent", ImGuiComboFlags_NoPreview)) {
    if (ImGui::Selectable("sample image")) {
      st.inputs.image_path.clear();
      st.edits.image_path.clear();
      app.submit();
    }
    for (const std::string& p : std::vector<std::string>(st.recent_images))
      if (ImGui::Selectable(p.c_str())) app.open_image(p);
    ImGui::EndCombo();
  }
  const Snapshot* s = st.results.get();
  if (s && !s->base_error.empty()) ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "%s", s->base_error.c_str());

  // Overlay controls.
  const char* overlays[] = {"no overlay", "attention of a token", "fate: kept share", "fate: bits", "fate: rows merged"};
  int ov = static_cast<int>(v.overlay);
  const float w = ImGui::GetContentRegionAvail().x;
  ImGui::SetNextItemWidth(w * 0.5f);
  if (ImGui::Combo("##overlay", &ov, overlays, 5)) v.overlay = static_cast<Overlay>(ov);
  ImGui::SameLine();
  ImGui::SetNextItemWidth(w * 0.26f);
  ImGui::SliderFloat("##opacity", &v.overlay_opacity, 0, 1, "opacity %.2f");
  ImGui::SameLine();
  ImGui::Checkbox("grid", &v.patch_grid);
  const int layers = s && s->model ? s->model->layers : 1, heads = s && s->model ? s->model->heads : 1;
  if (v.overlay != Overlay::None) {
    ImGui::SetNextItemWidth(w * 0.4f);
    instance_combo("##ovsrc", app, v.overlay_source, v.overlay == Overlay::Attention ? "full cache" : nullptr, true);
    ImGui::SameLine();
    ImGui::SetNextItemWidth(w * 0.27f);
    ImGui::SliderInt("##layer", &v.layer, 0, std::max(0, layers - 1), "layer %d");
    if (v.overlay == Overlay::Attention) {
      ImGui::SameLine();
      ImGui::SetNextItemWidth(-1);
      ImGui::SliderInt("##head", &v.head, -1, std::max(0, heads - 1), v.head < 0 ? "mean of heads" : "head %d");
      const std::vector<std::string>* pieces = s && s->base ? &s->base->pieces : nullptr;
      if (v.overlay_source >= 0)
        if (const RunResult* r = app.any_result(v.overlay_source)) pieces = &r->pieces;
      const int n = pieces ? std::max(1, static_cast<int>(pieces->size()) - 1) : 1;
      v.token = std::clamp(v.token, 0, n - 1);
      const std::string tok = pieces && v.token < static_cast<int>(pieces->size()) ? (*pieces)[v.token] : "";
      ImGui::SetNextItemWidth(-1);
      ImGui::SliderInt("##token", &v.token, 0, n - 1, ("generated token %d: '" + tok + "'").c_str());
    }
  }
  v.layer = std::clamp(v.layer, 0, std::max(0, layers - 1));

  // The image, square, as large as the panel allows.
  const ImVec2 avail = ImGui::GetContentRegionAvail();
  const float side = std::max(64.0f, std::min(avail.x, avail.y - ImGui::GetTextLineHeightWithSpacing()));
  const ImVec2 p0 = ImGui::GetCursorScreenPos();
  ImDrawList* dl = ImGui::GetWindowDrawList();
  if (s && s->base && s->base->shown.width > 0) {
    const RGBImage& img = s->base->shown;
    std::vector<uint8_t> rgba;
    const uint64_t key = key_of(s->base->key);
    if (!ui.textures.has(key)) {
      rgba.assign(static_cast<size_t>(img.width) * img.height * 4, 255);
      for (size_t i = 0; i < static_cast<size_t>(img.width) * img.height; ++i)
        for (int c = 0; c < 3; ++c) rgba[i * 4 + c] = img.data[i * 3 + c];
    }
    dl->AddImage(ui.textures.get(key, img.width, img.height, rgba.data(), false), p0,
                 ImVec2(p0.x + side, p0.y + side));
    const int R = s->model ? s->model->patch_rows : 0, first = s->model ? s->model->patch_first : 0;
    std::string what;
    const std::vector<float> val = overlay_values(app, what);
    float mx = 0;
    for (float x : val) mx = std::max(mx, x);
    if (v.overlay == Overlay::FateKept) mx = 1;
    const float cell = R > 0 ? side / R : side;
    int hover_r = -1, hover_c = -1;
    if (R > 0 && val.size() >= static_cast<size_t>(first + R * R) && mx > 0)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < R; ++c) {
          const float t = val[first + r * R + c] / mx;
          // Attention and merges: colour where there is some, the image where there is none.
          // Kept share: a dark veil over what is evicted. Bits: every patch coloured.
          fig::Color col = fig::colormap(t);
          float alpha = v.overlay_opacity;
          if (v.overlay == Overlay::Attention || v.overlay == Overlay::FateMerged) {
            col = fig::colormap(0.4 + 0.6 * t);  // the bright end of the map, fading out towards 0
            alpha *= std::max(t, 0.0f);
          }
          if (v.overlay == Overlay::FateKept) {
            col = fig::Color{0.08f, 0.05f, 0.12f, 1};
            alpha *= 1.0f - t;
          }
          const ImVec2 a(p0.x + c * cell, p0.y + r * cell);
          dl->AddRectFilled(a, ImVec2(a.x + cell, a.y + cell),
                            IM_COL32(static_cast<int>(col.r * 255), static_cast<int>(col.g * 255),
                                     static_cast<int>(col.b * 255), static_cast<int>(alpha * 255)));
        }
    if (R > 0 && v.patch_grid)
      for (int i = 0; i <= R; ++i) {
        dl->AddLine(ImVec2(p0.x + i * cell, p0.y), ImVec2(p0.x + i * cell, p0.y + side), IM_COL32(255, 255, 255, 70));
        dl->AddLine(ImVec2(p0.x, p0.y + i * cell), ImVec2(p0.x + side, p0.y + i * cell), IM_COL32(255, 255, 255, 70));
      }
    ImGui::InvisibleButton("##imagearea", ImVec2(side, side));
    st.drawn["image"] = {p0.x, p0.y, side, side};
    if (ImGui::IsItemHovered() && R > 0) {
      const ImVec2 m = ImGui::GetIO().MousePos;
      hover_c = std::clamp(static_cast<int>((m.x - p0.x) / cell), 0, R - 1);
      hover_r = std::clamp(static_cast<int>((m.y - p0.y) / cell), 0, R - 1);
      ImGui::BeginTooltip();
      ImGui::Text("patch row %d, column %d (visual token %d)", hover_r, hover_c, first + hover_r * R + hover_c);
      if (!val.empty()) ImGui::Text("%s: %s", v.overlay == Overlay::Attention ? "attention" : "value",
                                    fig::format_value(val[first + hover_r * R + hover_c]).c_str());
      ImGui::EndTooltip();
    }
    ImGui::TextDisabled("%s", what.empty() ? (std::to_string(img.width) + "×" + std::to_string(img.height) + ", " +
                                              std::to_string(R) + "×" + std::to_string(R) + " patches")
                                                 .c_str()
                                           : what.c_str());
  } else {
    dl->AddRectFilled(p0, ImVec2(p0.x + side, p0.y + side), IM_COL32(220, 220, 225, 255));
    ImGui::Dummy(ImVec2(side, side));
    ImGui::TextDisabled("%s", app.busy() ? "running vision and prefill…" : "no image");
  }
  ImGui::End();
}

}  // namespace kvlens::gui
