#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace kvlens {

namespace {

// The OpenMP loops of the calling thread on one thread, until the end of the scope. A thread
// created here starts with OpenMP's default team (every core), whatever the main thread set; the
// pieces of a parallel_for already run side by side, and a team of every core inside each would
// put threads × cores on the machine's cores.
struct OneOmpThread {
#ifdef _OPENMP
  int was = omp_get_max_threads();
  OneOmpThread() { omp_set_num_threads(1); }
  ~OneOmpThread() { omp_set_num_threads(was); }
#endif
};

}  // namespace

void parallel_for(int n, int max_threads, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  const int threads = std::max(1, std::min({n, max_threads, static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))}));
  std::atomic<int> next{0};
  std::vector<std::exception_ptr> failed(static_cast<size_t>(n));
  auto work = [&] {
    for (int i; (i = next++) < n;) {
      try {
        fn(i);
      } catch (...) {
        failed[static_cast<size_t>(i)] = std::current_exception();
      }
    }
  };
  if (threads == 1) {
    work();  // (on the calling thread, as it is set)
  } else {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t)
      pool.emplace_back([&] {
        const OneOmpThread one;
        work();
      });
    {
      const OneOmpThread one;
      work();
    }
    for (std::thread& t : pool) t.join();
  }
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
}

}  // namespace kvlens
