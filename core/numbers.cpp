#include "core/numbers.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/errors.h"

namespace kvlens {

namespace {

std::string quoted(const std::string& s) { return "'" + s + "'"; }

bool whole_number_text(const std::string& s) {
  // strtod accepts leading spaces, "inf", "nan" and hex; none of those is a number here.
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s)
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '+' || c == '-' || c == '.' || c == 'e' || c == 'E'))
      return false;
  return true;
}

std::string int_range(int64_t lo, int64_t hi) { return "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]"; }

}  // namespace

std::string format_number(double x) {
  if (x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  char buf[64];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

std::string range_text(double lo, double hi) { return "[" + format_number(lo) + ", " + format_number(hi) + "]"; }

double parse_real(const std::string& text, const std::string& field, double lo, double hi) {
  const std::string want = field + " must be a finite number in " + range_text(lo, hi) + ", got ";
  if (!whole_number_text(text)) throw InputError(want + quoted(text));
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(x))
    throw InputError(want + quoted(text));
  if (x < lo || x > hi) throw InputError(field + " must be in " + range_text(lo, hi) + ", got " + text);
  return x;
}

int64_t parse_integer(const std::string& text, const std::string& field, int64_t lo, int64_t hi) {
  const std::string want = field + " must be an integer in " + int_range(lo, hi) + ", got ";
  if (text.empty() || text.find_first_not_of("+-0123456789") != std::string::npos ||
      text.find_first_of("+-", 1) != std::string::npos)
    throw InputError(want + quoted(text));
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(text.c_str(), &end, 10);
  if (end != text.c_str() + text.size() || errno == ERANGE || x < lo || x > hi) throw InputError(want + text);
  return x;
}

uint64_t parse_unsigned(const std::string& text, const std::string& field, uint64_t hi) {
  const std::string want = field + " must be an integer in [0, " + std::to_string(hi) + "], got ";
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) throw InputError(want + quoted(text));
  errno = 0;
  char* end = nullptr;
  const unsigned long long x = std::strtoull(text.c_str(), &end, 10);
  if (end != text.c_str() + text.size() || errno == ERANGE || x > hi) throw InputError(want + text);
  return x;
}

double json_real(const nlohmann::json& v, const std::string& field, double lo, double hi) {
  if (!v.is_number())
    throw InputError(field + " must be a finite number in " + range_text(lo, hi) + ", got " + v.dump());
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    throw InputError(field + " must be in " + range_text(lo, hi) + ", got " + v.dump());
  return x;
}

int64_t json_integer(const nlohmann::json& v, const std::string& field, int64_t lo, int64_t hi) {
  const std::string want = field + " must be an integer in " + int_range(lo, hi) + ", got " + v.dump();
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX) || static_cast<int64_t>(u) < lo || static_cast<int64_t>(u) > hi)
      throw InputError(want);
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) throw InputError(want);
    return x;
  }
  if (v.is_number_float()) {
    const double x = v.get<double>();
    // Exactly integral and inside the range (which both fit a double exactly for the ranges
    // kvlens uses), e.g. 8.0.
    if (!std::isfinite(x) || x != std::floor(x) || x < static_cast<double>(lo) || x > static_cast<double>(hi))
      throw InputError(want);
    return static_cast<int64_t>(x);
  }
  throw InputError(want);
}

}  // namespace kvlens
