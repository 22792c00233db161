#include "app/cli/eval_common.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "app/cli/defaults.h"
#include "app/cli/model_inputs.h"
#include "app/cli/mpi_world.h"
#include "app/cli/options.h"
#include "core/errors.h"
#include "core/files.h"
#include "app/lab/session.h"
#ifdef KVLENS_HAVE_CAIRO
#include "app/figures/figure_cairo.h"
#endif

namespace kvlens::app {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string duration_text(double s) {
  char buf[32];
  const long t = static_cast<long>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t % 3600) / 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

}  // namespace

EvalSettings effective_settings(const DatasetArgs& a) {
  EvalSettings s = a.settings;
  s.vqa = !a.no_vqa;
  s.kv_storage = parse_row_storage(a.kv_storage, "--kv-storage");
  return s;
}

void add_dataset_options(CLI::App* c, DatasetArgs& a, bool standalone) {
  CLI::Option* d = c->add_option("--dataset,--scenes", a.dir,
                                 "Dataset folder: a scene set (kvlens scenes) or a COCO caption split (captions_*.json + images)");
  if (standalone) d->required();
  c->add_option("--annotations", a.annotations, "Caption annotations file (default: found in the dataset folder)");
  c->add_option("--images", a.images, "Image folder (default: the dataset folder, its images/ or its split folder)");
  c->add_option("--questions", a.questions,
                "Questions file [{\"image_id\", \"question\", \"answer\"}] (default: the annotations' \"questions\")");
  add_int(c, "--limit,--n", a.limit, 0, 10000000, "Evaluate the first N images only (0 = all)");
  c->add_option("--shard", a.shard, "Evaluate shard I of N (every N-th image from the I-th), e.g. 0/4; join with kvlens merge");
  if (standalone) {
    c->add_option("--model", a.model, kModelHelp);
    add_backend_options(c, a.backend);
    c->add_option("--kv-storage", a.kv_storage,
                  "Storage of uncompressed KV rows: fp16 (rounded to half precision) or fp32 (exact)")
        ->capture_default_str();
    c->add_option("--prompt", a.settings.prompt, "Caption prompt")->capture_default_str();
    add_int(c, "--max-new-tokens", a.settings.max_new_tokens, 1, kMaxNewTokensLimit, "Most tokens per caption or answer");
  }
  c->add_flag("--no-vqa", a.no_vqa, "Captions only (skip the dataset's questions)");
  add_meteor_options(c, a.meteor);
  c->add_option("--figure-formats", a.figure_formats, "Figure formats of sweep and calibrate: png, svg, pdf")
      ->capture_default_str();
}

void write_eval_figures(const std::vector<fig::Figure>& figs, const std::string& dir, const std::string& formats) {
#ifdef KVLENS_HAVE_CAIRO
  const auto written = export_figures(figs, dir, parse_figure_formats(formats, "--figure-formats"), true);
  std::printf("%zu figures (%zu files) written to %s\n", figs.size(), written.size(), dir.c_str());
#else
  (void)figs;
  (void)formats;
  std::fprintf(stderr, "kvlens: figures not rendered into %s: this kvlens was built without Cairo (libcairo2-dev)\n",
               dir.c_str());
#endif
}

nlohmann::json eval_manifest(const DatasetArgs& a, const EvalSettings& settings, const std::string& model_dir, const std::string& fingerprint,
                             const std::vector<EvalVariant>& variants, const std::vector<std::string>& skipped,
                             const std::string& shard_text) {
  nlohmann::json v = nlohmann::json::array();
  for (const EvalVariant& x : variants) v.push_back({{"key", x.key}, {"label", x.label}, {"method", x.method}, {"bits", x.bits}});
  return {{"kvlens_eval", 1},
          {"dataset", {{"dir", a.dir}, {"annotations", a.annotations}, {"images", a.images}, {"questions", a.questions}}},
          {"limit", a.limit},
          {"shard", shard_text},
          {"model", model_dir},
          {"fingerprint", fingerprint},
          {"settings", settings.to_json()},
          {"variants", v},
          {"skipped", skipped}};
}

std::vector<EvalVariant> variants_from_manifest(const nlohmann::json& m, const std::string& where) {
  std::vector<EvalVariant> out;
  try {
    for (const auto& x : m.at("variants")) {
      EvalVariant v;
      v.key = x.at("key").get<std::string>();
      v.label = x.at("label").get<std::string>();
      v.method = x.at("method").get<std::string>();
      v.bits = x.at("bits").get<int>();
      if (v.key != "full") v.params = parse_method_spec(v.key);
      out.push_back(std::move(v));
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": malformed manifest (" + e.what() + ")");
  }
  return out;
}

ProgressLine::ProgressLine(std::string what) : what_(std::move(what)), tty_(isatty(2) != 0) {}

void ProgressLine::operator()(const EvalProgress& p) {
  const double t = now_s();
  const bool last = p.done == p.total;
  if (!tty_ && !last && last_print_ >= 0 && t - last_print_ < 10) return;
  last_print_ = t;
  std::string line = what_ + " " + std::to_string(p.done) + "/" + std::to_string(p.total) + " images";
  if (p.done > p.computed) line += " (" + std::to_string(p.done - p.computed) + " from earlier runs)";
  if (p.computed > 0) {
    const double per = p.seconds / static_cast<double>(p.computed);
    char buf[64];
    std::snprintf(buf, sizeof buf, ", %.2f s/image", per);
    line += buf;
    if (!last) line += ", ETA " + duration_text(per * static_cast<double>(p.total - p.done));
  }
  if (last) line += ", done in " + duration_text(p.seconds);
  std::fprintf(stderr, tty_ ? "\r%s\033[K%s" : "%s%s", line.c_str(), (last || !tty_) ? "\n" : "");
  std::fflush(stderr);
}

EvalOutcome run_dataset(const DatasetArgs& a, const Model& model, const EvalDataset& ds,
                        const std::vector<EvalVariant>& variants, const std::string& out_dir,
                        const std::vector<std::string>& skipped) {
  if (mpi_launched_without_support())
    throw InputError("started by mpirun, but this kvlens was built without MPI (install libopenmpi-dev and rebuild, "
                     "or run --shard I/N processes and kvlens merge)");
  const MpiWorld& w = mpi_world();
  if (w.active() && !a.shard.empty()) throw InputError("--shard cannot be combined with mpirun (each rank takes one shard)");
  Shard shard = a.shard.empty() ? Shard{} : parse_shard(a.shard);
  if (w.active()) shard = {w.rank, w.size};
  EvalSettings s = effective_settings(a);
  s.templ = model_template(model, s.templ);  // (the checkpoint's chat template where it ships one)
  const std::string fp = record_fingerprint(model_fingerprint(model.dir()), s);
  const std::vector<size_t> mine = shard_positions(ds.images.size(), static_cast<size_t>(a.limit), shard);
  if (!out_dir.empty() && w.rank == 0)
    write_file_atomic(out_dir + "/manifest.json",
                      eval_manifest(a, s, model.dir(), fp, variants, skipped, w.active() ? "all" : shard.text()).dump(1) + "\n",
                      "eval manifest");
  const std::string tag = w.active() ? "[eval rank " + std::to_string(w.rank) + "/" + std::to_string(w.size) + "]" : "[eval]";
  ProgressLine progress(tag);
  EvalOutcome o;
  o.ds = &ds;
  o.variants = variants;
  o.notes = skipped;
  o.vqa = s.vqa;
  o.records = run_eval(model, ds, mine, variants, s, fp, out_dir, progress);
  o.positions = mine;
  if (!w.active()) return o;
  // Rank 0 gathers every rank's records and keeps the files of the others next to its own.
  nlohmann::json j = nlohmann::json::array();
  for (const auto& kv : o.records) j.push_back(kv.second.to_json());
  const std::vector<std::string> parts = mpi_gather(j.dump());
  o.records.clear();
  o.positions.clear();
  if (w.rank != 0) return o;
  for (size_t r = 0; r < parts.size(); ++r)
    for (const auto& rec : nlohmann::json::parse(parts[r])) {
      ImageRecord ir = ImageRecord::from_json(rec, "rank " + std::to_string(r));
      if (!out_dir.empty() && r != 0)
        write_file_atomic(out_dir + "/images/" + std::to_string(ir.image_id) + ".json", ir.to_json().dump() + "\n",
                          "image record");
      o.records[ir.image_id] = std::move(ir);
    }
  o.positions = shard_positions(ds.images.size(), static_cast<size_t>(a.limit), Shard{});
  return o;
}

EvalTable finish_table(const EvalOutcome& o, const MeteorOptions& meteor, const std::string& out_dir,
                       const std::string& json_out) {
  std::string status;
  const std::unique_ptr<MeteorScorer> scorer = start_meteor(meteor, status);
  EvalTable t = build_eval_table(*o.ds, o.positions, o.variants, o.records, o.vqa, scorer.get(), status);
  for (const std::string& n : o.notes) t.notes.insert(t.notes.begin(), n);
  if (!out_dir.empty()) write_eval_table(t, out_dir);
  if (!json_out.empty()) write_file_atomic(json_out, t.to_json().dump(1) + "\n", "eval JSON");
  std::printf("%s", t.markdown().c_str());
  std::fflush(stdout);
  return t;
}

}  // namespace kvlens::app
