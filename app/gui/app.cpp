#include "app/gui/app.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "app/gui/overlay.h"
#include "app/cli/defaults.h"
#include "core/errors.h"
#include "app/figures/figures_report.h"
#include "core/files.h"
#include "core/data/image.h"
#include "core/json_file.h"
#include "core/numbers.h"

namespace kvlens::gui {

App::App(std::string source_dir) : source_dir_(std::move(source_dir)), t0_(std::chrono::steady_clock::now()) {
  st.inputs.prompt = kDefaultPrompt;
  st.inputs.templ = kDefaultTemplate;
  st.edits.prompt = st.inputs.prompt;
  // "Add" offers the first compression method, not the reference.
  const std::vector<MethodSpec>& all = methods();
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].family != "reference") {
      st.edits.add_method = static_cast<int>(i);
      break;
    }
  load_recent();
  if (const std::string e = app::model_variable_error(); !e.empty()) error(e);
}

double App::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

void App::info(const std::string& text) { st.messages.push_back({false, text, now()}); }
void App::error(const std::string& text) { st.messages.push_back({true, text, now()}); }

// ----- inputs -----------------------------------------------------------------------------

std::string App::default_model_dir() const { return app::default_model_dir(); }
std::string App::default_image() const { return app::default_image_for(model_dir()); }
std::string App::model_dir() const {
  // (a KVLENS_MODEL set wrong is reported once, at start; its folder then fails to load)
  return st.inputs.model_dir.empty() ? app::default_model_dir() : app::model_dir_of(st.inputs.model_dir);
}
std::string App::image_path() const { return st.inputs.image_path.empty() ? default_image() : st.inputs.image_path; }

void App::open_image(const std::string& path) {
  try {
    load_image(path);  // decodes (a few ms): refuse a non-image before anything changes
  } catch (const InputError& e) {
    error(e.what());
    return;
  }
  st.inputs.image_path = path;
  st.edits.image_path = path;
  remember(st.recent_images, path);
  st.dirty = true;
  submit();
}

void App::open_model(const std::string& path) {
  const std::string dir = path.empty() ? path : app::model_dir_of(path);  // (an embedded model's name too)
  struct stat s {};
  if (::stat(dir.c_str(), &s) != 0 || !S_ISDIR(s.st_mode)) {
    error(dir + ": not a folder, expected a model folder (config.json, safetensors, tokenizer.model)");
    return;
  }
  if (!file_exists(dir + "/config.json")) {
    error(dir + ": not a model folder (no config.json)");
    return;
  }
  st.inputs.model_dir = dir;
  st.edits.model_dir = dir;
  remember(st.recent_models, dir);
  st.dirty = true;
  submit();
}

void App::set_prompt(const std::string& prompt, int max_new_tokens) {
  if (max_new_tokens < 1 || max_new_tokens > kMaxNewTokensLimit) {
    error("max new tokens must be in [1, " + std::to_string(kMaxNewTokensLimit) + "], got " + std::to_string(max_new_tokens));
    return;
  }
  st.inputs.prompt = prompt;
  st.inputs.max_new_tokens = max_new_tokens;
  st.dirty = true;
  submit();
}

void App::submit() {
  Setup s;
  s.model_dir = model_dir();
  s.image_path = image_path();
  s.backend.kind = st.inputs.backend;
  apply_session_run(st.inputs, s.opt);
  // (while an edit lasts, an automatic label goes to the worker as it is held, so the report's
  // legends keep it too)
  for (const MethodInstance& m : st.methods)
    if (m.enabled) s.methods.push_back({m.id, m.params, st.history.editing ? display_name(m) : m.label});
  st.history.sent = st.history.sent || st.history.editing;
  s.priority = st.edit_order;
  st.setup_version = worker.submit(std::move(s));
}

// ----- method instances -------------------------------------------------------------------

MethodInstance* App::find(int id) {
  for (MethodInstance& m : st.methods)
    if (m.id == id) return &m;
  return nullptr;
}

const MethodInstance* App::find(int id) const {
  for (const MethodInstance& m : st.methods)
    if (m.id == id) return &m;
  return nullptr;
}

std::string App::display_name(const MethodInstance& m) const {
  if (!m.label.empty()) return m.label;
  // An automatic label holds while an edit lasts (a drag, typing into a field): panels, legends
  // and export names keep the one it had when the edit began and take the new values at release.
  if (st.history.editing)
    for (const MethodInstance& b : st.history.before)
      if (b.id == m.id) return b.params.short_spec();
  return m.params.short_spec();
}

void App::changed() {
  st.dirty = true;
  submit();
}

int App::add_method(const Params& p, const std::string& label) {
  MethodInstance m;
  m.id = st.next_id++;
  m.params = p;
  m.label = label;
  st.methods.push_back(m);
  if (st.views.method < 0) st.views.method = m.id;
  changed();
  return m.id;
}

void App::add_seed_methods() {
  for (const char* spec : {"calibquant", "zipcache", "vlcache", "lookm"}) add_method(parse_method_spec(spec));
}

void App::remove_method(int id) {
  begin_edit();
  st.methods.erase(std::remove_if(st.methods.begin(), st.methods.end(), [&](const MethodInstance& m) { return m.id == id; }),
                   st.methods.end());
  if (st.views.method == id) st.views.method = st.methods.empty() ? -1 : st.methods.front().id;
  end_edit();
  changed();
}

void App::duplicate_method(int id) {
  const MethodInstance* m = find(id);
  if (!m) return;
  begin_edit();
  MethodInstance copy = *m;
  copy.id = st.next_id++;
  copy.error.clear();
  if (!copy.label.empty()) copy.label += " (copy)";
  auto at = std::find_if(st.methods.begin(), st.methods.end(), [&](const MethodInstance& x) { return x.id == id; });
  st.methods.insert(at + 1, copy);
  end_edit();
  changed();
}

void App::move_method(int id, int delta) {
  auto at = std::find_if(st.methods.begin(), st.methods.end(), [&](const MethodInstance& x) { return x.id == id; });
  if (at == st.methods.end()) return;
  const long to = (at - st.methods.begin()) + delta;
  if (to < 0 || to >= static_cast<long>(st.methods.size())) return;
  begin_edit();
  std::iter_swap(at, st.methods.begin() + to);
  end_edit();
  changed();
}

void App::set_enabled(int id, bool on) {
  MethodInstance* m = find(id);
  if (!m || m->enabled == on) return;
  begin_edit();
  m->enabled = on;
  end_edit();
  changed();
}

void App::set_label(int id, const std::string& label) {
  MethodInstance* m = find(id);
  if (!m || m->label == label) return;
  m->label = label;
  changed();
}

bool App::set_param(int id, const std::string& name, const std::string& value) {
  MethodInstance* m = find(id);
  if (!m) return false;
  std::map<std::string, std::string> v = m->params.values();
  if (v.count(name) && v[name] == value) return true;
  v[name] = value;
  try {
    Params p = make_params(m->params.method(), "", v);
    m->params = std::move(p);
    m->error.clear();
  } catch (const InputError& e) {
    m->error = e.what();
    error(e.what());
    return false;
  }
  st.edit_order.erase(std::remove(st.edit_order.begin(), st.edit_order.end(), id), st.edit_order.end());
  st.edit_order.insert(st.edit_order.begin(), id);
  // The latency clock starts when a change is complete: now for a single change, at release
  // for a drag (end_edit).
  if (!st.history.editing) st.timing.pending[id] = now();
  changed();
  return true;
}

bool App::apply_preset(int id, const std::string& preset) {
  MethodInstance* m = find(id);
  if (!m) return false;
  try {
    Params p = make_params(m->params.method(), preset, {});
    begin_edit();
    m->params = std::move(p);
    m->error.clear();
    end_edit();
  } catch (const InputError& e) {
    error(e.what());
    return false;
  }
  st.timing.pending[id] = now();
  changed();
  return true;
}

void App::reset_method(int id) {
  MethodInstance* m = find(id);
  if (!m) return;
  begin_edit();
  m->params = make_params(m->params.method(), "", {});
  m->error.clear();
  end_edit();
  st.timing.pending[id] = now();
  changed();
}

void App::begin_edit() {
  if (st.history.editing) return;
  st.history.editing = true;
  st.history.sent = false;
  st.history.before = st.methods;
}

void App::end_edit() {
  if (!st.history.editing) return;
  st.history.editing = false;
  const bool sent = std::exchange(st.history.sent, false);
  auto same = [](const std::vector<MethodInstance>& a, const std::vector<MethodInstance>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].id != b[i].id || a[i].params.spec() != b[i].params.spec() || a[i].enabled != b[i].enabled ||
          a[i].label != b[i].label)
        return false;
    return true;
  };
  if (same(st.history.before, st.methods)) {
    if (sent) submit();  // the worker's labels as they were (an edit that came back to its start)
    return;
  }
  for (const MethodInstance& m : st.methods) {
    const auto was = std::find_if(st.history.before.begin(), st.history.before.end(),
                                  [&](const MethodInstance& b) { return b.id == m.id; });
    if (was == st.history.before.end() || was->params.spec() != m.params.spec()) st.timing.pending[m.id] = now();
  }
  st.history.undo.push_back(std::move(st.history.before));
  if (st.history.undo.size() > 200) st.history.undo.erase(st.history.undo.begin());
  st.history.redo.clear();
  submit();  // the automatic labels held during the edit now follow the values
}

void App::undo() {
  if (st.history.undo.empty()) return;
  st.history.redo.push_back(st.methods);
  st.methods = std::move(st.history.undo.back());
  st.history.undo.pop_back();
  for (const MethodInstance& m : st.methods) st.timing.pending[m.id] = now();
  changed();
}

void App::redo() {
  if (st.history.redo.empty()) return;
  st.history.undo.push_back(st.methods);
  st.methods = std::move(st.history.redo.back());
  st.history.redo.pop_back();
  for (const MethodInstance& m : st.methods) st.timing.pending[m.id] = now();
  changed();
}

// ----- results ----------------------------------------------------------------------------

void App::poll() {
  finish_export(false);
  std::shared_ptr<const Snapshot> s = worker.latest();
  if (s == st.results) return;
  st.results = s;
  if (!st.expect_model_hash.empty() && s->model && s->model->dir == model_dir()) {
    if (s->model->hash != st.expect_model_hash)
      info("model folder " + model_dir() + " changed since the session was saved (" + st.expect_model_hash + ", now " +
           s->model->hash + ")");
    st.expect_model_hash.clear();
  }
  // Edit → result latency, for every instance whose wanted values are now shown.
  for (auto it = st.timing.pending.begin(); it != st.timing.pending.end();) {
    const MethodInstance* m = find(it->first);
    if (!m || !m->enabled) {
      it = st.timing.pending.erase(it);
      continue;
    }
    if (result(it->first) || s->run_errors.count(it->first)) {
      st.timing.last_latency_ms = (now() - it->second) * 1000.0;
      st.timing.latencies_ms.push_back(st.timing.last_latency_ms);
      it = st.timing.pending.erase(it);
    } else {
      ++it;
    }
  }
}

const RunResult* App::any_result(int id) const {
  if (!st.results) return nullptr;
  for (const RunResult& r : st.results->runs)
    if (r.id == id) return &r;
  return nullptr;
}

const RunResult* App::result(int id) const {
  const RunResult* r = any_result(id);
  const MethodInstance* m = find(id);
  return r && m && r->spec == m->params.spec() ? r : nullptr;
}

int App::report_index(int id) const {
  if (!st.results) return -1;
  for (size_t i = 0; i < st.results->runs.size(); ++i)
    if (st.results->runs[i].id == id) return static_cast<int>(i);
  return -1;
}

bool App::busy() const { return !st.results || st.results->busy || st.results->setup_version != st.setup_version; }

std::string App::blocked() const {
  if (busy()) return "";
  if (!st.results->model_error.empty()) return st.results->model_error;
  return st.results->base_error;
}

bool App::up_to_date() const {
  if (busy()) return false;
  for (const MethodInstance& m : st.methods)
    if (m.enabled && !result(m.id) && !st.results->run_errors.count(m.id)) return false;
  return true;
}

const fig::Figure* App::figure(const std::string& key) {
  if (!st.results || !st.results->report) return nullptr;
  if (st.figures.report_serial != st.results->serial) {
    st.figures.by_key.clear();
    st.figures.report_serial = st.results->serial;
  }
  auto it = st.figures.by_key.find(key);
  if (it != st.figures.by_key.end()) return &it->second;
  const nlohmann::json& r = *st.results->report;
  auto part = [&](int i) {
    size_t a = 0;
    for (int k = 0; k < i; ++k) a = key.find(':', a) + 1;
    return std::atoi(key.c_str() + a);
  };
  try {
    fig::Figure f;
    const std::string kind = key.substr(0, key.find(':'));
    const int L = fig::layer_count(r);
    const int M = static_cast<int>(fig::method_count(r));
    if (kind == "softmax_mse") f = fig::layer_metric_figure(r, fig::LayerMetric::SoftmaxMse);
    else if (kind == "kl") f = fig::layer_metric_figure(r, fig::LayerMetric::SoftmaxKl);
    else if (kind == "output_error") f = fig::layer_metric_figure(r, fig::LayerMetric::OutputError);
    else if (kind == "sparsity") f = fig::sparsity_figure(r);
    else if (kind == "hit_layer") f = fig::hit_rate_by_layer_figure(r, part(1));
    else if (kind == "hit_step") f = fig::hit_rate_by_step_figure(r);
    else if (kind == "bytes") f = fig::bytes_by_layer_figure(r);
    else if (kind == "pareto") f = fig::bytes_vs_agreement_figure(r);
    else if (kind == "heatmap") {
      if (part(1) >= L || part(2) >= M) return nullptr;
      f = fig::attention_heatmap_figure(r, part(1), part(2));
    } else if (kind == "multiples") {
      // multiples:<instance id, -1 = full cache>:<generated token>, from the decode's patch recorder.
      const Snapshot& s = *st.results;
      const int source = part(1), token = part(2);
      const VisualAttentionRecorder* rec = s.base ? s.base->patches.get() : nullptr;
      std::string who = "full cache";
      if (source >= 0) {
        const RunResult* r = any_result(source);
        const MethodInstance* m = find(source);
        rec = r ? r->patches.get() : nullptr;
        who = m ? display_name(*m) : "?";
      }
      // The patch grid the Image panel draws (overlay_grid).
      const VisualGrid g = overlay_grid(s);
      const int rows = g.rows, cols = g.cols;
      if (!rec || !s.model || rows < 1 || cols < 1 || token >= rec->steps()) return nullptr;
      std::vector<std::vector<std::vector<float>>> att(static_cast<size_t>(s.model->layers));
      for (int l = 0; l < s.model->layers; ++l)
        for (int h = 0; h < s.model->heads; ++h) {
          const std::vector<float> a = rec->attention(token, l, h);
          std::vector<float> on_grid;
          if (a.size() >= static_cast<size_t>(g.token(rows - 1, cols - 1)) + 1)
            for (int r = 0; r < rows; ++r)
              for (int c = 0; c < cols; ++c) on_grid.push_back(a[static_cast<size_t>(g.token(r, c))]);
          att[static_cast<size_t>(l)].push_back(std::move(on_grid));
        }
      f = fig::patch_multiples_figure(att, rows, cols, true, who, token);
    } else if (kind == "hist") {
      if (part(1) < 0 || part(1) >= M || part(2) >= L) return nullptr;
      f = fig::score_histogram_figure(r, part(1), part(2));
    } else {
      return nullptr;
    }
    return &(st.figures.by_key[key] = std::move(f));
  } catch (const InputError& e) {
    return nullptr;
  }
}

std::vector<fig::Figure> App::report_figures_all() const {
  if (!st.results || !st.results->report) return {};
  // The token-fate figures over the image as the tower sees it (the Image panel's).
  const RGBImage* shown = st.results->base && st.results->base->shown.width > 0 ? &st.results->base->shown : nullptr;
  return fig::report_figures(*st.results->report, shown);
}

std::vector<fig::Figure> App::shown_figures() {
  std::vector<fig::Figure> out;
  for (const std::string& k : std::vector<std::string>(st.figures.shown_keys))
    if (const fig::Figure* f = figure(k)) out.push_back(*f);
  out.insert(out.end(), st.figures.shown_live.begin(), st.figures.shown_live.end());
  return out;
}

void set_ui_scale(App& app, float scale) {
  const float s = std::clamp(scale, kMinUiScale, kMaxUiScale);
  if (s == app.st.ui_scale) return;
  app.st.ui_scale = s;
  app.save_recent();
}

void link_views(Views& v, const Views& before) {
  if (!v.link) return;
  // Linking just turned on: the overlay's selection is the one kept.
  const bool fresh = !before.link;
  const std::pair<int, int> layers[] = {{v.layer, before.layer}, {v.calib_layer, before.calib_layer},
                                        {v.heatmap_layer, before.heatmap_layer}};
  for (const auto& [now, was] : layers)
    if (fresh || now != was) {
      v.layer = v.calib_layer = v.heatmap_layer = now;
      break;
    }
  if (fresh || v.head != before.head) v.calib_head = v.head;
  else if (v.calib_head != before.calib_head) v.head = v.calib_head;
}

std::vector<PlotEntry> plot_entries(const App& app) {
  std::vector<PlotEntry> e = {{"softmax_mse", "Softmax MSE per layer"},
                              {"kl", "Softmax KL per layer"},
                              {"output_error", "Attention output error per layer"},
                              {"sparsity", "Sparsity γ(l), prefill and decode"},
                              {"hit_layer", "CacheHitRate per layer"},
                              {"hit_step", "CacheHitRate per decode step"},
                              {"bytes", "KV bytes per layer"},
                              {"heatmap", "Attention heatmap (query × key)"},
                              {"pareto", "Bytes vs caption agreement"},
                              {"multiples", "Attention over patches: layers × heads"},
                              {"table", "Comparison table (every method)"}};
  return e;
}

// ----- export -----------------------------------------------------------------------------

bool App::export_report(const std::string& path) {
  if (!st.results || !st.results->report) {
    error("export report: no results yet");
    return false;
  }
  try {
    write_file_atomic(path, st.results->report->dump(1) + "\n", "report");
    info("report written to " + path);
    return true;
  } catch (const InputError& e) {
    error(e.what());
    return false;
  }
}

void App::remember(std::vector<std::string>& list, const std::string& item) {
  list.erase(std::remove(list.begin(), list.end(), item), list.end());
  list.insert(list.begin(), item);
  if (list.size() > 10) list.resize(10);
  save_recent();
}

std::string App::state_dir() const {
  std::string base;
  if (const char* x = std::getenv("XDG_STATE_HOME"); x && *x) base = x;
  else if (const char* h = std::getenv("HOME"); h && *h) base = std::string(h) + "/.local/state";
  else return "";
  return base + "/kvlens";
}

namespace {
// Creates `dir` and its missing parents (folders only; files go through write_file_atomic).
bool make_dirs(const std::string& dir) {
  struct stat s {};
  if (dir.empty()) return false;
  if (::stat(dir.c_str(), &s) == 0) return S_ISDIR(s.st_mode);
  const size_t slash = dir.rfind('/');
  if (slash != std::string::npos && slash > 0 && !make_dirs(dir.substr(0, slash))) return false;
  return ::mkdir(dir.c_str(), 0777) == 0 || errno == EEXIST;
}
}  // namespace

void App::save_recent() {
  const std::string dir = state_dir();
  if (!make_dirs(dir)) return;
  nlohmann::json j = {{"sessions", st.recent_sessions},
                      {"images", st.recent_images},
                      {"models", st.recent_models},
                      {"ui_scale", st.ui_scale}};
  try {
    write_file_atomic(dir + "/recent.json", j.dump(1) + "\n", "recent files list");
  } catch (const InputError& e) {
    error(e.what());
  }
}

void App::load_recent() {
  const std::string path = state_dir() + "/recent.json";
  if (state_dir().empty() || !file_exists(path)) return;
  try {
    const nlohmann::json j = read_json_file(path, "recent files list");
    for (auto [key, out] : {std::pair{"sessions", &st.recent_sessions}, {"images", &st.recent_images}, {"models", &st.recent_models}})
      if (j.is_object() && j.contains(key) && j[key].is_array())
        for (const auto& v : j[key])
          if (v.is_string()) out->push_back(v.get<std::string>());
    if (j.is_object() && j.contains("ui_scale"))
    {
      st.ui_scale = static_cast<float>(json_real(j["ui_scale"], path + ": ui_scale", kMinUiScale, kMaxUiScale));
      st.ui_scale_saved = true;
    }
  } catch (const InputError& e) {
    error(e.what());
  }
}

}  // namespace kvlens::gui
