// Subcommands of the kvlens CLI. Each adds itself to the root app; its callback does the work
// and throws kvlens::InputError on bad input, which main() turns into a one-line message and
// exit code 2.
#pragma once
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "app/lab/experiment.h"
#include "core/data/image.h"
#include "core/eval/coco.h"
#include "core/eval/meteor.h"

namespace kvlens::app {

void add_caption_command(CLI::App& root);
void add_scenes_command(CLI::App& root);
void add_run_commands(CLI::App& root);  // methods, run, calibrate, demo
void add_eval_command(CLI::App& root);
void add_bench_command(CLI::App& root);
void add_score_command(CLI::App& root);
void add_sweep_command(CLI::App& root);

// METEOR for the commands that score captions (score, eval, merge, sweep, calibrate).
struct MeteorOptions {
  std::string jar;
  bool off = false;
};
void add_meteor_options(CLI::App* c, MeteorOptions& o);
// The scorer, or null with `status` saying why METEOR is unavailable.
std::unique_ptr<MeteorScorer> start_meteor(const MeteorOptions& o, std::string& status);
// The metric lines of `kvlens score` (stdout) and its warnings (stderr).
void print_scores(const CaptionScores& s);

void add_figures_command(CLI::App& root);

// --figures DIR / --figure-formats / --attention-maps / --attention-bins of run and demo
// (app/cli/cmd_figures.cpp).
struct FigureArgs {
  std::string dir, formats = "png,svg,pdf";
  bool attention_maps = false;
  int attention_bins = ExperimentOptions{}.attention_bins;
};
void add_figure_options(CLI::App* c, FigureArgs& a);
void check_figure_args(const FigureArgs& a);  // before any work: formats, the folder, Cairo
// `image`: the image as the model sees it (null: unknown), under the token-fate figures.
void write_report_figures(const nlohmann::json& report, const FigureArgs& a, const RGBImage* image = nullptr);

}  // namespace kvlens::app
