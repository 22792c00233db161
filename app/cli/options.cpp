#include "app/cli/options.h"

#include "core/errors.h"
#include "core/numbers.h"

namespace kvlens::app {

namespace {

double real_in(const std::string& text, const std::string& name, double lo, double hi, bool lo_open) {
  const double x = parse_real(text, name, lo, hi);
  if (lo_open && x <= lo)
    throw InputError(name + " must be in (" + format_number(lo) + ", " + format_number(hi) + "], got " + text);
  return x;
}

std::string joined(const std::vector<double>& v) {
  std::string s;
  for (double x : v) s += (s.empty() ? "" : " ") + format_number(x);
  return s;
}

}  // namespace

CLI::Option* add_int(CLI::App* app, const std::string& name, int& var, int lo, int hi, const std::string& help) {
  return app
      ->add_option_function<std::string>(
          name, [&var, name, lo, hi](const std::string& s) { var = static_cast<int>(parse_integer(s, name, lo, hi)); },
          help + " [" + std::to_string(lo) + ", " + std::to_string(hi) + "]")
      ->type_name("INT")
      ->default_str(std::to_string(var));
}

CLI::Option* add_int64(CLI::App* app, const std::string& name, int64_t& var, int64_t lo, int64_t hi,
                       const std::string& help) {
  return app
      ->add_option_function<std::string>(
          name, [&var, name, lo, hi](const std::string& s) { var = parse_integer(s, name, lo, hi); },
          help + " [" + std::to_string(lo) + ", " + std::to_string(hi) + "]")
      ->type_name("INT");
}

CLI::Option* add_seed(CLI::App* app, const std::string& name, uint64_t& var, const std::string& help) {
  return app
      ->add_option_function<std::string>(
          name, [&var, name](const std::string& s) { var = parse_unsigned(s, name); }, help + " [0, 2^64-1]")
      ->type_name("UINT")
      ->default_str(std::to_string(var));
}

CLI::Option* add_real(CLI::App* app, const std::string& name, double& var, double lo, double hi,
                      const std::string& help, bool lo_open) {
  return app
      ->add_option_function<std::string>(
          name, [&var, name, lo, hi, lo_open](const std::string& s) { var = real_in(s, name, lo, hi, lo_open); },
          help + " " + (lo_open ? "(" : "[") + format_number(lo) + ", " + format_number(hi) + "]")
      ->type_name("FLOAT")
      ->default_str(format_number(var));
}

CLI::Option* add_real(CLI::App* app, const std::string& name, float& var, double lo, double hi,
                      const std::string& help, bool lo_open) {
  return app
      ->add_option_function<std::string>(
          name,
          [&var, name, lo, hi, lo_open](const std::string& s) {
            var = static_cast<float>(real_in(s, name, lo, hi, lo_open));
          },
          help + " " + (lo_open ? "(" : "[") + format_number(lo) + ", " + format_number(hi) + "]")
      ->type_name("FLOAT")
      ->default_str(format_number(var));
}

CLI::Option* add_reals(CLI::App* app, const std::string& name, std::vector<double>& var, double lo, double hi,
                       const std::string& help) {
  return app
      ->add_option_function<std::vector<std::string>>(
          name,
          [&var, name, lo, hi](const std::vector<std::string>& v) {
            var.clear();
            for (const std::string& s : v) var.push_back(parse_real(s, name, lo, hi));
          },
          help + " (each in " + range_text(lo, hi) + ")")
      ->type_name("FLOAT ...")
      ->default_str(joined(var));
}

}  // namespace kvlens::app
