// kvlens methods / run / calibrate: compression methods on one shared prefill.
#include <cstdio>

#include "app/cli/backend_option.h"
#include "app/cli/commands.h"
#include "app/cli/defaults.h"
#include "app/cli/model_inputs.h"
#include "app/cli/eval_common.h"
#include "app/cli/options.h"
#include "app/cli/trace_option.h"
#include "core/errors.h"
#include "core/files.h"
#include "app/lab/session.h"
#include "app/lab/experiment.h"
#include "app/lab/worker.h"

namespace kvlens::app {

namespace {

struct RunArgs {
  std::string model, image, report, session, save_session, trace;
  std::string kv_storage;  // empty = the session's, else fp16
  std::vector<std::string> methods;
  ExperimentOptions opt;
  FigureArgs figures;
  BackendOptions backend;
  int64_t memory_limit_mb = 0;  // --memory-limit-mb (0 = what the backend has free)
};

void add_common(CLI::App* c, RunArgs& a) {
  c->add_option("--model", a.model, kModelHelp);
  add_backend_options(c, a.backend);
  c->add_option("--image", a.image, "Image file (default: the embedded sample image; none for a text-only model)");
  c->add_option("--prompt", a.opt.prompt, "Text in place of {prompt} in the template")->capture_default_str();
  c->add_option("--template", a.opt.templ, "Prompt template with <image> and {prompt}; left at this default, the checkpoint's own chat template where it ships one (a text-only model without one: {prompt} alone)")->capture_default_str();
  add_int(c, "--max-new-tokens", a.opt.max_new_tokens, 1, kMaxNewTokensLimit, "Most tokens to generate");
  c->add_option("--kv-storage", a.kv_storage,
                "Storage of uncompressed KV rows: fp16 (rounded to half precision, 2 B/value; default) or fp32 "
                "(exact, 4 B/value). Diagnostics compare against the exact prefill either way");
  add_int(c, "--diag-steps", a.opt.diag_steps, 1, kMaxDiagSteps, "Decode steps compared against the full cache");
  add_real(c, "--sparsity-p", a.opt.sparsity_p, 0, 1, "Sparsity threshold p (A_ij < p·max_j A_ij counts as zero)");
  add_real(c, "--hit-budget", a.opt.hit_budget, kMinHitBudget, 1, "CacheHitRate k as a share of the prompt");
  add_int(c, "--hit-window", a.opt.hit_window, 1, 1 << 16, "Queries of the sliding-window scoring strategy");
  add_int64(c, "--memory-limit-mb", a.memory_limit_mb, 0, int64_t{1} << 40,
            "Backend memory the run may use beyond the weights, in MB (default: what the backend has free); "
            "a run whose plan needs more is refused before it starts");
}

void add_session_options(CLI::App* c, RunArgs& a) {
  c->add_option("--session", a.session, "Session JSON (sessions/*.json): model, image, prompt, methods, options");
  c->add_option("--save-session", a.save_session, "Write this run's setup as a session JSON");
}

void write_json(const std::string& path, const nlohmann::json& j) {
  write_file_atomic(path, j.dump(1) + "\n", "report");
}

struct RunMethod {
  Params params;
  std::string label;
};

// Tells (on stderr) when the model or image differs from the one a session was saved with.
void note_changed_inputs(const Session& s, const std::string& model, const std::string& image) {
  auto check = [](const std::string& saved, const std::string& now, const std::string& what) {
    if (!saved.empty() && saved != now)
      std::fprintf(stderr, "kvlens: note: %s differs from the one the session was saved with (%s, now %s)\n",
                   what.c_str(), saved.c_str(), now.c_str());
  };
  if (!s.model_hash.empty()) check(s.model_hash, folder_content_hash(model, "model folder"), "model folder " + model);
  if (!s.image_hash.empty()) check(s.image_hash, file_content_hash(image, "image"), "image " + image);
}

// A session file fills what the command line left unset; --method adds to its methods. A
// session's disabled methods do not run.
RunArgs with_session(const RunArgs& in, std::vector<RunMethod>& specs) {
  RunArgs a = in;
  if (!a.session.empty()) {
    const Session s = load_session(a.session);
    if (a.model.empty()) a.model = s.model;
    if (a.image.empty()) a.image = s.image;
    if (!s.prompt.empty() && a.opt.prompt == kDefaultPrompt) a.opt.prompt = s.prompt;
    if (!s.templ.empty() && a.opt.templ == kDefaultTemplate) a.opt.templ = s.templ;
    a.opt.max_new_tokens = s.max_new_tokens;
    if (a.kv_storage.empty()) a.kv_storage = s.kv_storage;
    a.opt.diag_steps = s.diag_steps;
    a.opt.sparsity_p = s.sparsity_p;
    a.opt.hit_budget = s.hit_budget;
    for (size_t i = 0; i < s.methods.size(); ++i)
      if (s.method_enabled(i)) specs.push_back({s.methods[i], s.method_label(i)});
    const std::string model = model_dir_of(a.model);
    note_changed_inputs(s, model, a.image.empty() ? default_image_for(model) : a.image);
  }
  for (const auto& m : a.methods) specs.push_back({parse_method_spec(m), ""});
  if (specs.empty()) throw InputError("no method to run: give --method SPEC or --session FILE");
  a.opt.kv_storage = parse_row_storage(a.kv_storage.empty() ? "fp16" : a.kv_storage, "--kv-storage");
  a.opt.memory_limit = a.memory_limit_mb * 1000000;
  return a;
}

void run_methods(const RunArgs& args) {
  // Validate every spec before any model work.
  std::vector<RunMethod> specs;
  RunArgs a = with_session(args, specs);
  check_figure_args(a.figures);
  a.opt.attention_maps = a.figures.attention_maps || !a.figures.dir.empty();
  a.opt.attention_bins = a.figures.attention_bins;
  // Everything is validated before anything is written: outputs that cannot be written, the
  // model and the image are refused first.
  if (!a.report.empty()) check_writable(a.report, "report");
  if (!a.save_session.empty()) check_writable(a.save_session, "session file");
  start_trace(a.trace);
  const std::unique_ptr<Model> model_owned = load_model(model_dir_of(a.model), a.backend);
  const Model& model = *model_owned;
  const RGBImage img = command_image(model, a.image);
  const std::string image_path = command_image_path(model, a.image);
  a.opt.templ = model_template(model, a.opt.templ);
  if (!a.save_session.empty()) {
    Session s;
    static_cast<SessionRun&>(s) = session_run_of(a.opt);
    s.model = a.model;
    s.image = a.image;
    for (const RunMethod& m : specs) {
      s.methods.push_back(m.params);
      s.labels.push_back(m.label);
    }
    s.model_hash = folder_content_hash(model_dir_of(a.model), "model folder");
    if (!image_path.empty()) s.image_hash = file_content_hash(image_path, "image");
    save_session(a.save_session, s);
  }
  Experiment ex = start_experiment(model, img, a.opt);
  if (!image_path.empty()) ex.references = find_image_references(image_path);
  // With the image's reference captions, each caption's CIDEr-D beside it.
  auto cider = [&](const std::string& caption) {
    char b[32] = "";
    if (ex.references) std::snprintf(b, sizeof b, "%8.3f ", ex.references->cider_d(caption));
    return std::string(b);
  };
  if (ex.references)
    std::printf("CIDEr-D against the %zu reference captions of this image in %s\n", ex.references->refs.size(),
                ex.references->annotations.c_str());
  if (!model.info().takes_image())
    std::printf("%s\n", prompt_span_line(model, ex.prefill).c_str());
  else if (model.info().image_dependent)  // (anyres: the image decides the tiles and the count)
    std::printf("visual tokens of this %dx%d image: %s\n", img.width, img.height, ex.prefill.layout.describe().c_str());
  std::printf("%-44s %10s %7s %10s %9s  %s%s\n", "method", "KV bytes", "ratio", "softmaxMSE", "diverges",
              ex.references ? " CIDEr-D " : "", "caption");
  const std::string ref = std::string("full (") + row_storage_name(a.opt.kv_storage) + " reference)";
  const double full_bytes = static_cast<double>(ex.full.bytes_after_prefill.total());
  std::printf("%-44s %10lld %7.2f %10s %9s  %s%s\n", ref.c_str(),
              static_cast<long long>(ex.full.bytes_after_prefill.total()),
              full_bytes > 0 ? ex.full_fp16_bytes.total() / full_bytes : 0.0, "-", "-", cider(ex.full.text).c_str(),
              ex.full.text.c_str());
  for (const RunMethod& m : specs) {
    const Params& p = m.params;
    ex.runs.push_back(run_method(model, ex, p, a.opt));
    ex.runs.back().label = m.label;
    const MethodRun& r = ex.runs.back();
    const std::string div = r.divergence.position < 0 ? "never" : "@" + std::to_string(r.divergence.position);
    std::printf("%-44s %10lld %7.2f %10.3g %9s  %s%s\n", (m.label.empty() ? p.short_spec() : m.label).c_str(),
                static_cast<long long>(r.result.bytes_after_prefill.total()), r.compression_vs_fp16,
                r.mean_softmax_mse, div.c_str(), cider(r.result.text).c_str(), r.result.text.c_str());
  }
  if (!a.report.empty() || !a.figures.dir.empty()) {
    const nlohmann::json report = experiment_json(model, ex, a.opt);
    if (!a.report.empty()) write_json(a.report, report);
    if (!a.figures.dir.empty()) {
      if (model.info().takes_image()) {
        const RGBImage shown = image_for_views(model, img);
        write_report_figures(report, a.figures, &shown);
      } else {
        write_report_figures(report, a.figures, nullptr);
      }
    }
  }
  finish_trace(a.trace);
}

void list_methods() {
  for (const MethodSpec& m : methods()) {
    std::printf("%s  [%s]  %s\n", m.name.c_str(), m.family.c_str(), m.summary.c_str());
    for (const ParamSpec& p : m.params) {
      std::string range;
      switch (p.type) {
        case ParamSpec::Type::Int:
        case ParamSpec::Type::Float: {
          char buf[64];
          std::snprintf(buf, sizeof buf, "[%g, %g]", p.min, p.max);
          range = buf;
          break;
        }
        case ParamSpec::Type::Bool: range = "{true, false}"; break;
        case ParamSpec::Type::Choice:
          for (const auto& c : p.choices) range += (range.empty() ? "{" : ", ") + c;
          range += "}";
          break;
        case ParamSpec::Type::String: range = "text"; break;
      }
      std::printf("    %-14s %-28s default %-8s %s\n", p.name.c_str(), range.c_str(), p.def.c_str(), p.help.c_str());
    }
    for (const auto& pr : m.presets) {
      std::string v;
      for (const auto& kv : pr.second) v += (v.empty() ? "" : ",") + kv.first + "=" + kv.second;
      std::printf("    preset %-7s %s\n", pr.first.c_str(), v.c_str());
    }
  }
}

void run_calibrate(const RunArgs& args, const std::string& base, const std::vector<double>& taus) {
  RunArgs a = args;
  a.opt.kv_storage = parse_row_storage(a.kv_storage.empty() ? "fp16" : a.kv_storage, "--kv-storage");
  a.opt.memory_limit = a.memory_limit_mb * 1000000;
  if (taus.empty()) throw InputError("--taus needs at least one value");
  parse_method_spec(base);  // validate before loading
  if (!a.report.empty()) check_writable(a.report, "report");
  const std::unique_ptr<Model> model_owned = load_model(model_dir_of(a.model), a.backend);
  const Model& model = *model_owned;
  const RGBImage img = command_image(model, a.image);
  a.opt.templ = model_template(model, a.opt.templ);
  const Experiment ex = start_experiment(model, img, a.opt);
  const auto pts = calibrate_grid(model, ex, base, taus, a.opt);
  std::printf("%6s %6s %12s %12s %s\n", "tau1", "tau2", "softmaxMSE", "KL", "caption==full");
  const CalibrationPoint* best = nullptr;
  nlohmann::json j = nlohmann::json::array();
  for (const auto& p : pts) {
    std::printf("%6g %6g %12.4g %12.4g %s\n", p.tau1, p.tau2, p.mse, p.kl, p.same_caption ? "yes" : "no");
    if (!best || p.mse < best->mse) best = &p;
    j.push_back({{"tau1", p.tau1}, {"tau2", p.tau2}, {"softmax_mse", p.mse}, {"kl", p.kl}, {"same_caption", p.same_caption}});
  }
  std::printf("best by softmax MSE: tau1=%g tau2=%g\n", best->tau1, best->tau2);
  if (!a.report.empty())
    write_json(a.report, {{"base", base}, {"grid", j}, {"best", {{"tau1", best->tau1}, {"tau2", best->tau2}}}});
}

}  // namespace

void add_run_commands(CLI::App& root) {
  CLI::App* m = root.add_subcommand("methods", "List compression methods with parameters, ranges, defaults and help");
  m->callback([] { list_methods(); });

  auto ra = std::make_shared<RunArgs>();
  CLI::App* r = root.add_subcommand("run", "Run methods on one shared prefill and compare each with the full cache");
  add_common(r, *ra);
  add_session_options(r, *ra);
  r->add_option("--method", ra->methods, "Method spec, e.g. 'calibquant:bits=1,tau1=0,tau2=3' (repeatable)");
  r->add_option("--report", ra->report, "Write captions, ids, bytes, timings and every diagnostic as JSON");
  add_trace_option(r, ra->trace);
  add_figure_options(r, ra->figures);
  r->callback([ra] { run_methods(*ra); });

  auto da = std::make_shared<RunArgs>();
  da->methods = {"calibquant:bits=1", "zipcache", "vlcache:budget=0.1", "lookm", "stack:evict=vlcache,quant=calibquant"};
  CLI::App* d = root.add_subcommand(
      "demo", "The embedded model on the sample image: full cache next to CalibQuant, ZipCache, VL-Cache, LOOK-M and a stack");
  add_common(d, *da);
  add_session_options(d, *da);
  d->add_option("--method", da->methods, "Method specs to compare")->capture_default_str();
  d->add_option("--report", da->report, "Write the JSON report here");
  add_figure_options(d, da->figures);
  d->callback([da] { run_methods(*da); });

  auto ca = std::make_shared<RunArgs>();
  auto base = std::make_shared<std::string>("calibquant:bits=1");
  auto taus = std::make_shared<std::vector<double>>(std::vector<double>{0, 1, 2, 3});
  auto by = std::make_shared<std::string>("mse");
  auto data = std::make_shared<DatasetArgs>();
  auto out = std::make_shared<std::string>();
  CLI::App* c = root.add_subcommand(
      "calibrate", "Grid-search CalibQuant tau1/tau2: by softmax MSE on one image, or by CIDEr-D and softmax MSE on a dataset");
  add_common(c, *ca);
  c->add_option("--base", *base, "CalibQuant spec the grid starts from")->capture_default_str();
  add_reals(c, "--taus", *taus, 0, 8, "Values tried for both tau1 and tau2");
  c->add_option("--by", *by, "Criterion of the best pair: mse (softmax MSE) or cider (CIDEr-D, needs --dataset)")
      ->check(CLI::IsMember({"mse", "cider"}))
      ->capture_default_str();
  add_dataset_options(c, *data, false);
  c->add_option("--out", *out, "With --dataset: folder for the grid table, heatmaps, eval table and per-image records");
  c->add_option("--report", ca->report, "Write the grid as JSON");
  c->callback([ca, base, taus, by, data, out] {
    if (data->dir.empty()) {
      if (*by == "cider") throw InputError("calibrate --by cider needs --dataset DIR (CIDEr-D is a dataset metric)");
      run_calibrate(*ca, *base, *taus);
      return;
    }
    DatasetArgs d = *data;
    d.model = ca->model;
    d.backend = ca->backend;
    if (!ca->kv_storage.empty()) d.kv_storage = ca->kv_storage;
    d.settings.prompt = ca->opt.prompt;
    d.settings.templ = ca->opt.templ;
    d.settings.max_new_tokens = ca->opt.max_new_tokens;
    run_calibrate_dataset(d, *base, *taus, *by, *out, ca->report);
  });
}

}  // namespace kvlens::app
