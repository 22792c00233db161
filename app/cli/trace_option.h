// --trace FILE: the command's timeline on the host (core/trace.h) written as a Chrome trace-event
// file (open it in chrome://tracing or ui.perfetto.dev), its longest span names summed on stdout.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

namespace kvlens::app {

void add_trace_option(CLI::App* c, std::string& path);
// Checks that `path` can be written and starts the trace (nothing when path is empty).
void start_trace(const std::string& path);
// Writes the trace to `path` through the atomic writer and prints its summary (nothing when
// path is empty).
void finish_trace(const std::string& path);

}  // namespace kvlens::app
