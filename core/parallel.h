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

}  // namespace kvlens
