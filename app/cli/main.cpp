// kvlens command line: the only place that prints, exits and decides what a failure means.

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "app/cli/commands.h"
#include "app/cli/mpi_world.h"
#include "core/errors.h"
#include "core/parallel.h"

int main(int argc, char** argv) {
  kvlens::app::mpi_start(argc, argv);
  kvlens::threads_from_environment();
  CLI::App root{"kvlens: a lab for KV-cache compression in LLaVA-style vision-language models"};
  root.require_subcommand(1);
  kvlens::app::add_caption_command(root);
  kvlens::app::add_scenes_command(root);
  kvlens::app::add_run_commands(root);
  kvlens::app::add_eval_command(root);
  kvlens::app::add_bench_command(root);
  kvlens::app::add_score_command(root);
  kvlens::app::add_sweep_command(root);
  kvlens::app::add_figures_command(root);
  try {
    root.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return root.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return root.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line: what was wrong, and where the expected forms are listed.
    std::string what = e.what();
    while (!what.empty() && (what.back() == '\n' || what.back() == ' ')) what.pop_back();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::string cmd = "kvlens";
    for (const CLI::App* sub : root.get_subcommands()) cmd += " " + sub->get_name();
    std::fprintf(stderr, "kvlens: error: %s (see %s --help)\n", what.c_str(), cmd.c_str());
    return kvlens::app::mpi_exit(2);
  } catch (const kvlens::InputError& e) {
    std::fprintf(stderr, "kvlens: error: %s\n", e.what());
    return kvlens::app::mpi_exit(2);
  } catch (const kvlens::DeviceError& e) {
    std::fprintf(stderr, "kvlens: device error: %s\n", e.what());
    return kvlens::app::mpi_exit(1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvlens: internal error: %s\n", e.what());
    return kvlens::app::mpi_exit(1);
  }
  return kvlens::app::mpi_exit(0);
}
