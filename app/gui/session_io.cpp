// Sessions and exports of the desktop app: the state to and from the shared session schema
// (app/lab/session.h, the same file `kvlens run --session` runs), autosave, figure and report export.
#include <sys/stat.h>

#include <atomic>
#include <thread>

#include "app/figures/figure_cairo.h"
#include "app/gui/app.h"
#include "app/figures/figures_report.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/numbers.h"

namespace kvlens::gui {

namespace {

const char* overlay_name(Overlay o) {
  switch (o) {
    case Overlay::None: return "none";
    case Overlay::Attention: return "attention";
    case Overlay::FateKept: return "fate_kept";
    case Overlay::FateBits: return "fate_bits";
    case Overlay::FateMerged: return "fate_merged";
  }
  return "none";
}

int index_of(const std::vector<MethodInstance>& ms, int id) {
  for (size_t i = 0; i < ms.size(); ++i)
    if (ms[i].id == id) return static_cast<int>(i);
  return -1;
}

}  // namespace

nlohmann::json App::views_json() const {
  const Views& v = st.views;
  const auto entries = plot_entries(*this);
  return {{"method", index_of(st.methods, v.method)},
          {"layer", v.layer},
          {"head", v.head},
          {"calib_layer", v.calib_layer},
          {"calib_head", v.calib_head},
          {"heatmap_layer", v.heatmap_layer},
          {"link_views", v.link},
          {"plot", v.plot >= 0 && v.plot < static_cast<int>(entries.size()) ? entries[v.plot].key : "softmax_mse"},
          {"hit_step", v.hit_step},
          {"heatmap_method", index_of(st.methods, v.heatmap_method)},
          {"calib_method", index_of(st.methods, v.calib_method)},
          {"overlay", overlay_name(v.overlay)},
          {"overlay_opacity", v.overlay_opacity},
          {"patch_grid", v.patch_grid},
          {"token", v.token},
          {"overlay_source", index_of(st.methods, v.overlay_source)},
          {"multiples_source", index_of(st.methods, v.multiples_source)},
          {"multiples_token", v.multiples_token},
          {"table_sort", v.table_sort},
          {"table_descending", v.table_descending}};
}

bool App::apply_views_json(const nlohmann::json& j, const std::string& where) {
  if (j.is_null()) return true;
  bool ok = true;
  Views v = st.views;
  const int n = static_cast<int>(st.methods.size());
  auto id_at = [&](int i) { return i >= 0 && i < n ? st.methods[i].id : -1; };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string k = it.key(), at = where + ": views." + k;
    try {
      if (k == "method") v.method = id_at(json_int(*it, at, -1, n - 1));
      else if (k == "layer") v.layer = json_int(*it, at, 0, 4096);
      else if (k == "head") v.head = json_int(*it, at, -1, 4096);
      else if (k == "calib_layer") v.calib_layer = json_int(*it, at, 0, 4096);
      else if (k == "calib_head") v.calib_head = json_int(*it, at, -1, 4096);
      else if (k == "heatmap_layer") v.heatmap_layer = json_int(*it, at, 0, 4096);
      else if (k == "hit_step") v.hit_step = json_int(*it, at, 0, 1024);
      else if (k == "heatmap_method") v.heatmap_method = id_at(json_int(*it, at, -1, n - 1));
      else if (k == "calib_method") v.calib_method = id_at(json_int(*it, at, -1, n - 1));
      else if (k == "overlay_source") v.overlay_source = id_at(json_int(*it, at, -1, n - 1));
      else if (k == "multiples_source") v.multiples_source = id_at(json_int(*it, at, -1, n - 1));
      else if (k == "multiples_token") v.multiples_token = json_int(*it, at, 0, kMaxNewTokensLimit);
      else if (k == "token") v.token = json_int(*it, at, 0, kMaxNewTokensLimit);
      else if (k == "overlay_opacity") v.overlay_opacity = static_cast<float>(json_real(*it, at, 0, 1));
      else if (k == "patch_grid" || k == "table_descending" || k == "link_views") {
        if (!it->is_boolean()) throw InputError(at + " must be true or false, got " + it->dump());
        (k == "patch_grid" ? v.patch_grid : k == "link_views" ? v.link : v.table_descending) = it->get<bool>();
      } else if (k == "table_sort") {
        if (!it->is_string() || !fig::comparison_column(it->get<std::string>()))
          throw InputError(at + " must name a column of the comparison table (method, kv_kib, ratio, mse, kl, "
                                "output_error, diverges_at, compress_ms, decode_ms), got " + it->dump());
        v.table_sort = it->get<std::string>();
      } else if (k == "plot") {
        const auto entries = plot_entries(*this);
        int found = -1;
        for (size_t i = 0; i < entries.size(); ++i)
          if (it->is_string() && entries[i].key == it->get<std::string>()) found = static_cast<int>(i);
        if (found < 0) throw InputError(at + " must name a plot (softmax_mse, kl, ...), got " + it->dump());
        v.plot = found;
      } else if (k == "overlay") {
        bool known = false;
        for (Overlay o : {Overlay::None, Overlay::Attention, Overlay::FateKept, Overlay::FateBits, Overlay::FateMerged})
          if (it->is_string() && it->get<std::string>() == overlay_name(o)) {
            v.overlay = o;
            known = true;
          }
        if (!known) throw InputError(at + " must be none, attention, fate_kept, fate_bits or fate_merged, got " + it->dump());
      } else {
        throw InputError(where + ": unknown view '" + k + "'");
      }
    } catch (const InputError& e) {
      error(e.what());
      ok = false;
    }
  }
  link_views(v, st.views);
  st.views = v;
  return ok;
}

bool App::select_views(const nlohmann::json& j, const std::string& where) {
  const Views before = st.views;
  if (apply_views_json(j, where)) return true;
  st.views = before;
  return false;
}

Session App::to_session() const {
  Session s;
  s.name = st.session_name;
  s.description = st.session_description;
  static_cast<SessionRun&>(s) = st.inputs;
  s.model = st.inputs.model_dir;
  s.image = st.inputs.image_path;
  for (const MethodInstance& m : st.methods) {
    s.methods.push_back(m.params);
    s.labels.push_back(m.label);
    s.enabled.push_back(m.enabled);
  }
  const Snapshot* r = st.results.get();
  if (r && r->model && r->model->dir == model_dir()) s.model_hash = r->model->hash;
  if (r && r->base && r->base->key.rfind(model_dir() + '\n' + image_path() + '\n', 0) == 0) s.image_hash = r->base->image_hash;
  s.views = views_json();
  if (r && r->report) {
    const nlohmann::json& rep = *r->report;
    nlohmann::json res = {{"full_caption", rep["full"]["caption"]}, {"methods", nlohmann::json::array()}};
    for (const auto& m : rep["methods"])
      res["methods"].push_back({{"spec", m["spec"]},
                                {"label", m.contains("label") ? m["label"] : m["short_spec"]},
                                {"caption", m["caption"]},
                                {"bytes_after_prefill", m["bytes_after_prefill"]["total"]},
                                {"mean_softmax_mse", m["mean_softmax_mse"]},
                                {"first_divergence", m["first_divergence"]["position"]}});
    s.results = res;
  }
  return s;
}

bool App::save_session(const std::string& path) {
  try {
    kvlens::save_session(path, to_session());
  } catch (const InputError& e) {
    error(e.what());
    return false;
  }
  st.session_path = path;
  st.dirty = false;
  remember(st.recent_sessions, path);
  info("session saved to " + path);
  return true;
}

bool App::open_session(const std::string& path) {
  Session s;
  try {
    s = load_session(path);
  } catch (const InputError& e) {
    error(e.what());  // the open session stays as it was
    return false;
  }
  static_cast<SessionRun&>(st.inputs) = s;
  st.inputs.model_dir = s.model;
  st.inputs.image_path = s.image;
  if (st.inputs.prompt.empty()) st.inputs.prompt = kDefaultPrompt;
  if (st.inputs.templ.empty()) st.inputs.templ = kDefaultTemplate;
  st.methods.clear();
  st.edit_order.clear();
  st.timing.pending.clear();
  st.history = History{};
  for (size_t i = 0; i < s.methods.size(); ++i) {
    MethodInstance m;
    m.id = st.next_id++;
    m.params = s.methods[i];
    m.label = s.method_label(i);
    m.enabled = s.method_enabled(i);
    st.methods.push_back(m);
  }
  st.views = Views{};
  st.views.method = st.methods.empty() ? -1 : st.methods.front().id;
  apply_views_json(s.views, path);
  st.session_path = path;
  st.session_name = s.name;
  st.session_description = s.description;
  st.saved_results = s.results;
  sync_edits();
  remember(st.recent_sessions, path);
  // Missing or changed inputs: said once, the session stays open and editable.
  int problems = 0;
  struct stat sb {};
  if (::stat(model_dir().c_str(), &sb) != 0) {
    error(path + ": model folder " + model_dir() + " not found; choose one in the Model panel");
    ++problems;
  }
  if (!file_exists(image_path())) {
    error(path + ": image " + image_path() + " not found; open another in the Image panel");
    ++problems;
  } else if (!s.image_hash.empty()) {
    try {
      if (file_content_hash(image_path(), "image") != s.image_hash)
        info(path + ": image " + image_path() + " changed since the session was saved");
    } catch (const InputError& e) {
      error(e.what());
    }
  }
  st.expect_model_hash = s.model_hash;
  st.dirty = false;
  if (problems)
    error("session " + path + " opened with " + std::to_string(problems) + " missing input" + (problems > 1 ? "s" : "") +
          ": nothing can be computed until " + (problems > 1 ? "they are" : "it is") + " chosen again");
  else
    info("session " + path + " opened");
  submit();
  return true;
}

void App::sync_edits() {
  st.edits.image_path = st.inputs.image_path;
  st.edits.model_dir = st.inputs.model_dir;
  st.edits.prompt = st.inputs.prompt;
  st.edits.max_new_tokens = st.inputs.max_new_tokens;
  st.edits.param_text.clear();
  st.edits.active_text.clear();
}

void App::new_session() {
  st.inputs = Inputs{};
  st.inputs.prompt = kDefaultPrompt;
  st.inputs.templ = kDefaultTemplate;
  st.methods.clear();
  st.edit_order.clear();
  st.history = History{};
  st.views = Views{};
  st.session_path.clear();
  st.session_name.clear();
  st.session_description.clear();
  st.saved_results = nullptr;
  st.expect_model_hash.clear();
  st.dirty = false;
  sync_edits();
  info("new session: the embedded model on the sample image");
  submit();
}

void App::autosave() {
  if (!st.dirty || now() - st.last_autosave < 30) return;
  st.last_autosave = now();
  const std::string dir = state_dir();
  if (dir.empty() || !file_exists(dir)) return;
  try {
    kvlens::save_session(dir + "/autosave.json", to_session());
  } catch (const InputError& e) {
    error(e.what());
  }
}

App::~App() {
  if (export_) {
    export_->cancel = true;
    if (export_->thread.joinable()) export_->thread.join();
  }
}

bool App::export_figures(const std::string& dir, const std::vector<fig::Figure>& figures) {
  std::vector<app::FigureFormat> f;
  if (st.export_opt.png) f.push_back(app::FigureFormat::Png);
  if (st.export_opt.svg) f.push_back(app::FigureFormat::Svg);
  if (st.export_opt.pdf) f.push_back(app::FigureFormat::Pdf);
  if (figures.empty()) {
    error("export: no figures yet");
    return false;
  }
  if (exporting()) {
    error("export: one is running (" + std::to_string(export_progress().first) + " of " +
          std::to_string(export_progress().second) + " figures); cancel it or wait");
    return false;
  }
  finish_export(true);  // one that ended unreported
  export_ = std::make_unique<ExportJob>();
  ExportJob& j = *export_;
  j.total = figures.size();
  j.dir = dir;
  const bool csv = st.export_opt.csv;
  j.thread = std::thread([&j, figures, f, csv] {
    try {
      j.files = app::export_figures(figures, j.dir, f, csv, [&j](size_t done, size_t) {
                  j.done = done;
                  return !j.cancel;
                }).size();
    } catch (const std::exception& e) {
      j.error = e.what();
    }
    j.finished = true;
  });
  info("exporting " + std::to_string(figures.size()) + " figures to " + dir + "…");
  return true;
}

bool App::exporting() const { return export_ && !export_->finished; }

std::pair<size_t, size_t> App::export_progress() const {
  if (!exporting()) return {0, 0};
  return {export_->done.load(), export_->total};
}

void App::cancel_export() {
  if (export_) export_->cancel = true;
}

void App::wait_export() { finish_export(true); }

void App::finish_export(bool wait) {
  if (!export_ || (!wait && !export_->finished)) return;
  std::unique_ptr<ExportJob> j = std::move(export_);
  if (j->thread.joinable()) j->thread.join();
  const size_t done = j->done.load();
  if (!j->error.empty()) error(j->error);
  else if (done < j->total)
    info("export cancelled: " + std::to_string(done) + " of " + std::to_string(j->total) + " figures (" +
         std::to_string(j->files) + " files) written to " + j->dir);
  else
    info(std::to_string(j->total) + " figures (" + std::to_string(j->files) + " files) written to " + j->dir);
}

}  // namespace kvlens::gui
