// A timeline of where the host's time goes (kvlens run / bench session --trace FILE): named spans
// on the host's threads, kept in memory while tracing is on and written as a Chrome trace-event
// file (chrome://tracing, Perfetto), with a per-name summary. Off (the default), a span costs one
// relaxed atomic load.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlens::trace {

struct Span {
  const char* name = "";  // a string literal: spans keep the pointer
  int64_t arg = -1;       // a step, layer or count the span is about (-1: none)
  int64_t t0_ns = 0, t1_ns = 0;  // since tracing was turned on
  uint32_t thread = 0;           // 0: the thread that turned tracing on, then in order of first span
};

extern std::atomic<bool> g_on;
extern std::atomic<uint64_t> g_epoch;  // how many times tracing was started
inline bool on() { return g_on.load(std::memory_order_relaxed); }
// Starts (drops any spans kept so far, and those still open) or stops recording.
void enable(bool on);
// The spans kept so far, in the order they ended; the list is emptied.
std::vector<Span> take();
// Keeps a span begun in tracing's `epoch` (one begun before tracing was last started is
// dropped); a span that cannot be kept (no memory) is dropped too.
void record(const char* name, int64_t arg, uint64_t epoch, std::chrono::steady_clock::time_point t0,
            std::chrono::steady_clock::time_point t1) noexcept;

// Records [construction, destruction) as `name` when tracing is on.
class Scope {
 public:
  explicit Scope(const char* name, int64_t arg = -1) : name_(on() ? name : nullptr), arg_(arg) {
    if (name_) {
      epoch_ = g_epoch.load(std::memory_order_relaxed);
      t0_ = std::chrono::steady_clock::now();
    }
  }
  ~Scope() {
    if (name_) record(name_, arg_, epoch_, t0_, std::chrono::steady_clock::now());
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  const char* name_;
  int64_t arg_;
  uint64_t epoch_ = 0;
  std::chrono::steady_clock::time_point t0_;
};

// The Chrome trace-event document of `spans` ("X" events in µs, one track per thread).
nlohmann::json chrome_json(const std::vector<Span>& spans);
struct Total {
  std::string name;
  int64_t count = 0;
  double ms = 0;  // summed over every span of that name (nested spans count in each)
};
// Per name, the number of spans and their summed time, the longest total first.
std::vector<Total> totals(const std::vector<Span>& spans);

}  // namespace kvlens::trace
