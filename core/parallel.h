// Work spread over threads of their own, whatever OpenMP is set to (the CLI and the app keep
// OpenMP at one thread for the CPU model's loops): for the host's side of a device run, where
// independent pieces (a policy's layers, a step's events) would otherwise wait in line.
#pragma once
#include <functional>

namespace kvlens {

// Calls fn(i) for every i in [0, n), on up to max_threads threads (the calling one among them,
// no more than the machine has), each index exactly once. When calls throw, the exception of the
// lowest index is rethrown once all have finished. With more than one thread, the OpenMP loops
// inside fn run on their own thread alone (no team within a team); the calling thread's OpenMP
// setting is restored afterwards.
void parallel_for(int n, int max_threads, const std::function<void(int)>& fn);

// The threads the calling thread's OpenMP loops use (1 without OpenMP).
int omp_loop_threads();
// The calling thread's OpenMP loops on n threads until the end of the scope, then as before. A
// thread kvlens starts runs its loops with OpenMP's default team (every core) unless it says so.
class ScopedOmpThreads {
 public:
  explicit ScopedOmpThreads(int n);
  ~ScopedOmpThreads();
  ScopedOmpThreads(const ScopedOmpThreads&) = delete;
  ScopedOmpThreads& operator=(const ScopedOmpThreads&) = delete;

 private:
  int was_ = 1;
};

}  // namespace kvlens
