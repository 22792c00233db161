// Subcommands of the kvlens CLI. Each adds itself to the root app; its callback does the work
// and throws kvlens::InputError on bad input, which main() turns into a one-line message and
// exit code 2.
#pragma once
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <string>

namespace kvlens::app {

void add_caption_command(CLI::App& root);
void add_scenes_command(CLI::App& root);
void add_run_commands(CLI::App& root);  // methods, run, calibrate, demo
void add_eval_command(CLI::App& root);
void add_bench_command(CLI::App& root);
void add_figures_command(CLI::App& root);

// --figures DIR / --figure-formats / --attention-maps of run and demo (app/cmd_figures.cpp).
struct FigureArgs {
  std::string dir, formats = "png,svg,pdf";
  bool attention_maps = false;
};
void add_figure_options(CLI::App* c, FigureArgs& a);
void check_figure_args(const FigureArgs& a);  // before any work: formats, the folder, Cairo
void write_report_figures(const nlohmann::json& report, const FigureArgs& a);

}  // namespace kvlens::app
