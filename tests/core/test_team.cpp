// team_for (core/team.h): every index exactly once whatever the threads and chunks, the lowest
// failing chunk's exception rethrown after all are done, a call from inside a job run on its own
// thread, and callers on several threads at once each getting every index of their own job.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "core/team.h"

using namespace kvlens;

namespace {
// Counts the calls each index gets, from the ranges team_for hands out.
struct Tally {
  explicit Tally(int64_t n) : calls(static_cast<size_t>(n)) {}
  void add(int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) ++calls[static_cast<size_t>(i)];
  }
  std::string wrong() const {
    for (size_t i = 0; i < calls.size(); ++i)
      if (calls[i].load() != 1) return "index " + std::to_string(i) + " ran " + std::to_string(calls[i].load()) + " times";
    return "";
  }
  std::vector<std::atomic<int>> calls;
};
}  // namespace

TEST(Team, EveryIndexOnceWhateverTheThreadsAndChunks) {
  for (int threads : {1, 2, 3, 8, 16, 64})
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{100}, int64_t{4099}})
      for (int64_t chunk : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{5000}}) {
        Tally tally(n);
        std::mutex mu;
        std::set<std::thread::id> who;
        team_for(n, threads, [&](int64_t b, int64_t e) {
          ASSERT_LT(b, e);
          if (chunk > 0) {
            EXPECT_EQ(b % chunk, 0);
            EXPECT_LE(e - b, chunk);
          }
          tally.add(b, e);
          std::lock_guard<std::mutex> lock(mu);
          who.insert(std::this_thread::get_id());
        }, chunk);
        EXPECT_EQ(tally.wrong(), "") << "threads " << threads << ", n " << n << ", chunk " << chunk;
        EXPECT_LE(who.size(), static_cast<size_t>(std::min(threads, machine_cores())));
        if (threads == 1) {
          ASSERT_EQ(who.size(), 1u);
          EXPECT_EQ(*who.begin(), std::this_thread::get_id());
        }
      }
  int none = 0;
  team_for(0, 4, [&](int64_t, int64_t) { ++none; });
  team_for(-3, 4, [&](int64_t, int64_t) { ++none; });
  EXPECT_EQ(none, 0);
  EXPECT_LE(team_size(), std::max(0, machine_cores() - 1)) << "the team keeps a thread a core, the caller's included";
}

TEST(Team, TheLowestFailingChunkIsRethrownAfterEveryChunk) {
  std::atomic<int> done{0}, thrown{0};
  try {
    team_for(40, 4, [&](int64_t b, int64_t) {
      ++done;
      if (b == 9) {  // fails last where other threads run the later chunks meanwhile
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (thrown.load() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      }
      if (b == 26 || b == 9 || b == 33) {
        ++thrown;
        throw std::runtime_error("chunk " + std::to_string(b));
      }
    }, 1);
    ADD_FAILURE() << "nothing was rethrown";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "chunk 9");
  }
  EXPECT_EQ(done.load(), 40) << "every chunk runs even after a failure";
  Tally after(50);  // the team still works after a failed job
  team_for(50, 4, [&](int64_t b, int64_t e) { after.add(b, e); }, 1);
  EXPECT_EQ(after.wrong(), "");
}

// Two chunks of a job run at once on two threads: each waits (up to 5 s) for the other to start.
TEST(Team, ChunksRunSideBySide) {
  if (machine_cores() < 2) GTEST_SKIP() << "one core: every job runs on the calling thread";
  std::atomic<int> started{0};
  std::atomic<bool> together{true};
  team_for(2, 2, [&](int64_t, int64_t) {
    ++started;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (started.load() < 2 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    if (started.load() < 2) together = false;
  }, 1);
  EXPECT_TRUE(together.load()) << "one chunk ran alone for 5 s: the job did not run on two threads";
  EXPECT_GE(team_size(), 1);
}

TEST(Team, AJobInsideAJobRunsOnItsOwnThread) {
  EXPECT_FALSE(in_team());
  Tally outer(12);
  std::atomic<int> inner_wrong{0};
  team_for(12, 4, [&](int64_t b, int64_t e) {
    EXPECT_TRUE(in_team());
    outer.add(b, e);
    const std::thread::id me = std::this_thread::get_id();
    Tally inner(30);
    team_for(30, 8, [&](int64_t ib, int64_t ie) {
      if (std::this_thread::get_id() != me) ++inner_wrong;
      inner.add(ib, ie);
    }, 1);
    if (!inner.wrong().empty()) ++inner_wrong;
  }, 1);
  EXPECT_EQ(outer.wrong(), "");
  EXPECT_EQ(inner_wrong.load(), 0);
  EXPECT_FALSE(in_team());
}

TEST(Team, CallersOnSeveralThreadsEachGetTheirWholeJob) {
  constexpr int kCallers = 4, kJobs = 200;
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c)
    callers.emplace_back([&, c] {
      for (int j = 0; j < kJobs; ++j) {
        const int64_t n = 1 + (j * 7 + c * 13) % 97;
        Tally tally(n);
        team_for(n, 1 + (j + c) % 6, [&](int64_t b, int64_t e) { tally.add(b, e); }, 1 + j % 3);
        if (!tally.wrong().empty()) ++wrong;
      }
    });
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
}
