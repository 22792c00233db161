// kvlens sweep: one method over a grid of parameter values on a dataset; metric against each
// parameter and against KV bytes, as CSV (and the eval table of every grid point).
#include <cstdio>
#include <filesystem>

#include "app/cli/commands.h"
#include "app/cli/defaults.h"
#include "app/cli/eval_common.h"
#include "app/cli/mpi_world.h"
#include "core/errors.h"
#include "app/figures/figures_eval.h"
#include "core/files.h"
#include "app/lab/sweep.h"

namespace kvlens::app {

namespace {

struct SweepArgs {
  DatasetArgs data;
  std::string method, out, json_out, metric = "CIDEr-D";
  std::vector<std::string> params;
};

void run_sweep(const SweepArgs& a) {
  const Params base = parse_method_spec(a.method);
  if (a.metric != "VQA" && a.metric != "softmax MSE") {
    bool known = false;
    for (const std::string& m : caption_metric_names()) known = known || m == a.metric;
    if (!known) throw InputError("--metric must be one of BLEU-1, BLEU-2, BLEU-3, BLEU-4, METEOR, ROUGE-L, CIDEr-D, VQA; got '" + a.metric + "'");
  }
  std::vector<SweepAxis> axes;
  for (const std::string& p : a.params) axes.push_back(parse_sweep_axis(p, base));
  if (axes.empty()) throw InputError("sweep: give at least one --param NAME=START:STOP:STEPS[:log]");
  const std::vector<EvalVariant> variants = expand_variants(sweep_specs(base, axes), {}, nullptr);
  effective_settings(a.data);  // every option is checked before anything is created
  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) throw InputError(a.out + ": cannot create the output folder (" + ec.message() + ")");
  check_writable(a.out + "/sweep.csv", "sweep CSV");
  const EvalDataset ds = load_eval_dataset(a.data.dir, a.data.annotations, a.data.images, a.data.questions);
  const std::unique_ptr<Model> model_owned = load_model(model_dir_of(a.data.model), a.data.backend);
  const Model& model = *model_owned;
  const EvalOutcome o = run_dataset(a.data, model, ds, variants, a.out, {});
  if (mpi_world().rank != 0) return;
  const EvalTable t = finish_table(o, a.data.meteor, a.out, a.json_out);
  write_file_atomic(a.out + "/sweep.csv", sweep_csv(axes, t), "sweep CSV");
  std::printf("wrote %s/sweep.csv (%zu grid points)\n", a.out.c_str(), variants.size() - 1);
  write_eval_figures(fig::sweep_figures(axes, t, a.metric), a.out + "/figures", a.data.figure_formats);
}

}  // namespace

void add_sweep_command(CLI::App& root) {
  auto a = std::make_shared<SweepArgs>();
  CLI::App* c = root.add_subcommand("sweep", "One method over a parameter grid on a dataset: metrics vs parameter and vs KV bytes");
  add_dataset_options(c, a->data);
  c->add_option("--method", a->method, "Method spec the grid starts from, e.g. 'vlcache' or 'calibquant:bits=1'")->required();
  c->add_option("--param", a->params,
                "Axis NAME=START:STOP:STEPS[:log] or NAME=V1,V2,... (repeatable: the grid is the product)")
      ->required();
  c->add_option("--out", a->out, "Output folder: sweep.csv, the eval table of the grid, per-image records")->required();
  c->add_option("--json", a->json_out, "Also write the table as JSON to this file");
  c->add_option("--metric", a->metric, "Metric of the figures (BLEU-1..4, METEOR, ROUGE-L, CIDEr-D, VQA)")->capture_default_str();
  c->callback([a] { run_sweep(*a); });
}

}  // namespace kvlens::app
