#include "core/team.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "core/parallel.h"

namespace kvlens {

namespace {

thread_local bool tl_in_team = false;

void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// The flag of a thread running chunks, set for the scope.
class InTeam {
 public:
  InTeam() : was_(tl_in_team) { tl_in_team = true; }
  ~InTeam() { tl_in_team = was_; }
  InTeam(const InTeam&) = delete;
  InTeam& operator=(const InTeam&) = delete;

 private:
  bool was_;
};

// Every chunk on the calling thread, in order; the first failure rethrown after the last chunk.
void run_alone(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t chunk) {
  const InTeam inside;
  std::exception_ptr failed;
  for (int64_t b = 0; b < n; b += chunk) {
    try {
      fn(b, std::min(n, b + chunk));
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
}

// One thread of the team: the caller hands it a job by storing the job's number in `ticket`.
struct alignas(64) Member {
  std::atomic<uint32_t> ticket{0};
  std::atomic<bool> asleep{false};
  std::mutex mu;
  std::condition_variable cv;
  std::thread thread;
};

class Team {
 public:
  static Team& get() {
    static Team team;
    return team;
  }

  ~Team() {
    stop_.store(true);
    for (auto& m : members_) wake(*m, m->ticket.load() + 1);
    for (auto& m : members_)
      if (m->thread.joinable()) m->thread.join();
  }

  int size() const { return size_.load(); }

  void run(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn, int64_t chunk) {
    std::unique_lock<std::mutex> lock(job_mu_, std::try_to_lock);
    const int64_t chunks = (n + chunk - 1) / chunk;
    // The threads asked for, no more than the chunks can use (the caller takes one).
    const int want = static_cast<int>(std::min<int64_t>({threads - 1, machine_cores() - 1, chunks - 1}));
    while (lock.owns_lock() && static_cast<int>(members_.size()) < want && start_member()) {
    }
    const int helpers = std::min(want, static_cast<int>(members_.size()));
    if (!lock.owns_lock() || helpers <= 0) {  // (another caller's job is running, or no thread would start)
      run_alone(n, fn, chunk);
      return;
    }
    fn_ = &fn;
    n_ = n;
    chunk_ = chunk;
    chunks_ = chunks;
    next_.store(0, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    failed_ = nullptr;
    failed_chunk_ = chunks_;
    uint32_t job = number_ + 1;
    if (job == 0) job = 1;  // (0 is "no job open")
    number_ = job;
    open_.store(job, std::memory_order_seq_cst);
    for (int i = 0; i < helpers; ++i) wake(*members_[static_cast<size_t>(i)], job);
    {
      const InTeam inside;
      work();
    }
    while (done_.load(std::memory_order_acquire) < chunks_) relax();
    // Closed before the count of threads inside is read: a thread that comes later sees it closed
    // and leaves; one that came earlier is counted (both seq_cst).
    open_.store(0, std::memory_order_seq_cst);
    while (inside_.load(std::memory_order_seq_cst) != 0) relax();
    fn_ = nullptr;
    // (Taken out: the exception leaves with this caller, not with the next job.)
    if (std::exception_ptr failed = std::exchange(failed_, nullptr)) std::rethrow_exception(failed);
  }

 private:
  // Between opening a job and closing it nothing may throw (the job would stay open with its
  // caller gone): wake and work are noexcept, so a mutex that fails there ends the process.
  void wake(Member& m, uint32_t job) noexcept {
    m.ticket.store(job, std::memory_order_seq_cst);
    if (m.asleep.load(std::memory_order_seq_cst)) {
      { std::lock_guard<std::mutex> lock(m.mu); }
      m.cv.notify_one();
    }
  }

  // One more thread, or false where none could be started (the job then runs on fewer).
  bool start_member() noexcept {
    try {
      members_.reserve(members_.size() + 1);  // (so that keeping the new member cannot throw)
      auto m = std::make_unique<Member>();
      Member* p = m.get();
      p->thread = std::thread([this, p] { serve(*p); });
      members_.push_back(std::move(m));
      size_.store(static_cast<int>(members_.size()));
      return true;
    } catch (...) {
      return false;
    }
  }

  // Claims chunks until none is left.
  void work() noexcept {
    for (int64_t c; (c = next_.fetch_add(1, std::memory_order_relaxed)) < chunks_;) {
      const int64_t b = c * chunk_, e = std::min(n_, b + chunk_);
      try {
        (*fn_)(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(failed_mu_);
        if (c < failed_chunk_) {
          failed_chunk_ = c;
          failed_ = std::current_exception();
        }
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void serve(Member& m) {
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    const InTeam inside;
    uint32_t seen = 0;
    for (;;) {
      uint32_t job = wait_for_job(m, seen);
      if (stop_.load()) return;
      seen = job;
      inside_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst) == job) work();
      inside_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  uint32_t wait_for_job(Member& m, uint32_t seen) {
    using clock = std::chrono::steady_clock;
    const auto until = clock::now() + std::chrono::microseconds(kTeamSpinMicros);
    for (int spins = 0;; ++spins) {
      const uint32_t t = m.ticket.load(std::memory_order_acquire);
      if (t != seen) return t;
      if ((spins & 63) == 63 && clock::now() > until) break;
      relax();
    }
    std::unique_lock<std::mutex> lock(m.mu);
    m.asleep.store(true, std::memory_order_seq_cst);
    uint32_t t;
    while ((t = m.ticket.load(std::memory_order_seq_cst)) == seen) m.cv.wait(lock);
    m.asleep.store(false, std::memory_order_relaxed);
    return t;
  }

  std::mutex job_mu_;  // held by the caller of the job running
  std::vector<std::unique_ptr<Member>> members_;  // (under job_mu_)
  std::atomic<int> size_{0};                        // members_.size()
  std::atomic<bool> stop_{false};
  uint32_t number_ = 0;  // the last job's number
  std::atomic<uint32_t> open_{0};
  std::atomic<int> inside_{0};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunk_ = 1, chunks_ = 0;
  std::atomic<int64_t> next_{0}, done_{0};
  std::mutex failed_mu_;
  std::exception_ptr failed_;
  int64_t failed_chunk_ = 0;
};

}  // namespace

bool in_team() { return tl_in_team; }

int team_size() { return Team::get().size(); }

void team_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn, int64_t chunk) {
  if (n <= 0) return;
  const int t = std::max(1, threads);
  if (chunk <= 0) chunk = std::max<int64_t>(1, (n + 4 * t - 1) / (4 * t));
  bool in_openmp = false;  // (inside an OpenMP team a job runs on its thread alone)
#ifdef _OPENMP
  in_openmp = omp_in_parallel();
#endif
  if (t <= 1 || n <= chunk || tl_in_team || in_openmp || machine_cores() <= 1) {
    run_alone(n, fn, chunk);
    return;
  }
  Team::get().run(n, t, fn, chunk);
}

}  // namespace kvlens
