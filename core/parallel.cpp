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

int omp_loop_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

ScopedOmpThreads::ScopedOmpThreads(int n) : was_(omp_loop_threads()) {
#ifdef _OPENMP
  omp_set_num_threads(n);
#else
  (void)n;
#endif
}

ScopedOmpThreads::~ScopedOmpThreads() {
#ifdef _OPENMP
  omp_set_num_threads(was_);
#endif
}

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
    // The pieces run side by side: each runs its OpenMP loops on one thread (a thread started
    // here would otherwise take OpenMP's default team, every core, and put threads × cores on the
    // machine's cores).
    for (int t = 1; t < threads; ++t)
      pool.emplace_back([&] {
        const ScopedOmpThreads one(1);
        work();
      });
    {
      const ScopedOmpThreads one(1);
      work();
    }
    for (std::thread& t : pool) t.join();
  }
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
}

}  // namespace kvlens
