#include "core/json_file.h"

#include <sys/stat.h>

#include <fstream>

#include "core/errors.h"

namespace kvlens {

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream f(path);
  if (!f) throw InputError(path + ": cannot open " + what);
  try {
    return nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw InputError(path + ": not valid JSON (" + e.what() + ")");
  }
}

}  // namespace kvlens
