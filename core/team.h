// The CPU model's loops and products on a resident team of threads.
//
// A job hands its work out in chunks that threads claim as they come, and it ends when every
// chunk is done: the caller waits for the chunks, not for each thread to check in. A thread that
// is late (its CPU taken by another process, or a virtual CPU not yet running again) finds nothing
// left and goes back to waiting; the job waits for it only if it is caught in the instant between
// counting itself in and seeing that nothing is left. OpenMP's `parallel for` ends at a
// barrier that every thread of the team must reach, so one late thread held up every product;
// on a 16-core virtual machine the 4-layer model captioned about 25 % slower with 16 threads
// than with 8.
//
// Threads that have finished a job wait for the next one spinning, for kTeamSpinMicros, then
// asleep; a job wakes only the threads it asks for, and no more than its chunks can use. One job runs at a time: a second caller that
// comes meanwhile runs its job alone, on its own thread (the same results; each chunk is the same
// work whichever thread takes it).
#pragma once
#include <cstdint>
#include <functional>

namespace kvlens {

// How long a thread of the team spins for the next job before it sleeps.
constexpr int kTeamSpinMicros = 2000;

// Calls fn(begin, end) for each chunk of `chunk` indices of [0, n) (chunk ≤ 0: about four a
// thread) on up to `threads` threads, the calling one among them, and returns once all are done.
// With threads ≤ 1, one chunk, from inside a job (a thread of the team, or the caller while its
// job runs) or inside an OpenMP team, the chunks run in order on the calling thread. When calls throw, the exception of the
// lowest chunk is rethrown once every chunk has run. The team's threads run their own OpenMP loops
// and products on one thread.
void team_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn, int64_t chunk = 0);

// body(i) for every i in [0, n), in chunks of `chunk` indices (an index a chunk unless told; ≤ 0:
// about four a thread), on up to `threads` threads (as team_for).
template <class Body>
void team_each(int64_t n, int threads, Body&& body, int64_t chunk = 1) {
  team_for(n, threads, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) body(i);
  }, chunk);
}

// The calling thread is running a chunk of a team job.
bool in_team();

// The team's threads started so far (they start when a job first asks for them).
int team_size();

}  // namespace kvlens
