#include "core/trace.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <thread>

namespace kvlens::trace {

std::atomic<bool> g_on{false};
std::atomic<uint64_t> g_epoch{0};

namespace {

struct State {
  std::mutex mu;
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
  std::vector<Span> spans;
  std::map<std::thread::id, uint32_t> threads;
};

State& state() {
  static State s;
  return s;
}

int64_t ns_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

}  // namespace

void enable(bool on) {
  State& s = state();
  std::lock_guard<std::mutex> l(s.mu);
  if (on) {
    s.spans.clear();
    s.threads.clear();
    s.threads[std::this_thread::get_id()] = 0;
    g_epoch.fetch_add(1, std::memory_order_relaxed);
    s.origin = std::chrono::steady_clock::now();
  }
  g_on.store(on, std::memory_order_relaxed);
}

void record(const char* name, int64_t arg, uint64_t epoch, std::chrono::steady_clock::time_point t0,
            std::chrono::steady_clock::time_point t1) noexcept {
  State& s = state();
  try {
    std::lock_guard<std::mutex> l(s.mu);
    if (!on() || epoch != g_epoch.load(std::memory_order_relaxed)) return;
    auto it = s.threads.find(std::this_thread::get_id());
    if (it == s.threads.end())
      it = s.threads.emplace(std::this_thread::get_id(), static_cast<uint32_t>(s.threads.size())).first;
    s.spans.push_back({name, arg, ns_between(s.origin, t0), ns_between(s.origin, t1), it->second});
  } catch (...) {
    // (a timeline short of a span rather than a failed run)
  }
}

std::vector<Span> take() {
  State& s = state();
  std::lock_guard<std::mutex> l(s.mu);
  std::vector<Span> out = std::move(s.spans);
  s.spans.clear();
  return out;
}

nlohmann::json chrome_json(const std::vector<Span>& spans) {
  nlohmann::json ev = nlohmann::json::array();
  for (const Span& s : spans) {
    nlohmann::json e = {{"name", s.name}, {"ph", "X"}, {"pid", 1}, {"tid", s.thread},
                        {"ts", static_cast<double>(s.t0_ns) / 1e3}, {"dur", static_cast<double>(s.t1_ns - s.t0_ns) / 1e3}};
    if (s.arg >= 0) e["args"] = {{"n", s.arg}};
    ev.push_back(std::move(e));
  }
  return {{"traceEvents", std::move(ev)}, {"displayTimeUnit", "ms"}};
}

std::vector<Total> totals(const std::vector<Span>& spans) {
  std::map<std::string, Total> by;
  for (const Span& s : spans) {
    Total& t = by[s.name];
    t.name = s.name;
    ++t.count;
    t.ms += static_cast<double>(s.t1_ns - s.t0_ns) / 1e6;
  }
  std::vector<Total> out;
  for (auto& [k, t] : by) out.push_back(t);
  std::stable_sort(out.begin(), out.end(), [](const Total& a, const Total& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace kvlens::trace
