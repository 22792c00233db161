// Methods panel: add / remove / duplicate / reorder / enable method instances, all on the one
// cached prefill. Each instance's widgets come from its method's parameter schema (ParamSpec):
// sliders for ranges, combos for choices, check boxes for flags, the schema's help line (with
// the paper's formula) as the tooltip; presets and reset to defaults. A stack shows its two
// stages, each with the widgets of the method chosen for it. A value the schema refuses (typed
// out of range with Ctrl+click) is shown under the widgets and not applied.
#include <imgui.h>
#include <imgui_stdlib.h>  // after imgui.h

#include <cmath>
#include <cstring>
#include <cstdio>

#include "app/gui/panels.h"
#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens::gui {

namespace {

std::string short_float(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

void tooltip(const std::string& help) {
  if (!ImGui::IsItemHovered() || help.empty()) return;
  ImGui::BeginTooltip();
  ImGui::PushTextWrapPos(ImGui::GetFontSize() * 34.0f);
  ImGui::TextUnformatted(help.c_str());
  ImGui::PopTextWrapPos();
  ImGui::EndTooltip();
}

// Undo bookkeeping around the widget just drawn: a drag or typing is one step.
void track(App& app) {
  if (ImGui::IsItemActivated()) app.begin_edit();
  if (ImGui::IsItemDeactivated()) app.end_edit();
}

// The text being typed into field `key`: follows `value` except while the field is active.
std::string& text_buffer(App& app, const std::string& key, const std::string& value) {
  std::string& buf = app.st.edits.param_text[key];
  if (app.st.edits.active_text != key) buf = value;
  return buf;
}

void track_text(App& app, const std::string& key) {
  if (ImGui::IsItemActivated()) app.st.edits.active_text = key;
  if (ImGui::IsItemDeactivated() && app.st.edits.active_text == key) app.st.edits.active_text.clear();
}

}  // namespace

// A parameter's name as the papers and the Calibration panel write it: tau1 → τ1, alpha2 → α2.
std::string shown_name(const std::string& name) {
  static const std::pair<const char*, const char*> kGreek[] = {
      {"tau", "τ"}, {"alpha", "α"}, {"beta", "β"}, {"gamma", "γ"}, {"delta", "δ"}};
  for (const auto& [word, letter] : kGreek) {
    const size_t n = std::strlen(word);
    if (name.compare(0, n, word) == 0 && name.find_first_not_of("0123456789", n) == std::string::npos)
      return letter + name.substr(n);
  }
  return name;
}

namespace {

// One parameter widget, typed by `p` (the schema of the method that owns the value), writing
// to `target` of instance `m`. `value` is the current text ("default" = p's default).
void param_widget(App& app, const MethodInstance& m, const ParamSpec& p, const std::string& target, std::string value) {
  const int id = m.id;
  if (value == "default") value = p.def;
  const std::string label = shown_name(p.name) + "##" + target;
  ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.62f);
  switch (p.type) {
    case ParamSpec::Type::Int: {
      int v = static_cast<int>(std::lround(parse_real(value, p.name, -1e18, 1e18)));
      const bool slider = p.max - p.min <= 4096;
      const bool changed = slider ? ImGui::SliderInt(label.c_str(), &v, static_cast<int>(p.min), static_cast<int>(p.max))
                                  : ImGui::InputInt(label.c_str(), &v, 1, 100, ImGuiInputTextFlags_EnterReturnsTrue);
      tooltip(p.help + "\nrange " + range_text(p.min, p.max) + ", default " + p.def);
      track(app);
      if (changed) app.set_param(id, target, std::to_string(v));
      break;
    }
    case ParamSpec::Type::Float: {
      float v = static_cast<float>(parse_real(value, p.name, -1e300, 1e300));
      const ImGuiSliderFlags flags = p.min > 0 && p.max / p.min >= 100 ? ImGuiSliderFlags_Logarithmic : 0;
      const bool changed = ImGui::SliderFloat(label.c_str(), &v, static_cast<float>(p.min), static_cast<float>(p.max), "%.3g", flags);
      tooltip(p.help + "\nrange " + range_text(p.min, p.max) + ", default " + p.def + " (Ctrl+click to type)");
      track(app);
      if (changed) app.set_param(id, target, short_float(v));
      break;
    }
    case ParamSpec::Type::Bool: {
      bool v = value == "on" || value == "true" || value == "1" || value == "yes";
      if (ImGui::Checkbox(label.c_str(), &v)) {
        app.begin_edit();
        app.set_param(id, target, v ? "on" : "off");
        app.end_edit();
      }
      tooltip(p.help);
      break;
    }
    case ParamSpec::Type::Choice: {
      const bool open = ImGui::BeginCombo(label.c_str(), value.c_str());
      help_tooltip(app, value, p.help);  // (the combo's own item: before its list)
      if (open) {
        for (const std::string& c : p.choices)
          if (ImGui::Selectable(c.c_str(), c == value)) {
            app.begin_edit();
            app.set_param(id, target, c);
            app.end_edit();
          }
        ImGui::EndCombo();
      }
      break;
    }
    case ParamSpec::Type::String: {
      std::string& buf = text_buffer(app, std::to_string(id) + "/" + target, value);
      if (ImGui::InputText(label.c_str(), &buf, ImGuiInputTextFlags_EnterReturnsTrue)) {
        app.begin_edit();
        if (!app.set_param(id, target, buf)) buf = value;
        app.end_edit();
      }
      track_text(app, std::to_string(id) + "/" + target);
      tooltip(p.help + " (Enter applies)");
      break;
    }
  }
}

const ParamSpec* find_spec(const MethodSpec& m, const std::string& name) {
  for (const ParamSpec& p : m.params)
    if (p.name == name) return &p;
  return nullptr;
}

// A stack's stage: its method combo, preset, and that method's own parameters (written to the
// stack's pass-through value of the same name, or "evict.<name>" / "quant.<name>").
void stack_stage(App& app, const MethodInstance& m, const MethodSpec& stack, const char* side, const char* title) {
  const std::string choice = m.params.str(side);
  ImGui::Separator();
  ImGui::TextDisabled("%s", title);
  param_widget(app, m, *find_spec(stack, side), side, choice);
  if (choice == "none") return;
  param_widget(app, m, *find_spec(stack, std::string(side) + "_preset"), std::string(side) + "_preset",
               m.params.str(std::string(side) + "_preset"));
  const MethodSpec& inner = find_method(choice);
  for (const ParamSpec& p : inner.params) {
    const std::string scoped = std::string(side) + "." + p.name;
    const std::string target = find_spec(stack, scoped) ? scoped : p.name;
    if (!find_spec(stack, target)) continue;
    param_widget(app, m, p, target, m.params.str(target));
  }
}

}  // namespace

void methods_panel(App& app, Ui&, const PanelRect& rect) {
  if (!begin_panel("Methods", rect)) {
    ImGui::End();
    return;
  }
  State& st = app.st;
  const std::vector<MethodSpec>& all = methods();
  ImGui::SetNextItemWidth(150 * figure_scale());
  const bool open = ImGui::BeginCombo("##add", all[st.edits.add_method].name.c_str());
  help_tooltip(app, all[st.edits.add_method].name, all[st.edits.add_method].summary);
  if (open) {
    for (size_t i = 0; i < all.size(); ++i)
      if (ImGui::Selectable((all[i].name + "  [" + all[i].family + "]").c_str(), static_cast<int>(i) == st.edits.add_method))
        st.edits.add_method = static_cast<int>(i);
    ImGui::EndCombo();
  }
  ImGui::SameLine();
  if (ImGui::Button("Add")) {
    app.begin_edit();
    st.views.method = st.scroll_to_method = app.add_method(make_params(all[st.edits.add_method].name, "", {}));
    app.end_edit();
  }
  ImGui::SameLine();
  ImGui::TextDisabled("%zu instances on one prefill", st.methods.size());
  ImGui::Separator();
  ImGui::BeginChild("##instances");
  int remove = -1, duplicate = -1, up = -1, down = -1;
  for (const MethodInstance& m : std::vector<MethodInstance>(st.methods)) {
    ImGui::PushID(m.id);
    bool on = m.enabled;
    if (ImGui::Checkbox("##on", &on)) app.set_enabled(m.id, on);
    tooltip("enabled: runs on the shared prefill");
    ImGui::SameLine();
    const RunResult* r = app.result(m.id);
    const bool failed = st.results && st.results->run_errors.count(m.id);
    std::string status = !m.enabled ? "off" : r ? "" : failed ? "error" : !app.blocked().empty() ? "not run" : "computing…";
    const std::string head = app.display_name(m) + (status.empty() ? "" : "  (" + status + ")") + "###hdr";
    const bool selected = st.views.method == m.id;
    if (selected) ImGui::PushStyleColor(ImGuiCol_Header, ImVec4(0.62f, 0.75f, 0.93f, 1));
    const bool open = ImGui::CollapsingHeader(head.c_str(), selected ? ImGuiTreeNodeFlags_DefaultOpen : 0);
    if (selected) ImGui::PopStyleColor();
    if (m.id == st.scroll_to_method) {  // just added: brought into view (as little scrolling as it takes)
      if (!ImGui::IsItemVisible()) ImGui::SetScrollHereY(1.0f);
      st.scroll_to_method = -1;
    }
    // (each instance's header where it is in view, for scripted checks)
    const std::string key = "method " + std::to_string(m.id);
    if (ImGui::IsItemVisible())
      st.drawn[key] = {ImGui::GetItemRectMin().x, ImGui::GetItemRectMin().y, ImGui::GetItemRectSize().x, ImGui::GetItemRectSize().y};
    else
      st.drawn.erase(key);
    if (ImGui::IsItemClicked()) st.views.method = m.id;
    if (open) {
      ImGui::Indent(8);
      const MethodSpec& spec = find_method(m.params.method());
      fitted_text(app, spec.summary, true);
      const std::string lkey = "label/" + std::to_string(m.id);
      std::string& label = text_buffer(app, lkey, m.label);
      ImGui::SetNextItemWidth(ImGui::GetContentRegionAvail().x * 0.62f);
      if (ImGui::InputTextWithHint("label", m.params.short_spec().c_str(), &label, ImGuiInputTextFlags_EnterReturnsTrue))
        app.set_label(m.id, label);
      track_text(app, lkey);
      if (spec.family == "composition") {
        stack_stage(app, m, spec, "evict", "stage 1: eviction / merge");
        stack_stage(app, m, spec, "quant", "stage 2: quantization of the kept rows");
      } else {
        for (const ParamSpec& p : spec.params) param_widget(app, m, p, p.name, m.params.str(p.name));
      }
      if (!spec.presets.empty()) {
        ImGui::SetNextItemWidth(120 * figure_scale());
        if (ImGui::BeginCombo("##preset", "preset…")) {
          for (const auto& [name, values] : spec.presets) {
            std::string what;
            for (const auto& [k, v] : values) what += (what.empty() ? "" : ", ") + k + "=" + v;
            if (ImGui::Selectable(name.c_str())) app.apply_preset(m.id, name);
            tooltip(what);
          }
          ImGui::EndCombo();
        }
        ImGui::SameLine();
      }
      if (ImGui::SmallButton("reset")) app.reset_method(m.id);
      ImGui::SameLine();
      if (ImGui::SmallButton("duplicate")) duplicate = m.id;
      ImGui::SameLine();
      if (ImGui::SmallButton("up")) up = m.id;
      ImGui::SameLine();
      if (ImGui::SmallButton("down")) down = m.id;
      ImGui::SameLine();
      if (ImGui::SmallButton("remove")) remove = m.id;
      if (!m.error.empty()) {
        ImGui::PushTextWrapPos(0);
        ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "%s", m.error.c_str());
        ImGui::PopTextWrapPos();
      }
      if (failed) {
        ImGui::PushTextWrapPos(0);
        ImGui::TextColored(ImVec4(0.75f, 0.1f, 0.1f, 1), "%s", st.results->run_errors.at(m.id).c_str());
        ImGui::PopTextWrapPos();
      }
      if (r) ImGui::TextDisabled("computed in %.0f ms", r->ms);
      ImGui::Unindent(8);
    }
    ImGui::PopID();
  }
  ImGui::EndChild();
  if (duplicate >= 0) app.duplicate_method(duplicate);
  if (up >= 0) app.move_method(up, -1);
  if (down >= 0) app.move_method(down, 1);
  if (remove >= 0) app.remove_method(remove);
  ImGui::End();
}

}  // namespace kvlens::gui
