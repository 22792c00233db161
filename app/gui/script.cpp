#include "app/gui/script.h"

#include "app/figures/figures_report.h"
#include "app/gui/overlay.h"
#include "app/gui/panels.h"

#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "core/errors.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/numbers.h"

namespace kvlens::gui {

namespace {

// Each step and its arguments: name → (required, optional).
const std::map<std::string, std::pair<std::vector<std::string>, std::vector<std::string>>>& step_table() {
  static const std::map<std::string, std::pair<std::vector<std::string>, std::vector<std::string>>> t = {
      {"open_image", {{"path"}, {}}},
      {"open_model", {{"path"}, {}}},
      {"open_session", {{"path"}, {}}},
      {"save_session", {{"path"}, {}}},
      {"new_session", {{}, {}}},
      {"export_report", {{"path"}, {}}},
      {"add_method", {{"spec"}, {"label"}}},
      {"remove_method", {{"method"}, {}}},
      {"set_enabled", {{"method", "enabled"}, {}}},
      {"set_param", {{"method", "name", "value"}, {}}},
      {"drag_param", {{"method", "name", "from", "to"}, {"frames"}}},
      {"undo", {{}, {}}},
      {"redo", {{}, {}}},
      {"select",
       {{},
        {"plot", "layer", "head", "method", "calib_method", "heatmap_method", "overlay", "overlay_opacity", "token",
         "hit_step", "overlay_source", "patch_grid", "table_sort", "table_descending", "calib_layer", "calib_head",
         "heatmap_layer", "link_views", "multiples_source", "multiples_token"}}},
      {"plot_view", {{}, {"hide", "show", "y_scale", "y_range"}}},
      {"show_log", {{}, {"open"}}},
      {"ui_scale", {{"value"}, {}}},
      {"wait_results", {{}, {"timeout_s"}}},
      {"frames", {{"n"}, {}}},
      {"hover", {{"over", "x", "y"}, {}}},
      {"screenshot", {{"path"}, {}}},
      {"export_figures", {{"dir"}, {"formats", "csv", "all", "wait"}}},
      {"cancel_export", {{}, {}}},
      {"dump_state", {{"path"}, {}}},
      {"expect_message", {{"contains"}, {}}},
      {"timing", {{}, {"label"}}},
      {"quit", {{}, {}}},
  };
  return t;
}

std::string text_arg(const nlohmann::json& step, const char* key, const std::string& where) {
  if (!step[key].is_string()) throw InputError(where + ": '" + key + "' must be a string, got " + step[key].dump());
  return step[key].get<std::string>();
}

// A parameter value from JSON: strings as they are, numbers shortest, booleans as on/off.
std::string value_text(const nlohmann::json& v, const std::string& where) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "on" : "off";
  if (v.is_number()) return format_number(json_real(v, where, -1e300, 1e300));
  throw InputError(where + " must be a string, number or boolean, got " + v.dump());
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

Script Script::load(const std::string& path) {
  Script s;
  s.file_ = path;
  const nlohmann::json j = read_json_file(path, "script");
  if (!j.is_object() || !j.contains("steps") || !j["steps"].is_array())
    throw InputError(path + ": a script is {\"steps\": [{\"do\": ...}, ...]}");
  for (size_t i = 0; i < j["steps"].size(); ++i) {
    const nlohmann::json& st = j["steps"][i];
    const std::string where = path + ": steps[" + std::to_string(i) + "]";
    if (!st.is_object() || !st.contains("do") || !st["do"].is_string())
      throw InputError(where + ": a step is an object with \"do\"");
    const std::string op = st["do"].get<std::string>();
    auto it = step_table().find(op);
    if (it == step_table().end()) throw InputError(where + ": unknown step '" + op + "'");
    for (const std::string& k : it->second.first)
      if (!st.contains(k)) throw InputError(where + ": '" + op + "' needs '" + k + "'");
    for (auto a = st.begin(); a != st.end(); ++a) {
      const auto& req = it->second.first;
      const auto& opt = it->second.second;
      if (a.key() != "do" && std::find(req.begin(), req.end(), a.key()) == req.end() &&
          std::find(opt.begin(), opt.end(), a.key()) == opt.end())
        throw InputError(where + ": '" + op + "' takes no '" + a.key() + "'");
    }
    for (const char* k : {"path", "dir", "spec", "name", "label", "contains", "over"})
      if (st.contains(k)) text_arg(st, k, where);
    if (st.contains("n")) json_int(st["n"], where + ": n", 0, 100000);
    if (st.contains("frames")) json_int(st["frames"], where + ": frames", 1, 100000);
    if (st.contains("timeout_s")) json_real(st["timeout_s"], where + ": timeout_s", 0, 3600);
    if (op == "hover")
      for (const char* k : {"x", "y"}) json_real(st[k], where + ": " + k, 0, 1);
    if (op == "add_method") parse_method_spec(st["spec"].get<std::string>());
    s.steps_.push_back(st);
  }
  return s;
}

Script Script::screenshot_only(const std::string& path) {
  Script s;
  s.file_ = "--screenshot";
  s.steps_ = {{{"do", "wait_results"}}, {{"do", "screenshot"}, {"path", path}}, {{"do", "quit"}}};
  return s;
}

void Script::fail(const std::string& what) {
  failed_ = true;
  failure_ = what;
  pc_ = steps_.size();
  wait_frames_ = 0;
  shot_path_.clear();
  shot_ready_ = false;
}

void Script::screenshot_taken() {
  shot_path_.clear();
  shot_ready_ = false;
}

int Script::method_id(App& app, const nlohmann::json& ref) {
  if (ref.is_string()) {
    for (const MethodInstance& m : app.st.methods)
      if (m.label == ref.get<std::string>() || app.display_name(m) == ref.get<std::string>()) return m.id;
    throw InputError("no method labelled '" + ref.get<std::string>() + "'");
  }
  const int i = json_int(ref, "method", 0, 100000);
  if (i >= static_cast<int>(app.st.methods.size()))
    throw InputError("method " + std::to_string(i) + " does not exist (" + std::to_string(app.st.methods.size()) + " methods)");
  return app.st.methods[i].id;
}

void Script::before_frame(App& app) {
  if (failed_) return;
  Timing& t = app.st.timing;
  t.measuring = !drag_.is_null() && app.busy();
  if (t.measuring) {
    ++t.busy_frames;
    t.busy_seconds += ImGui::GetIO().DeltaTime;
  }
  ++t.frames;
  if (!drag_.is_null()) {  // one slider value per frame, then release
    const int n = drag_.value("frames", 10);
    const double a = drag_["from"].get<double>(), b = drag_["to"].get<double>();
    const int id = method_id(app, drag_["method"]);
    if (drag_frame_ == 0) {
      app.begin_edit();
      drag_shown_.clear();
    }
    app.set_param(id, drag_["name"].get<std::string>(), format_number(a + (b - a) * (drag_frame_ + 1) / n));
    // What the dragged instance is called on screen, frame by frame (dump_state's "drag_shown").
    if (const MethodInstance* m = app.find(id)) {
      const std::string shown = app.display_name(*m);
      if (std::find(drag_shown_.begin(), drag_shown_.end(), shown) == drag_shown_.end()) drag_shown_.push_back(shown);
    }
    if (++drag_frame_ >= n) {
      app.end_edit();
      drag_ = nullptr;
    }
    return;
  }
  if (wait_frames_ > 0) {
    --wait_frames_;
    return;
  }
  if (!shot_path_.empty()) {  // a screenshot waits for the frame to settle
    if (++settled_frames_ >= 2) shot_ready_ = true;
    return;
  }
  if (waiting_results_) {
    if (app.up_to_date()) {
      if (++settled_frames_ < 3) return;  // let the panels show the results
      waiting_results_ = false;
    } else if (const std::string why = app.blocked(); !why.empty()) {
      fail(file_ + ": wait_results: nothing can be computed: " + why);
      return;
    } else {
      settled_frames_ = 0;
      if (app.now() > wait_deadline_) fail(file_ + ": wait_results timed out");
      return;
    }
  }
  while (pc_ < steps_.size() && !failed_) {
    const nlohmann::json step = steps_[pc_++];
    try {
      run(app, step);
    } catch (const InputError& e) {
      fail(file_ + ": steps[" + std::to_string(pc_ - 1) + "] (" + step["do"].get<std::string>() + "): " + e.what());
      return;
    }
    if (waiting_results_ || wait_frames_ > 0 || !shot_path_.empty() || !drag_.is_null()) return;
  }
}

void Script::run(App& app, const nlohmann::json& st) {
  const std::string op = st["do"].get<std::string>();
  auto path = [&](const char* k) { return st[k].get<std::string>(); };
  if (op == "open_image") app.open_image(path("path"));
  else if (op == "open_model") app.open_model(path("path"));
  else if (op == "open_session") app.open_session(path("path"));
  else if (op == "save_session") app.save_session(path("path"));
  else if (op == "new_session") app.new_session();
  else if (op == "export_report") app.export_report(path("path"));
  else if (op == "add_method") {
    app.begin_edit();
    app.st.scroll_to_method = app.add_method(parse_method_spec(path("spec")), st.value("label", std::string()));
    app.end_edit();
  } else if (op == "remove_method") app.remove_method(method_id(app, st["method"]));
  else if (op == "set_enabled") {
    if (!st["enabled"].is_boolean()) throw InputError("'enabled' must be true or false");
    app.set_enabled(method_id(app, st["method"]), st["enabled"].get<bool>());
  } else if (op == "set_param") {
    app.begin_edit();
    app.set_param(method_id(app, st["method"]), path("name"), value_text(st["value"], "value"));
    app.end_edit();
  } else if (op == "drag_param") {
    json_real(st["from"], "from", -1e300, 1e300);
    json_real(st["to"], "to", -1e300, 1e300);
    method_id(app, st["method"]);
    drag_ = st;
    drag_frame_ = 0;
  } else if (op == "undo") app.undo();
  else if (op == "redo") app.redo();
  else if (op == "select") {
    nlohmann::json v = st;
    v.erase("do");
    // A refused field refuses the whole step: the views stay as they were and the script fails.
    if (!app.select_views(v, "select"))
      throw InputError("refused, nothing selected: " + app.st.messages.back().text);
  } else if (op == "ui_scale") {
    set_ui_scale(app, static_cast<float>(json_real(st["value"], "value", kMinUiScale, kMaxUiScale)));
  } else if (op == "show_log") {
    if (st.contains("open") && !st["open"].is_boolean()) throw InputError("'open' must be true or false");
    app.st.log_open = st.value("open", true);
  } else if (op == "plot_view") {
    // How the Plots panel's figure is looked at, as clicks on its legend, the right-click menu
    // and Shift + wheel set it. Checked whole before anything changes.
    if (app.st.plot_figure.empty()) throw InputError("no figure drawn in the Plots panel yet");
    fig::View v = app.st.zoom[app.st.plot_figure];
    auto labels = [&](const char* k) {
      std::vector<std::string> r;
      if (!st.contains(k)) return r;
      if (!st[k].is_array()) throw InputError(std::string("'") + k + "' must be a list of series labels");
      for (const auto& x : st[k]) {
        if (!x.is_string()) throw InputError(std::string("'") + k + "' must be a list of series labels");
        r.push_back(x.get<std::string>());
      }
      return r;
    };
    for (const std::string& l : labels("hide")) v.hidden.insert(l);
    for (const std::string& l : labels("show")) v.hidden.erase(l);
    if (st.contains("y_scale")) {
      v.y_scale = fig::parse_y_scale(text_arg(st, "y_scale", "plot_view"), "y_scale");
      v.y_zoomed = false;
    }
    if (st.contains("y_range")) {
      if (!st["y_range"].is_array() || st["y_range"].size() != 2)
        throw InputError("'y_range' must be [low, high]");
      v.y_min = json_real(st["y_range"][0], "y_range[0]", -1e300, 1e300);
      v.y_max = json_real(st["y_range"][1], "y_range[1]", -1e300, 1e300);
      if (!(v.y_max > v.y_min)) throw InputError("'y_range' must have low < high");
      v.y_zoomed = true;
    }
    app.st.zoom[app.st.plot_figure] = v;
  } else if (op == "wait_results") {
    waiting_results_ = true;
    settled_frames_ = 0;
    wait_deadline_ = app.now() + st.value("timeout_s", 120.0);
  } else if (op == "frames") wait_frames_ = st["n"].get<int>();
  else if (op == "hover") {
    // The mouse over a drawn item (st.drawn's name, "" = none), at fractions x, y of its width
    // and height, from the next frame on.
    const std::string over = text_arg(st, "over", "hover");
    if (over.empty()) {
      app.st.script_pointer.reset();
    } else {
      auto it = app.st.drawn.find(over);
      if (it == app.st.drawn.end() || it->second.size() < 4)
        throw InputError("hover: nothing drawn is called '" + over + "'");
      const std::vector<float>& r = it->second;
      app.st.script_pointer = std::make_pair(r[0] + r[2] * static_cast<float>(json_real(st["x"], "hover: x", 0, 1)),
                                             r[1] + r[3] * static_cast<float>(json_real(st["y"], "hover: y", 0, 1)));
    }
    wait_frames_ = 3;
  }
  else if (op == "screenshot") {
    shot_path_ = path("path");
    settled_frames_ = 0;
  } else if (op == "export_figures") {
    ExportOptions& e = app.st.export_opt;
    if (st.contains("formats")) {
      const std::string f = text_arg(st, "formats", "export_figures");
      e.png = f.find("png") != std::string::npos;
      e.svg = f.find("svg") != std::string::npos;
      e.pdf = f.find("pdf") != std::string::npos;
    }
    if (st.contains("csv")) e.csv = st["csv"].get<bool>();
    const bool all = st.value("all", true);
    if (st.contains("wait") && !st["wait"].is_boolean())
      throw InputError("export_figures: 'wait' must be true or false, got " + st["wait"].dump());
    app.export_figures(path("dir"), all ? app.report_figures_all() : app.shown_figures());
    // A script's steps run in order, unless it asks to watch the export run (wait: false).
    if (st.value("wait", true)) app.wait_export();
  } else if (op == "cancel_export") {
    app.cancel_export();
    app.wait_export();
  } else if (op == "dump_state") {
    nlohmann::json d;
    d["methods"] = nlohmann::json::array();
    for (const MethodInstance& m : app.st.methods)
      d["methods"].push_back({{"id", m.id}, {"label", m.label}, {"shown", app.display_name(m)}, {"spec", m.params.spec()},
                              {"enabled", m.enabled}, {"error", m.error}});
    // The Methods panel: what "Add" offers, and each instance's parameters by the names shown.
    d["add_choice"] = methods()[static_cast<size_t>(app.st.edits.add_method)].name;
    d["params_shown"] = nlohmann::json::object();
    for (const MethodInstance& m : app.st.methods) {
      nlohmann::json names = nlohmann::json::array();
      for (const ParamSpec& p : find_method(m.params.method()).params) names.push_back(shown_name(p.name));
      d["params_shown"][m.params.method()] = names;
    }
    // The names the latest drag_param's instance went by while it lasted (one: it held still),
    // and the names the report's figures give the methods (their legends).
    d["drag_shown"] = drag_shown_;
    d["legend"] = nlohmann::json::array();
    if (app.st.results && app.st.results->report && app.st.results->report->contains("methods"))
      for (const nlohmann::json& m : (*app.st.results->report)["methods"])
        d["legend"].push_back(m.contains("label") ? m["label"] : m["short_spec"]);
    d["inputs"] = {{"model_dir", app.st.inputs.model_dir}, {"image_path", app.st.inputs.image_path},
                   {"prompt", app.st.inputs.prompt}, {"max_new_tokens", app.st.inputs.max_new_tokens}};
    // What the input boxes show, beside what the app analyses (they differ only while typing).
    d["fields"] = {{"model_dir", app.st.edits.model_dir}, {"image_path", app.st.edits.image_path},
                   {"prompt", app.st.edits.prompt}, {"max_new_tokens", app.st.edits.max_new_tokens}};
    d["fields_shown"] = app.st.shown;  // (path fields: the file name until clicked)
    d["cut_texts"] = app.st.cut_texts;  // (each shows its whole text on hover)
    d["hover_readout"] = app.st.hover_readout;
    d["frame_ms"] = app.st.timing.frame_ms;
    // The Plots panel's figure: how much it is magnified (its text grows with the panel).
    if (app.st.drawn.count("plot"))
      d["plot_magnification"] = figure_magnification(ImVec2(app.st.drawn["plot"][2], app.st.drawn["plot"][3]));
    d["busy"] = app.busy();
    d["log_open"] = app.st.log_open;
    d["ui_scale"] = app.st.ui_scale;
    d["frame_height"] = ImGui::GetFrameHeight();  // as built for the UI scale (the previous frame's)
    d["blocked"] = app.blocked();
    d["views"] = app.views_json();
    d["session_path"] = app.st.session_path;
    d["up_to_date"] = app.up_to_date();
    d["drawn"] = app.st.drawn;
    const auto [done, total] = app.export_progress();
    d["export"] = {{"running", app.exporting()}, {"done", done}, {"total", total}};
    // The overlay shown: its scale as the colour bar draws it.
    const OverlayData ov = overlay_of(app, app.st.views.overlay_source);
    d["overlay"] = {{"what", ov.what}, {"quantity", ov.scale.quantity}, {"lo", ov.scale.lo}, {"hi", ov.scale.hi},
                    {"levels", ov.scale.levels}, {"patches", ov.values.size()}};
    if (app.st.results) {
      const VisualGrid g = overlay_grid(*app.st.results);
      d["overlay"]["grid"] = {{"name", g.name}, {"rows", g.rows}, {"cols", g.cols}, {"first", g.first},
                              {"row_stride", g.row_stride}};
    }
    d["messages"] = nlohmann::json::array();
    for (const Message& m : app.st.messages) d["messages"].push_back({{"error", m.error}, {"text", m.text}});
    const CalibrationView& c = app.calibration_view();
    d["calibration"] = {{"key", c.key}, {"calibrated", c.calibrated}, {"gamma", c.gamma}, {"delta", c.delta}};
    // The Plots panel's figure: how it is looked at, and its y axis as drawn.
    if (!app.st.plot_figure.empty()) {
      const fig::View& pv = app.st.zoom[app.st.plot_figure];
      d["plot_view"] = {{"figure", app.st.plot_figure},
                        {"hidden", pv.hidden},
                        {"y_scale", fig::y_scale_name(pv.y_scale)},
                        {"y_zoomed", pv.y_zoomed},
                        {"y_drawn", {{"min", app.st.plot_y.min}, {"max", app.st.plot_y.max}, {"log", app.st.plot_y.log}}}};
    }
    // The comparison table's rows in the order shown.
    d["comparison_table"] = {{"sort", app.st.views.table_sort}, {"descending", app.st.views.table_descending},
                             {"rows", nlohmann::json::array()}};
    if (app.st.results && app.st.results->report) {
      fig::ComparisonTable t = fig::comparison_table(*app.st.results->report);
      fig::sort_comparison(t, app.st.views.table_sort, app.st.views.table_descending);
      for (const auto& r : t.rows) {
        nlohmann::json values = nlohmann::json::array();
        for (double x : r.values) values.push_back(std::isnan(x) ? nlohmann::json() : nlohmann::json(x));
        d["comparison_table"]["rows"].push_back({{"name", r.name}, {"values", values}});
      }
      for (const auto& c : t.columns) d["comparison_table"]["columns"].push_back(c.key);
    }
    d["results"] = nlohmann::json::array();
    if (app.st.results && app.st.results->report)
      for (const auto& m : (*app.st.results->report)["methods"])
        d["results"].push_back({{"spec", m["spec"]}, {"caption", m["caption"]}, {"mean_softmax_mse", m["mean_softmax_mse"]}});
    write_file_atomic(path("path"), d.dump(1) + "\n", "state dump");
  } else if (op == "expect_message") {
    const std::string want = path("contains");
    bool found = false;
    for (size_t i = messages_seen_; i < app.st.messages.size(); ++i) found = found || app.st.messages[i].text.find(want) != std::string::npos;
    if (!found)
      throw InputError("expected a message containing '" + want + "' since the last check, the newest is '" +
                       (app.st.messages.empty() ? std::string() : app.st.messages.back().text) + "'");
    messages_seen_ = app.st.messages.size();
  } else if (op == "timing") {
    const Timing& t = app.st.timing;
    const double mx = t.latencies_ms.empty() ? 0 : *std::max_element(t.latencies_ms.begin(), t.latencies_ms.end());
    const double build = median(t.build_ms);
    std::printf("kvlens-gui timing: %s: release -> updated caption and plots: median %.0f ms, max %.0f ms over %zu edits; "
                "while dragging with the worker computing: %.1f frames/s drawn (%d frames), UI thread %.1f ms per "
                "frame (median; %.0f frames/s without rasterizing)\n",
                st.value("label", std::string("run")).c_str(), median(t.latencies_ms), mx, t.latencies_ms.size(),
                t.busy_seconds > 0 ? t.busy_frames / t.busy_seconds : 0.0, t.busy_frames, build,
                build > 0 ? 1000.0 / build : 0.0);
    std::fflush(stdout);
  } else if (op == "quit") app.st.quit = true;
}

}  // namespace kvlens::gui
