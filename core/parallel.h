// Work spread over threads of their own, whatever OpenMP is set to (the CLI and the app keep
// OpenMP at one thread, which sizes the CPU model's loops on kvlens's team, core/team.h, to one):
// for the host's side of a device run, where independent pieces (a policy's layers, a step's
// events) would otherwise wait in line.
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace kvlens {

// Calls fn(i) for every i in [0, n), on up to max_threads threads (the calling one among them,
// no more than the machine has), each index exactly once. When calls throw, the exception of the
// lowest index is rethrown once all have finished. With more than one thread, the OpenMP loops
// inside fn run on their own thread alone (no team within a team); the calling thread's OpenMP
// setting is restored afterwards.
void parallel_for(int n, int max_threads, const std::function<void(int)>& fn);

// The threads a matrix product may take (cpu::linear spreads its tiles over up to that many of
// kvlens's team, core/team.h, by its size): the app's setting (set_product_threads; every core
// until then, and at most machine_cores()), and one in each piece of parallel_for.
int product_threads();
void set_product_threads(int n);  // n <= 0: every core
// The CPUs this process may run on (its affinity; at least 1).
int machine_threads();
// The cores under those CPUs: SMT siblings (one core's CPUs) count once, as the Linux topology
// under /sys/devices/system/cpu says; machine_threads() where it says nothing. Arithmetic
// threads beyond it share a core's units and slow one another, so kvlens's loops and products
// take at most this many.
int machine_cores();
// The cores under `cpus` as the topology below `sys_cpu` (a /sys/devices/system/cpu tree) says:
// distinct (physical_package_id, core_id) pairs; cpus.size() when a CPU's files are missing.
int cores_of(const std::string& sys_cpu, const std::vector<int>& cpus);

// The process's threads as the environment says, for the CLI and the app to call first: with
// OMP_NUM_THREADS set, that many (at most machine_cores()) for OpenMP's loops and for matrix
// products; unset, the loops on one thread (at the embedded model's size a loop's hand-off to a
// team costs more than it saves, above all on a busy machine) and the products on every core
// (each taking the threads its size is worth).
void threads_from_environment();
// `--threads n` (n > 0): n threads (at most machine_cores()) for both.
void set_threads(int n);

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
