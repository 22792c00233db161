// Numeric command-line options: taken as text and parsed by core/numbers.h, the one place
// kvlens reads numbers, so "--max-new-tokens 8.5", "--top-p nan" or "--seed 2^64" are refused
// with one line naming the option and the expected range, like every other bad value.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace kvlens::app {

CLI::Option* add_int(CLI::App* app, const std::string& name, int& var, int lo, int hi, const std::string& help);
CLI::Option* add_int64(CLI::App* app, const std::string& name, int64_t& var, int64_t lo, int64_t hi,
                       const std::string& help);
CLI::Option* add_seed(CLI::App* app, const std::string& name, uint64_t& var, const std::string& help);
// Reals in [lo, hi]; with `lo_open` the lower end is excluded ("(0, 1]").
CLI::Option* add_real(CLI::App* app, const std::string& name, double& var, double lo, double hi,
                      const std::string& help, bool lo_open = false);
CLI::Option* add_real(CLI::App* app, const std::string& name, float& var, double lo, double hi,
                      const std::string& help, bool lo_open = false);
CLI::Option* add_reals(CLI::App* app, const std::string& name, std::vector<double>& var, double lo, double hi,
                       const std::string& help);

}  // namespace kvlens::app
