#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <sched.h>
#endif

namespace kvlens {

namespace {
std::atomic<int> g_product_threads{0};
thread_local int tl_product_threads = 0;  // > 0 inside a piece of parallel_for

// The calling thread's matrix products on one thread until the end of the scope.
class OneProductThread {
 public:
  OneProductThread() : was_(tl_product_threads) { tl_product_threads = 1; }
  ~OneProductThread() { tl_product_threads = was_; }
  OneProductThread(const OneProductThread&) = delete;
  OneProductThread& operator=(const OneProductThread&) = delete;

 private:
  int was_;
};
}  // namespace

int machine_threads() {
#ifdef _OPENMP
  return std::max(1, omp_get_num_procs());  // (the CPUs this process may run on)
#else
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
}

int cores_of(const std::string& sys_cpu, const std::vector<int>& cpus) {
  std::set<std::pair<long, long>> cores;
  for (int c : cpus) {
    const std::string dir = sys_cpu + "/cpu" + std::to_string(c) + "/topology/";
    long package = 0, core = 0;
    std::ifstream p(dir + "physical_package_id"), k(dir + "core_id");
    if (!(p >> package) || !(k >> core)) return static_cast<int>(cpus.size());
    cores.insert({package, core});
  }
  return static_cast<int>(cores.size());
}

int machine_cores() {
  static const int n = [] {
    std::vector<int> cpus;
#ifdef __linux__
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) cpus.push_back(c);
#endif
    const int logical = machine_threads();
    if (static_cast<int>(cpus.size()) != logical) return logical;  // (affinity unread or unlike OpenMP's)
    return std::max(1, std::min(logical, cores_of("/sys/devices/system/cpu", cpus)));
  }();
  return n;
}

int product_threads() {
  if (tl_product_threads > 0) return tl_product_threads;
  const int n = g_product_threads.load();
  return n > 0 ? std::min(n, machine_cores()) : machine_cores();
}

void set_product_threads(int n) { g_product_threads.store(std::max(n, 0)); }

void set_threads(int n) {
  const int k = std::max(1, std::min(n, machine_cores()));
#ifdef _OPENMP
  omp_set_num_threads(k);
#endif
  set_product_threads(k);
}

void threads_from_environment() {
  if (std::getenv("OMP_NUM_THREADS")) {
    set_threads(omp_loop_threads());  // (as OpenMP read the variable)
    return;
  }
#ifdef _OPENMP
  omp_set_num_threads(1);
#endif
  set_product_threads(0);
}

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
  const int threads = std::max(1, std::min({n, max_threads, machine_threads()}));
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
    // The pieces run side by side: each runs its OpenMP loops and its matrix products on one
    // thread (a thread started here would otherwise take OpenMP's default team, every core, and
    // put threads × cores on the machine's cores).
    for (int t = 1; t < threads; ++t)
      pool.emplace_back([&] {
        const ScopedOmpThreads one(1);
        const OneProductThread one_product;
        work();
      });
    {
      const ScopedOmpThreads one(1);
      const OneProductThread one_product;
      work();
    }
    for (std::thread& t : pool) t.join();
  }
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
}

}  // namespace kvlens
