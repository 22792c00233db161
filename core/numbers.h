// Numbers that come from outside (command-line options, method specs, config.json, sessions,
// preprocessor configs, annotation files) are parsed here and nowhere else: the whole text must
// be the number, floats must be finite, integers must have no fraction and fit the range. Each
// message names the field and what was expected, e.g.
//   "num_attention_heads must be an integer in [1, 4096], got 4294967304".
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace kvlens {

double parse_real(const std::string& text, const std::string& field, double lo, double hi);
int64_t parse_integer(const std::string& text, const std::string& field, int64_t lo, int64_t hi);
uint64_t parse_unsigned(const std::string& text, const std::string& field, uint64_t hi = UINT64_MAX);

// JSON values: a number (a float with an integral value counts as an integer: 8.0 → 8).
double json_real(const nlohmann::json& v, const std::string& field, double lo, double hi);
int64_t json_integer(const nlohmann::json& v, const std::string& field, int64_t lo, int64_t hi);
inline int json_int(const nlohmann::json& v, const std::string& field, int lo, int hi) {
  return static_cast<int>(json_integer(v, field, lo, hi));
}

// Shortest text that reads back as the same double ("0.1", "3", "1e-05").
std::string format_number(double x);
// "[lo, hi]" with format_number.
std::string range_text(double lo, double hi);

}  // namespace kvlens
