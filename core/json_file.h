// Reading the JSON files kvlens takes as input (configs, indexes, sessions, annotations):
// one place for the "cannot open" and "not valid JSON" messages, each naming the file. Only
// regular files are read (core/files.h).
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "core/files.h"

namespace kvlens {

// Parses `path`; throws InputError "<path>: cannot open <what>" or "<path>: not valid JSON (...)".
nlohmann::json read_json_file(const std::string& path, const std::string& what);
// As read_json_file where `path` exists, else an empty object (a config file a folder may omit).
nlohmann::json read_json_file_if_present(const std::string& path, const std::string& what);

}  // namespace kvlens
