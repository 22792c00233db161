// core/trace.h: spans kept only while tracing is on, per thread, summed by name, and written as
// Chrome trace events.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <thread>

#include "core/trace.h"

using namespace kvlens;

namespace {

void busy_for(std::chrono::microseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
  }
}

TEST(Trace, NothingIsKeptWhileOff) {
  trace::enable(false);
  trace::take();
  { trace::Scope s("off"); }
  EXPECT_TRUE(trace::take().empty());
}

TEST(Trace, SpansNestAndCarryTheirArgument) {
  trace::enable(true);
  {
    trace::Scope outer("outer");
    busy_for(std::chrono::microseconds(300));
    trace::Scope inner("inner", 7);
    busy_for(std::chrono::microseconds(300));
  }
  trace::enable(false);
  const std::vector<trace::Span> s = trace::take();
  ASSERT_EQ(s.size(), 2u);
  // In the order they ended: the inner one first, inside the outer one.
  EXPECT_STREQ(s[0].name, "inner");
  EXPECT_EQ(s[0].arg, 7);
  EXPECT_STREQ(s[1].name, "outer");
  EXPECT_EQ(s[1].arg, -1);
  EXPECT_GE(s[0].t0_ns, s[1].t0_ns);
  EXPECT_LE(s[0].t1_ns, s[1].t1_ns);
  EXPECT_GE(s[0].t1_ns - s[0].t0_ns, 300000);
  EXPECT_GE(s[1].t1_ns - s[1].t0_ns, 600000);
  EXPECT_EQ(s[0].thread, 0u);
  EXPECT_TRUE(trace::take().empty());  // (taken)
}

TEST(Trace, TurningOnDropsEarlierSpansAndThreadsGetTracksOfTheirOwn) {
  trace::enable(true);
  { trace::Scope s("dropped"); }
  {
    trace::Scope open("dropped");  // (begun before tracing starts anew, it ends after)
    trace::enable(true);
  }
  std::vector<std::thread> ts;
  for (int i = 0; i < 3; ++i)
    ts.emplace_back([i] {
      trace::Scope s("worker", i);
      busy_for(std::chrono::microseconds(100));
    });
  for (auto& t : ts) t.join();
  { trace::Scope s("main"); }
  trace::enable(false);
  const std::vector<trace::Span> s = trace::take();
  ASSERT_EQ(s.size(), 4u);
  std::set<uint32_t> worker_tracks;
  std::set<int64_t> args;
  for (const trace::Span& x : s) {
    EXPECT_STRNE(x.name, "dropped");
    if (std::string(x.name) == "worker") {
      worker_tracks.insert(x.thread);
      args.insert(x.arg);
    } else {
      EXPECT_EQ(x.thread, 0u);  // the thread that turned tracing on
    }
  }
  EXPECT_EQ(worker_tracks, (std::set<uint32_t>{1, 2, 3}));
  EXPECT_EQ(args, (std::set<int64_t>{0, 1, 2}));
}

TEST(Trace, TotalsAndTheChromeDocument) {
  std::vector<trace::Span> s(3);
  s[0] = {"a", -1, 0, 2000000, 0};
  s[1] = {"b", 3, 500000, 1000000, 1};
  s[2] = {"a", -1, 3000000, 4500000, 0};
  const std::vector<trace::Total> t = trace::totals(s);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].name, "a");
  EXPECT_EQ(t[0].count, 2);
  EXPECT_DOUBLE_EQ(t[0].ms, 3.5);
  EXPECT_EQ(t[1].name, "b");
  EXPECT_DOUBLE_EQ(t[1].ms, 0.5);
  const nlohmann::json j = trace::chrome_json(s);
  ASSERT_EQ(j["traceEvents"].size(), 3u);
  const nlohmann::json& e = j["traceEvents"][1];
  EXPECT_EQ(e["name"], "b");
  EXPECT_EQ(e["ph"], "X");
  EXPECT_EQ(e["tid"], 1);
  EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 500.0);  // µs
  EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 500.0);
  EXPECT_EQ(e["args"]["n"], 3);
  EXPECT_FALSE(j["traceEvents"][0].contains("args"));
}

}  // namespace
