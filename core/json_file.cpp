#include "core/json_file.h"

#include "core/errors.h"

namespace kvlens {

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  const std::string text = read_input_file(path, what, uint64_t{1} << 30);
  try {
    return nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw InputError(path + ": not valid JSON (" + e.what() + ")");
  }
}

}  // namespace kvlens
