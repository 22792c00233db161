// Subcommands of the kvlens CLI. Each adds itself to the root app; its callback does the work
// and throws kvlens::InputError on bad input, which main() turns into a one-line message and
// exit code 2.
#pragma once
#include <CLI/CLI.hpp>

namespace kvlens::app {

void add_caption_command(CLI::App& root);
void add_scenes_command(CLI::App& root);
void add_run_commands(CLI::App& root);  // methods, run, calibrate, demo
void add_eval_command(CLI::App& root);
void add_bench_command(CLI::App& root);

}  // namespace kvlens::app
