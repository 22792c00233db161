#include "app/gui/figure_imgui.h"

#include <GLFW/glfw3.h>

#include <algorithm>
#include <cmath>

namespace kvlens::gui {

namespace {

using fig::Prim;

ImU32 col(const fig::Color& c) {
  return IM_COL32(static_cast<int>(std::lround(c.r * 255)), static_cast<int>(std::lround(c.g * 255)),
                  static_cast<int>(std::lround(c.b * 255)), static_cast<int>(std::lround(c.a * 255)));
}

ImVec2 at(ImVec2 o, double x, double y) { return ImVec2(o.x + static_cast<float>(x), o.y + static_cast<float>(y)); }

// A polyline as dashes of 5 px with gaps of 3.5 px along its length.
void dashed(ImDrawList* dl, const std::vector<ImVec2>& pts, ImU32 c, float w) {
  const float on = 5.0f, off = 3.5f;
  float phase = 0;  // distance into the current on+off period
  for (size_t i = 1; i < pts.size(); ++i) {
    const ImVec2 a = pts[i - 1], b = pts[i];
    const float len = std::hypot(b.x - a.x, b.y - a.y);
    float t = 0;
    while (t < len) {
      const bool drawing = phase < on;
      const float step = std::min(len - t, drawing ? on - phase : on + off - phase);
      if (drawing) {
        const ImVec2 p0(a.x + (b.x - a.x) * t / len, a.y + (b.y - a.y) * t / len);
        const ImVec2 p1(a.x + (b.x - a.x) * (t + step) / len, a.y + (b.y - a.y) * (t + step) / len);
        dl->AddLine(p0, p1, c, w);
      }
      t += step;
      phase = std::fmod(phase + step, on + off);
    }
  }
}

void text(ImDrawList* dl, const Prim& p, ImVec2 o) {
  ImFont* font = ImGui::GetFont();
  const float size = static_cast<float>(p.size);
  const float w = static_cast<float>(imgui_text_width(p.text, p.size));
  const float dx = p.halign < 0 ? 0 : p.halign == 0 ? -w / 2 : -w;
  const float dy = p.valign < 0 ? 0 : p.valign == 0 ? -size / 2 : -size;
  const ImVec2 pivot = at(o, p.pts[0].x, p.pts[0].y);
  if (!p.vertical) {
    dl->AddText(font, size, ImVec2(pivot.x + dx, pivot.y + dy), col(p.color), p.text.c_str());
    return;
  }
  // Vertical: laid out horizontally (unclipped, since ImGui drops glyphs outside the clip
  // rectangle as it adds them), then turned 90° anticlockwise about the anchor.
  dl->PushClipRectFullScreen();
  const int start = dl->VtxBuffer.Size;
  dl->AddText(font, size, ImVec2(pivot.x + dx, pivot.y + dy), col(p.color), p.text.c_str());
  for (int i = start; i < dl->VtxBuffer.Size; ++i) {
    ImVec2& v = dl->VtxBuffer[i].pos;
    const float x = v.x - pivot.x, y = v.y - pivot.y;
    v = ImVec2(pivot.x + y, pivot.y - x);
  }
  dl->PopClipRect();
}

float g_scale = 1.0f;

// The primitives magnified by s about the origin: positions, line widths, radii, text sizes.
std::vector<Prim> magnified(const std::vector<Prim>& prims, double s) {
  std::vector<Prim> out = prims;
  for (Prim& p : out) {
    for (fig::Point& q : p.pts) q = {q.x * s, q.y * s};
    p.rect = {p.rect.x0 * s, p.rect.y0 * s, p.rect.x1 * s, p.rect.y1 * s};
    p.width *= s;
    p.size *= s;
  }
  return out;
}

}  // namespace

void set_figure_scale(float scale) { g_scale = std::clamp(scale, 0.5f, 4.0f); }
float figure_scale() { return g_scale; }

double figure_magnification(ImVec2 size) {
  const double room = std::min(size.x / g_scale / 720.0, size.y / g_scale / 450.0);
  return g_scale * std::clamp(room, 1.0, 3.0);
}

double imgui_text_width(const std::string& s, double size) {
  return ImGui::GetFont()->CalcTextSizeA(static_cast<float>(size), FLT_MAX, 0.0f, s.c_str()).x;
}

TextureCache::~TextureCache() {
  for (auto& [k, e] : entries_) glDeleteTextures(1, &e.tex);
}

ImTextureID TextureCache::get(uint64_t key, int w, int h, const uint8_t* rgba, bool nearest) {
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    Entry e;
    glGenTextures(1, &e.tex);
    glBindTexture(GL_TEXTURE_2D, e.tex);
    const GLint filter = nearest ? GL_NEAREST : GL_LINEAR;
    glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_MIN_FILTER, filter);
    glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_MAG_FILTER, filter);
    glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_WRAP_S, GL_CLAMP_TO_EDGE);
    glTexParameteri(GL_TEXTURE_2D, GL_TEXTURE_WRAP_T, GL_CLAMP_TO_EDGE);
    glPixelStorei(GL_UNPACK_ALIGNMENT, 1);
    glTexImage2D(GL_TEXTURE_2D, 0, GL_RGBA, w, h, 0, GL_RGBA, GL_UNSIGNED_BYTE, rgba);
    it = entries_.emplace(key, e).first;
  }
  it->second.last_used = frame_;
  return reinterpret_cast<ImTextureID>(static_cast<intptr_t>(it->second.tex));
}

void TextureCache::end_frame() {
  ++frame_;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (frame_ - it->second.last_used > 300) {
      glDeleteTextures(1, &it->second.tex);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

void draw_prims(ImDrawList* dl, const std::vector<Prim>& prims, ImVec2 o, TextureCache& textures) {
  for (const Prim& p : prims) {
    switch (p.type) {
      case Prim::Type::Polyline: {
        if (p.pts.size() < 2) break;
        std::vector<ImVec2> pts;
        for (const fig::Point& q : p.pts) pts.push_back(at(o, q.x, q.y));
        if (p.dashed) dashed(dl, pts, col(p.color), static_cast<float>(p.width));
        else dl->AddPolyline(pts.data(), static_cast<int>(pts.size()), col(p.color), 0, static_cast<float>(p.width));
        break;
      }
      case Prim::Type::FillRect:
        dl->AddRectFilled(at(o, p.rect.x0, p.rect.y0), at(o, p.rect.x1, p.rect.y1), col(p.color));
        break;
      case Prim::Type::StrokeRect:
        dl->AddRect(at(o, p.rect.x0, p.rect.y0), at(o, p.rect.x1, p.rect.y1), col(p.color), 0, 0, static_cast<float>(p.width));
        break;
      case Prim::Type::Circle:
        dl->AddCircleFilled(at(o, p.pts[0].x, p.pts[0].y), static_cast<float>(p.width), col(p.color), 16);
        break;
      case Prim::Type::Text:
        text(dl, p, o);
        break;
      case Prim::Type::Image:
        if (p.image_w > 0 && p.image_h > 0)
          dl->AddImage(textures.get(p.image_key, p.image_w, p.image_h, p.rgba.data()), at(o, p.rect.x0, p.rect.y0),
                       at(o, p.rect.x1, p.rect.y1));
        break;
      case Prim::Type::Clip:
        dl->PushClipRect(at(o, p.rect.x0, p.rect.y0), at(o, p.rect.x1, p.rect.y1), true);
        break;
      case Prim::Type::Unclip:
        dl->PopClipRect();
        break;
    }
  }
}

bool draw_figure(const char* id, const fig::Figure& f, ImVec2 size, fig::View& view, TextureCache& textures,
                 fig::Axis* drawn_y) {
  size.x = std::max(size.x, 120.0f);
  size.y = std::max(size.y, 90.0f);
  const ImVec2 origin = ImGui::GetCursorScreenPos();
  ImGui::InvisibleButton(id, size);
  const bool hovered = ImGui::IsItemHovered();
  const bool active = ImGui::IsItemActive();
  // Laid out at the logical size, drawn magnified by the UI scale; the pointer in logical pixels.
  // Where the panel gives a figure more room than the exports' 720 × 450, its text, lines and
  // markers grow with it (up to 3×), so that it reads as the exported figure does at any size.
  const double k = figure_magnification(size);
  const fig::Frame fr = fig::draw(f, size.x / k, size.y / k, imgui_text_width, view);
  if (drawn_y) *drawn_y = fr.y;
  ImDrawList* dl = ImGui::GetWindowDrawList();
  dl->PushClipRect(origin, ImVec2(origin.x + size.x, origin.y + size.y), true);
  draw_prims(dl, k == 1 ? fr.prims : magnified(fr.prims, k), origin, textures);
  const ImGuiIO& io = ImGui::GetIO();
  const double mx = (io.MousePos.x - origin.x) / k, my = (io.MousePos.y - origin.y) / k;
  const bool in_plot = fr.plot.contains(mx, my);
  // A click on a series' legend entry hides or shows it.
  if (hovered && ImGui::IsMouseClicked(ImGuiMouseButton_Left))
    for (const auto& [r, label] : fr.legend_series)
      if (r.contains(mx, my) && !view.hidden.erase(label)) view.hidden.insert(label);
  // Right-click: the y scale, every series back, the view reset.
  const std::string menu = std::string(id) + "##view";
  if (hovered && ImGui::IsMouseClicked(ImGuiMouseButton_Right)) ImGui::OpenPopup(menu.c_str());
  if (ImGui::BeginPopup(menu.c_str())) {
    ImGui::TextDisabled("y axis");
    for (fig::YScale s : {fig::YScale::AsBuilt, fig::YScale::Linear, fig::YScale::Log})
      if (ImGui::MenuItem(fig::y_scale_name(s), nullptr, view.y_scale == s)) {
        view.y_scale = s;
        view.y_zoomed = false;
      }
    ImGui::Separator();
    if (ImGui::MenuItem("show every series", nullptr, false, !view.hidden.empty())) view.hidden.clear();
    if (ImGui::MenuItem("reset zoom and scale")) view.reset_zoom();
    ImGui::EndPopup();
  }
  if (hovered && in_plot) {
    // Zoom about the pointer (wheel), pan (drag), reset (double-click); x only.
    const double frac = (mx - fr.plot.x0) / fr.plot.width();
    auto set_range = [&](double f0, double f1) {
      const double a = fig::axis_value(fr.x, f0), b = fig::axis_value(fr.x, f1);
      if (std::isfinite(a) && std::isfinite(b) && b > a) {
        view.zoomed = true;
        view.x_min = a;
        view.x_max = b;
      }
    };
    if (io.MouseWheel != 0 && io.KeyShift && !fr.y.inverted) {
      // The y axis about the pointer (fractions from the bottom).
      const double fy = (fr.plot.y1 - my) / fr.plot.height(), s = std::pow(0.85, io.MouseWheel);
      const double a = fig::axis_value(fr.y, fy - fy * s), b = fig::axis_value(fr.y, fy + (1 - fy) * s);
      if (std::isfinite(a) && std::isfinite(b) && b > a && (!fr.y.log || a > 0)) {
        view.y_zoomed = true;
        view.y_min = a;
        view.y_max = b;
      }
    } else if (io.MouseWheel != 0) {
      const double s = std::pow(0.85, io.MouseWheel);
      set_range(frac - frac * s, frac + (1 - frac) * s);
    }
    if (active && io.MouseDelta.x != 0) {
      const double d = -io.MouseDelta.x / k / fr.plot.width();
      set_range(d, 1 + d);
    }
    if (ImGui::IsMouseDoubleClicked(ImGuiMouseButton_Left)) view.reset_zoom();
    const float x = origin.x + static_cast<float>(mx * k);
    dl->AddLine(ImVec2(x, origin.y + static_cast<float>(fr.plot.y0 * k)), ImVec2(x, origin.y + static_cast<float>(fr.plot.y1 * k)),
                IM_COL32(90, 90, 110, 120));
    const std::vector<std::string> lines = fig::readout(f, fr, mx, my);
    ImGui::BeginTooltip();
    ImGui::Text("x = %s, y = %s", fig::format_value(fr.data_x(mx)).c_str(), fig::format_value(fr.data_y(my)).c_str());
    for (const std::string& l : lines) ImGui::TextUnformatted(l.c_str());
    ImGui::TextDisabled("wheel: zoom x · Shift+wheel: zoom y · drag: pan · double-click: reset\n"
                        "legend entry: hide / show · right-click: y scale (linear / log)");
    ImGui::EndTooltip();
  }
  dl->PopClipRect();
  return hovered;
}

}  // namespace kvlens::gui
