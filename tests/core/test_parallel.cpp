// parallel_for (core/parallel.h): every index exactly once on up to the threads asked for, the
// lowest failing index's exception rethrown after every call has finished, nothing for n ≤ 0,
// and one thread runs the indices in order on the calling thread.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/parallel.h"
#include "tests/test_util.h"

#ifdef _OPENMP
#include <omp.h>
#endif

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
    if (threads == 1) {
      EXPECT_EQ(*who.begin(), std::this_thread::get_id());
    }
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

#ifdef _OPENMP
// With several threads each index's OpenMP loops run on its own thread alone: a thread created
// for the pool would otherwise start with OpenMP's default team of every core. The caller's
// setting is restored, and one thread leaves it as it is.
TEST(Parallel, PiecesRunTheirOpenMpLoopsOnOneThread) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  omp_set_num_threads(2);
  std::vector<int> seen(12, -1);
  parallel_for(12, 4, [&](int i) { seen[static_cast<size_t>(i)] = omp_get_max_threads(); });
  for (int i = 0; i < 12; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)], cores > 1 ? 1 : 2) << "index " << i;
  EXPECT_EQ(omp_get_max_threads(), 2) << "the caller's setting was not restored";
  parallel_for(3, 1, [&](int i) { seen[static_cast<size_t>(i)] = omp_get_max_threads(); });
  EXPECT_EQ(seen[0], 2);
  omp_set_num_threads(1);
}
#endif

namespace {
// A /sys/devices/system/cpu tree of cpus with the given (package, core) of each.
std::string fake_topology(const std::vector<std::pair<int, int>>& cpus) {
  const std::string root = kvlens::testing::make_temp_dir("cpu");
  for (size_t c = 0; c < cpus.size(); ++c) {
    const std::string dir = root + "/cpu" + std::to_string(c) + "/topology";
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/physical_package_id") << cpus[c].first << "\n";
    std::ofstream(dir + "/core_id") << cpus[c].second << "\n";
  }
  return root;
}
}  // namespace

// SMT siblings count once; the same core id in another package is another core; a CPU without
// topology files makes the count the CPUs'.
TEST(Parallel, CoresCountSmtSiblingsOnce) {
  const std::string smt = fake_topology({{0, 0}, {0, 1}, {0, 0}, {0, 1}});
  EXPECT_EQ(kvlens::cores_of(smt, {0, 1, 2, 3}), 2);
  EXPECT_EQ(kvlens::cores_of(smt, {0, 2}), 1);
  EXPECT_EQ(kvlens::cores_of(smt, {1, 2}), 2);
  const std::string two = fake_topology({{0, 0}, {1, 0}, {0, 1}, {1, 1}});
  EXPECT_EQ(kvlens::cores_of(two, {0, 1, 2, 3}), 4);
  EXPECT_EQ(kvlens::cores_of(two, {0, 1, 2, 3, 7}), 5);  // cpu7 has no files
  const int cores = kvlens::machine_cores();
  EXPECT_GE(cores, 1);
  EXPECT_LE(cores, kvlens::machine_threads());
  kvlens::set_threads(1024);
  EXPECT_EQ(kvlens::product_threads(), cores);
  kvlens::threads_from_environment();
}
