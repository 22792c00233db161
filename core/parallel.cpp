#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <thread>
#include <vector>

namespace kvlens {

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
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
}

}  // namespace kvlens
