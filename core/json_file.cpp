#include "core/json_file.h"

#include "core/errors.h"

namespace kvlens {

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  const std::string text = read_input_file(path, what, uint64_t{1} << 30);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 2, column 1: syntax error ..." →
    // "at line 2, column 1: syntax error ...", without the library's own tags.
    // Then "syntax error while parsing value - unexpected end of input; expected '[', ..." →
    // "unexpected end of input (expected '[', ...)": what went wrong, then what was expected.
    std::string why = e.what();
    const size_t tag = why.find("] ");
    if (tag != std::string::npos) why = why.substr(tag + 2);
    if (why.rfind("parse error ", 0) == 0) why = why.substr(12);
    const size_t syntax = why.find("syntax error while parsing ");
    const size_t dash = syntax == std::string::npos ? std::string::npos : why.find(" - ", syntax);
    if (dash != std::string::npos) why.erase(syntax, dash + 3 - syntax);
    const size_t expected = why.find("; expected ");
    if (expected != std::string::npos) why = why.substr(0, expected) + " (" + why.substr(expected + 2) + ")";
    throw InputError(path + ": not valid JSON " + why);
  } catch (const std::exception& e) {
    throw InputError(path + ": not valid JSON (" + e.what() + ")");
  }
}

nlohmann::json read_json_file_if_present(const std::string& path, const std::string& what) {
  return file_exists(path) ? read_json_file(path, what) : nlohmann::json::object();
}

}  // namespace kvlens
