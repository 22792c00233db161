// Image panel: open an image (path, recent files, drag and drop onto the window), the
// preprocessed image the vision tower sees with its patch grid, and overlays with opacity: the
// attention of one generated token over the patches (a layer, a head or the mean), or the
// token fate of a method (kept share, bits, rows merged in) — each patch veiled by its value
// (app/gui/overlay.h), with a colour bar, and a hover that lists the patch's value for every
// source.
#include <imgui.h>
#include <imgui_stdlib.h>  // after imgui.h

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "app/gui/overlay.h"
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

// A key for the veiled image: the image, the overlay's values and its opacity.
uint64_t overlay_key(uint64_t image, const std::vector<float>& values, Overlay kind, float opacity) {
  uint64_t h = image ^ 0x9E3779B97F4A7C15ull;
  auto mix = [&h](uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  for (float x : values) {
    uint32_t b = 0;
    std::memcpy(&b, &x, 4);
    mix(b);
  }
  mix(static_cast<uint64_t>(kind));
  mix(static_cast<uint64_t>(std::lround(opacity * 1000)));
  return h | (1ull << 63);
}

// A dim note wrapped at the panel's edge (a caption is never cut).
void wrapped_note(const std::string& text) {
  ImGui::PushStyleColor(ImGuiCol_Text, ImGui::GetStyleColorVec4(ImGuiCol_TextDisabled));
  ImGui::PushTextWrapPos(0);
  ImGui::TextUnformatted(text.c_str());
  ImGui::PopTextWrapPos();
  ImGui::PopStyleColor();
}

// The scale under the image: a swatch greyed and dimmed as a patch of each value would be,
// ticks at the ends (and the middle, or at each level of bits), the quantity below.
void colour_bar(const OverlayScale& sc, float opacity, ImVec2 at, float width, State& st) {
  ImDrawList* dl = ImGui::GetWindowDrawList();
  const float h = ImGui::GetTextLineHeight() * 0.8f;
  const int steps = 64;
  for (int i = 0; i < steps; ++i) {
    const double t = (i + 0.5) / steps;
    unsigned char rgb[3] = {230, 140, 40};  // a vivid swatch: vivid is "most", grey and dim "least"
    apply_veil(opacity * static_cast<float>(1.0 - t), rgb);
    const float x0 = at.x + width * i / steps, x1 = at.x + width * (i + 1) / steps;
    dl->AddRectFilled(ImVec2(x0, at.y), ImVec2(x1 + 0.5f, at.y + h), IM_COL32(rgb[0], rgb[1], rgb[2], 255));
  }
  dl->AddRect(at, ImVec2(at.x + width, at.y + h), IM_COL32(90, 90, 90, 255));
  std::vector<double> ticks = sc.levels;
  if (ticks.empty()) ticks = {sc.lo, 0.5 * (sc.lo + sc.hi), sc.hi};
  float last_end = -1e9f;
  const ImU32 ink = ImGui::GetColorU32(ImGuiCol_Text);
  for (double v : ticks) {
    const float x = at.x + width * static_cast<float>(overlay_position(sc, v));
    const std::string label = fig::format_value(v);
    const float tw = ImGui::CalcTextSize(label.c_str()).x;
    const float lx = std::clamp(x - tw / 2, at.x, at.x + width - tw);
    dl->AddLine(ImVec2(x, at.y + h), ImVec2(x, at.y + h + 3), ink);
    if (lx < last_end + 4) continue;  // would overlap the previous label
    dl->AddText(ImVec2(lx, at.y + h + 3), ink, label.c_str());
    last_end = lx + tw;
  }
  st.drawn["image_colorbar"] = {at.x, at.y, width, h};
  ImGui::Dummy(ImVec2(width, h + 3 + ImGui::GetTextLineHeight()));
  wrapped_note(sc.quantity);
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
  // The hint leads with the file's name, so a narrow window cuts the words after it.
  ImGui::SetNextItemWidth(-150 * figure_scale());
  const std::string hint = std::filesystem::path(app.default_image()).filename().string() + " (sample image)";
  if (path_field("##imgpath", hint.c_str(), st.edits.image_path, st.shown["image_path"]))
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
  // Each row's sliders as wide as their values (their share of the row at least), the combo the
  // rest (a quarter of the row at least): where the row has that room no value is cut, and a
  // combo's choice shows whole on hover.
  const float w = ImGui::GetContentRegionAvail().x, gap = ImGui::GetStyle().ItemSpacing.x;
  const float opacity_w = std::max(w * 0.26f, framed_width("opacity 0.00"));
  const float grid_w = ImGui::GetFrameHeight() + ImGui::GetStyle().ItemInnerSpacing.x + ImGui::CalcTextSize("grid").x;
  ImGui::SetNextItemWidth(std::max(w * 0.25f, w - opacity_w - grid_w - 2 * gap));
  const bool open = ImGui::BeginCombo("##overlay", overlays[ov]);
  preview_tooltip(app, overlays[ov]);  // (the combo's own item: before its list)
  if (open) {
    for (int i = 0; i < 5; ++i)
      if (ImGui::Selectable(overlays[i], i == ov)) v.overlay = static_cast<Overlay>(i);
    ImGui::EndCombo();
  }
  ImGui::SameLine();
  ImGui::SetNextItemWidth(opacity_w);
  slider_float(app, "##opacity", v.overlay_opacity, 0, 1, "opacity %.2f");
  ImGui::SameLine();
  ImGui::Checkbox("grid", &v.patch_grid);
  const int layers = s && s->model ? s->model->layers : 1, heads = s && s->model ? s->model->heads : 1;
  if (v.overlay != Overlay::None) {
    const float layer_w = std::max(w * 0.27f, framed_width("layer " + std::to_string(std::max(0, layers - 1))));
    const float head_w = v.overlay == Overlay::Attention ? framed_width("mean of heads") + gap : 0.0f;
    ImGui::SetNextItemWidth(std::max(w * 0.25f, w - layer_w - head_w - gap));
    instance_combo("##ovsrc", app, v.overlay_source, v.overlay == Overlay::Attention ? "full cache" : nullptr, true);
    ImGui::SameLine();
    ImGui::SetNextItemWidth(layer_w);
    slider_int(app, "##layer", v.layer, 0, std::max(0, layers - 1), "layer %d");
    if (v.overlay == Overlay::Attention) {
      ImGui::SameLine();
      ImGui::SetNextItemWidth(-1);
      slider_int(app, "##head", v.head, -1, std::max(0, heads - 1), v.head < 0 ? "mean of heads" : "head %d");
      token_slider("##token", app, v.overlay_source, v.token, "generated token");
    }
  }
  v.layer = std::clamp(v.layer, 0, std::max(0, layers - 1));

  // The image, square, as large as the panel allows, and at least kMinImageSide (or the panel's
  // width) where the panel is short: the panel then scrolls to its colour bar and notes.
  const ImVec2 avail = ImGui::GetContentRegionAvail();
  // Room below for the caption, and with an overlay its colour bar, ticks and quantity.
  const float below = ImGui::GetTextLineHeightWithSpacing() * (v.overlay == Overlay::None ? 1.0f : 5.0f);
  const float least = std::min(avail.x, kMinImageSide * figure_scale());
  const float side = std::max({64.0f, least, std::min(avail.x, avail.y - below)});
  st.drawn["image_panel"] = {ImGui::GetCursorScreenPos().x, ImGui::GetCursorScreenPos().y, avail.x, avail.y};
  const ImVec2 p0 = ImGui::GetCursorScreenPos();
  ImDrawList* dl = ImGui::GetWindowDrawList();
  if (s && s->base && s->base->shown.width > 0) {
    const RGBImage& img = s->base->shown;
    // The grid the overlays lie on (the tiles' for an anyres image), drawn over the image at the
    // image's own aspect within the side × side box.
    const VisualGrid g = overlay_grid(*s);
    const int R = g.rows, C = g.cols;
    const float dw = img.width >= img.height ? side : side * img.width / img.height;
    const float dh = img.width >= img.height ? side * img.height / img.width : side;
    const OverlayData ov = overlay_of(app, v.overlay_source);
    const bool shown = R > 0 && C > 0 && ov.values.size() > static_cast<size_t>(g.token(R - 1, C - 1)) && !ov.scale.empty();
    // The image itself, or with each patch veiled by its value (no hue: see app/gui/overlay.h).
    const uint64_t base_key = key_of(s->base->key);
    const uint64_t key = shown ? overlay_key(base_key, ov.values, v.overlay, v.overlay_opacity) : base_key;
    std::vector<uint8_t> rgba;
    if (!ui.textures.has(key)) {
      rgba.assign(static_cast<size_t>(img.width) * img.height * 4, 255);
      for (int y = 0; y < img.height; ++y)
        for (int x = 0; x < img.width; ++x) {
          const size_t i = static_cast<size_t>(y) * img.width + x;
          unsigned char* px = &rgba[i * 4];
          for (int c = 0; c < 3; ++c) px[c] = img.data[i * 3 + c];
          if (shown) {
            const int r = std::min(R - 1, y * R / img.height), c = std::min(C - 1, x * C / img.width);
            apply_veil(overlay_veil(ov.scale, ov.values[g.token(r, c)], v.overlay_opacity), px);
          }
        }
    }
    dl->AddImage(ui.textures.get(key, img.width, img.height, rgba.data(), false), p0, ImVec2(p0.x + dw, p0.y + dh));
    const float cw = C > 0 ? dw / C : dw, ch = R > 0 ? dh / R : dh;
    if (shown && v.overlay == Overlay::FateBits && std::min(cw, ch) >= 8)  // evicted patches crossed out
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          if (ov.values[g.token(r, c)] <= 0) {
            const ImVec2 a(p0.x + c * cw + cw * 0.3f, p0.y + r * ch + ch * 0.3f);
            const ImVec2 b(p0.x + (c + 1) * cw - cw * 0.3f, p0.y + (r + 1) * ch - ch * 0.3f);
            dl->AddLine(a, b, IM_COL32(235, 235, 235, 200));
            dl->AddLine(ImVec2(a.x, b.y), ImVec2(b.x, a.y), IM_COL32(235, 235, 235, 200));
          }
    if (R > 0 && C > 0 && v.patch_grid) {
      for (int i = 0; i <= C; ++i)
        dl->AddLine(ImVec2(p0.x + i * cw, p0.y), ImVec2(p0.x + i * cw, p0.y + dh), IM_COL32(255, 255, 255, 70));
      for (int i = 0; i <= R; ++i)
        dl->AddLine(ImVec2(p0.x, p0.y + i * ch), ImVec2(p0.x + dw, p0.y + i * ch), IM_COL32(255, 255, 255, 70));
      // Anyres tiles: their borders brighter (k · tile_side − cut patches in).
      if (g.tile_side > 0) {
        for (int x = g.tile_side - g.cut_left; x < C; x += g.tile_side)
          if (x > 0) dl->AddLine(ImVec2(p0.x + x * cw, p0.y), ImVec2(p0.x + x * cw, p0.y + dh), IM_COL32(255, 255, 255, 190), 2.0f);
        for (int y = g.tile_side - g.cut_top; y < R; y += g.tile_side)
          if (y > 0) dl->AddLine(ImVec2(p0.x, p0.y + y * ch), ImVec2(p0.x + dw, p0.y + y * ch), IM_COL32(255, 255, 255, 190), 2.0f);
      }
    }
    ImGui::InvisibleButton("##imagearea", ImVec2(dw, dh));
    st.drawn["image"] = {p0.x, p0.y, dw, dh};
    if (ImGui::IsItemHovered() && R > 0 && C > 0) {
      const ImVec2 m = ImGui::GetIO().MousePos;
      const int hc = std::clamp(static_cast<int>((m.x - p0.x) / cw), 0, C - 1);
      const int hr = std::clamp(static_cast<int>((m.y - p0.y) / ch), 0, R - 1);
      const int tok = g.token(hr, hc);
      ImGui::BeginTooltip();
      st.hover_readout = {"patch row " + std::to_string(hr) + ", column " + std::to_string(hc) + " (visual token " +
                          std::to_string(tok) + (g.name == "tiles" ? ", tiles grid" : "") + ")"};
      ImGui::TextUnformatted(st.hover_readout.back().c_str());
      if (v.overlay != Overlay::None) {
        // The same patch for every source that has results, the one shown first.
        for (int id : overlay_sources(app)) {
          const OverlayData o = id == v.overlay_source ? ov : overlay_of(app, id);
          if (o.values.size() <= static_cast<size_t>(tok)) continue;
          const MethodInstance* mi = id >= 0 ? app.find(id) : nullptr;
          const std::string who = id < 0 ? "full cache" : mi ? app.display_name(*mi) : "?";
          const std::string text = who + ": " + fig::format_value(o.values[tok]);
          st.hover_readout.push_back(id == v.overlay_source ? text + "  (shown)" : text);
          if (id == v.overlay_source) ImGui::TextUnformatted(st.hover_readout.back().c_str());
          else ImGui::TextDisabled("%s", text.c_str());
        }
      }
      ImGui::EndTooltip();
    }
    if (shown) {
      colour_bar(ov.scale, v.overlay_opacity, ImGui::GetCursorScreenPos(), side, st);
      wrapped_note(ov.what);
    } else {
      st.drawn.erase("image_colorbar");
      const VisualLayout* layout = s->base->ex ? &s->base->ex->prefill.layout : nullptr;
      const std::string grid = layout && layout->grids.size() > 1 ? layout->describe() + " visual tokens"
                                                                  : std::to_string(R) + "×" + std::to_string(C) + " patches";
      wrapped_note(std::to_string(img.width) + "×" + std::to_string(img.height) + ", " + grid);
    }
  } else if (s && s->model && s->model->visual_tokens == 0 && s->model->dir == app.model_dir()) {
    // A text-only model: no image; its "visual" tokens are the prompt span the template marks.
    st.drawn.erase("image_colorbar");
    const int span = s->base && s->base->ex ? s->base->ex->prefill.n_visual : 0;
    wrapped_note("A text-only model takes no image. What the methods treat as visual tokens is the span of the prompt "
                 "the session's template marks with <span> … </span>" +
                 std::string(span > 0 ? ": " + std::to_string(span) + " tokens here." : "; this one marks none."));
  } else {
    dl->AddRectFilled(p0, ImVec2(p0.x + side, p0.y + side), IM_COL32(220, 220, 225, 255));
    ImGui::Dummy(ImVec2(side, side));
    ImGui::TextDisabled("%s", app.busy() ? "running vision and prefill…" : "no image");
  }
  ImGui::End();
}

}  // namespace kvlens::gui
