// What `kvlens eval`, `merge`, `sweep` and `calibrate --by cider` share: the dataset and
// generation options, the output folder's manifest, the progress line, and the last step that
// turns per-image records into the results table.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "app/cli/backend_option.h"
#include "app/cli/commands.h"
#include "app/figures/figures.h"
#include "core/eval/eval_dataset.h"
#include "core/eval/eval_table.h"
#include "app/lab/eval_runner.h"

namespace kvlens::app {

struct DatasetArgs {
  std::string dir, annotations, images, questions;
  int limit = 0;
  std::string shard;  // "I/N"; empty = all (or one shard per rank under mpirun)
  std::string model;
  BackendOptions backend;
  std::string kv_storage = "fp16";  // --kv-storage
  EvalSettings settings;
  bool no_vqa = false;
  MeteorOptions meteor;
  std::string figure_formats = "png,svg,pdf";
};

// The generation settings with the flags applied (--no-vqa).
EvalSettings effective_settings(const DatasetArgs& a);

// --dataset (alias --scenes), --annotations, --images, --questions, --limit (alias --n),
// --shard, --no-vqa, METEOR options, and with `standalone` a required --dataset and --model,
// --prompt, --max-new-tokens (commands that have their own leave standalone false).
void add_dataset_options(CLI::App* c, DatasetArgs& a, bool standalone = true);

// Renders `figs` into `dir` (PNG/SVG/PDF per a.figure_formats, and each figure's data as CSV);
// without Cairo says on stderr that figures were not rendered.
void write_eval_figures(const std::vector<fig::Figure>& figs, const std::string& dir, const std::string& formats);

// kvlens calibrate with --dataset: the τ1/τ2 grid of `base` evaluated on the dataset (captions,
// metrics, softmax MSE against the full cache), the grid as a table and heatmaps, and the best
// pair by CIDEr-D and by softmax MSE; `by` ("cider" or "mse") names the one reported as best.
void run_calibrate_dataset(const DatasetArgs& a, const std::string& base, const std::vector<double>& taus,
                           const std::string& by, const std::string& out, const std::string& report);

// The manifest (out/manifest.json) of a run: what `merge` and a resumed run check.
nlohmann::json eval_manifest(const DatasetArgs& a, const EvalSettings& settings, const std::string& model_dir, const std::string& fingerprint,
                             const std::vector<EvalVariant>& variants, const std::vector<std::string>& skipped,
                             const std::string& shard_text);
std::vector<EvalVariant> variants_from_manifest(const nlohmann::json& m, const std::string& where);

// A progress line on stderr with the rate and the time left.
class ProgressLine {
 public:
  explicit ProgressLine(std::string what);
  void operator()(const EvalProgress& p);

 private:
  std::string what_;
  bool tty_;
  double last_print_ = -1;
};

struct EvalOutcome {
  const EvalDataset* ds = nullptr;
  std::vector<size_t> positions;
  bool vqa = true;
  std::vector<EvalVariant> variants;
  std::vector<std::string> notes;
  std::map<int64_t, ImageRecord> records;
};

// Evaluates (one shard per MPI rank under mpirun); on rank 0 returns every image's record,
// on other ranks returns with `records` empty and `positions` empty.
EvalOutcome run_dataset(const DatasetArgs& a, const Model& model, const EvalDataset& ds,
                        const std::vector<EvalVariant>& variants, const std::string& out_dir,
                        const std::vector<std::string>& skipped);

// Scores the records into the table (METEOR per --meteor options), writes it under out_dir
// (when given) and to json_out (when given), and prints the Markdown table.
EvalTable finish_table(const EvalOutcome& o, const MeteorOptions& meteor, const std::string& out_dir,
                       const std::string& json_out);

}  // namespace kvlens::app
