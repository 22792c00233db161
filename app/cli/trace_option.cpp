#include "app/cli/trace_option.h"

#include <algorithm>
#include <cstdio>

#include "core/files.h"
#include "core/trace.h"

namespace kvlens::app {

void add_trace_option(CLI::App* c, std::string& path) {
  c->add_option("--trace", path,
                "Write the host's timeline (prefill, compression, each decode step, waits for the device, "
                "diagnostics) here as a Chrome trace-event JSON, and print its span totals");
}

void start_trace(const std::string& path) {
  if (path.empty()) return;
  check_writable(path, "trace");
  trace::enable(true);
}

void finish_trace(const std::string& path) {
  if (path.empty()) return;
  trace::enable(false);
  const std::vector<trace::Span> spans = trace::take();
  write_file_atomic(path, trace::chrome_json(spans).dump() + "\n", "trace");
  const std::vector<trace::Total> t = trace::totals(spans);
  std::printf("trace %s: %zu spans; totals by name (nested spans count in each):\n", path.c_str(), spans.size());
  for (size_t i = 0; i < std::min<size_t>(t.size(), 24); ++i)
    std::printf("  %-34s %6lld x %10.2f ms\n", t[i].name.c_str(), static_cast<long long>(t[i].count), t[i].ms);
}

}  // namespace kvlens::app
