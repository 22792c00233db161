// parallel_for (core/parallel.h): every index exactly once on up to the threads asked for, the
// lowest failing index's exception rethrown after every call has finished, nothing for n ≤ 0,
// and one thread runs the indices in order on the calling thread.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/parallel.h"

using namespace kvlens;

TEST(Parallel, EveryIndexOnceAndTheLowestFailureRethrown) {
  for (int threads : {1, 3, 8}) {
    std::vector<std::atomic<int>> calls(37);
    std::mutex mu;
    std::set<std::thread::id> who;
    parallel_for(37, threads, [&](int i) {
      ++calls[static_cast<size_t>(i)];
      std::lock_guard<std::mutex> lock(mu);
      who.insert(std::this_thread::get_id());
    });
    for (int i = 0; i < 37; ++i) EXPECT_EQ(calls[static_cast<size_t>(i)].load(), 1) << "index " << i;
    EXPECT_LE(who.size(), static_cast<size_t>(threads));
    if (threads == 1) EXPECT_EQ(*who.begin(), std::this_thread::get_id());
  }
  std::vector<int> order;
  parallel_for(5, 1, [&](int i) { order.push_back(i); });
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
  int none = 0;
  parallel_for(0, 4, [&](int) { ++none; });
  parallel_for(-2, 4, [&](int) { ++none; });
  EXPECT_EQ(none, 0);
  std::atomic<int> done{0};
  try {
    parallel_for(20, 4, [&](int i) {
      ++done;
      if (i == 13 || i == 6 || i == 17) throw std::runtime_error("index " + std::to_string(i));
    });
    ADD_FAILURE() << "nothing was rethrown";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "index 6");
  }
  EXPECT_EQ(done.load(), 20) << "every index runs even after a failure";
}
