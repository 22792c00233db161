// LOOK-M's merge where the cache is (Eq. 10–12), every step on the device: the rows' pointers,
// the evicted rows, the similarity filter with its sources, and the merge of every kept row. The
// merge is the twin of core/row_merge.cpp's merge_rows: each step is the one correctly rounded
// double operation the host does (__dadd_rn / __dmul_rn, so the compiler fuses nothing, and fma
// where the host calls std::fma), the contributions of a kept row in the host's order (ascending
// evicted row); fp16 inputs widen to double exactly. So a merged row equals the host's bit for
// bit, after the same roundings to float and then to fp16. The filter adds the similarities in
// lookm_above_mean's order and divides as it does, so the same rows pass.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

__device__ __forceinline__ double widen(__half x) { return static_cast<double>(__half2float(x)); }

// The last of n entries whose `key` is ≤ x (keys ascending, the first ≤ x).
template <class F>
__device__ __forceinline__ int last_at_or_below(int n, int64_t x, F key) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (key(mid) <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void segment_rows_kernel(const RowSegment* __restrict__ runs, int n_runs, int64_t n_rows, int d,
                                    const __half** __restrict__ k, const __half** __restrict__ v) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n_rows) return;
  const RowSegment s = runs[last_at_or_below(n_runs, r, [&](int i) { return runs[i].first; })];
  k[r] = s.k + (r - s.first) * d;
  v[r] = s.v + (r - s.first) * d;
}

// One warp a problem: 32 rows at a time, each lane finding its row in the kept list.
__global__ void evicted_rows_kernel(const AssignProblem* __restrict__ P, int np, const int* __restrict__ keep,
                                    int* __restrict__ evicted) {
  const int x = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (x >= np) return;
  const AssignProblem p = P[x];
  const int* kp = keep + p.kept0;
  int64_t at = p.ev0;
  for (int base = 0; base < p.n; base += 32) {
    const int r = base + lane;
    bool out = r < p.n;
    if (out && p.K > 0) {
      const int j = last_at_or_below(p.K, r, [&](int i) { return static_cast<int64_t>(kp[i]); });
      out = kp[j] != r;
    }
    const unsigned m = __ballot_sync(0xffffffffu, out);
    if (out) evicted[at + __popc(m & ((1u << lane) - 1u))] = r;
    at += __popc(m);
  }
}

// One block a group (a layer's KV heads): the mean over every evicted row (one thread, in the
// host's order), each index's mean over the problems that have it, which indices pass, their
// ranks among the passing (a block scan), then the sources.
__global__ void merge_sources_kernel(const AssignProblem* __restrict__ P, int np, int group,
                                     const int* __restrict__ evicted, const double* __restrict__ sim, bool prefix,
                                     int* __restrict__ scratch, int* __restrict__ src) {
  const int g0 = blockIdx.x * group, g1 = min(np, g0 + group);
  __shared__ double mean;
  __shared__ int part[256];
  int J = 0;
  for (int x = g0; x < g1; ++x) J = max(J, P[x].E);
  int* rank = scratch + P[g0].ev0;  // J ≤ the group's evicted rows
  if (threadIdx.x == 0) {
    double total = 0.0, n = 0.0;
    for (int x = g0; x < g1; ++x)
      for (int j = 0; j < P[x].E; ++j) total = __dadd_rn(total, sim[P[x].ev0 + j]), n = __dadd_rn(n, 1.0);
    mean = n > 0.0 ? __ddiv_rn(total, n) : 0.0;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < J; j += blockDim.x) {
    double s = 0.0, c = 0.0;
    for (int x = g0; x < g1; ++x)
      if (j < P[x].E) s = __dadd_rn(s, sim[P[x].ev0 + j]), c = __dadd_rn(c, 1.0);
    rank[j] = __ddiv_rn(s, c) >= mean ? 1 : 0;  // (a flag until the scan)
  }
  __syncthreads();
  // Each thread's contiguous chunk counted, the chunks' counts scanned, the chunks ranked; a
  // failing index keeps −1.
  const int chunk = (J + blockDim.x - 1) / blockDim.x, c0 = min(J, threadIdx.x * chunk), c1 = min(J, c0 + chunk);
  int mine = 0;
  for (int j = c0; j < c1; ++j) mine += rank[j];
  part[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0, run = 0; i < static_cast<int>(blockDim.x); ++i) {
      const int c = part[i];
      part[i] = run;
      run += c;
    }
  __syncthreads();
  for (int j = c0, r = part[threadIdx.x]; j < c1; ++j) rank[j] = rank[j] ? r++ : -1;
  __syncthreads();
  for (int x = g0; x < g1; ++x)
    for (int j = threadIdx.x; j < P[x].E; j += blockDim.x) {
      const int f = rank[j];
      src[P[x].ev0 + j] = f < 0 ? -1 : evicted[P[x].ev0 + (prefix ? f : j)];
    }
}

// One block a kept row, a thread a component (strided): the problem's evicted rows scanned in
// order through shared memory, those assigned to this row (with a source) folded in.
__global__ void merge_kept_kernel(const __half* const* __restrict__ rk, const __half* const* __restrict__ rv,
                                  const AssignProblem* __restrict__ P, int np, const int* __restrict__ keep,
                                  const int* __restrict__ evicted, const int* __restrict__ src,
                                  const int* __restrict__ best, const double* __restrict__ sim, int d, int kind,
                                  __half* __restrict__ ok, __half* __restrict__ ov, int* __restrict__ count) {
  __shared__ int from[256];
  const int64_t g = blockIdx.x;
  const AssignProblem p = P[last_at_or_below(np, g, [&](int i) { return P[i].kept0; })];
  const int c = keep[g];
  const __half* kc = rk[p.row0 + c];
  const __half* vc = rv[p.row0 + c];
  const int B = blockDim.x;
  for (int t0 = 0; t0 < d; t0 += B) {
    const int t = t0 + threadIdx.x;
    const double xk = t < d ? widen(kc[t]) : 0.0, xv = t < d ? widen(vc[t]) : 0.0;
    double ak = 0.0, av = 0.0;
    int n = 0;
    for (int j0 = 0; j0 < p.E; j0 += B) {
      __syncthreads();  // (the previous chunk read)
      const int j = j0 + threadIdx.x;
      int e = -1;
      if (j < p.E && best[p.ev0 + j] == c) e = src ? src[p.ev0 + j] : evicted[p.ev0 + j];
      from[threadIdx.x] = e;
      __syncthreads();
      const int m = min(B, p.E - j0);
      for (int i = 0; i < m; ++i) {
        const int e2 = from[i];
        if (e2 < 0) continue;
        ++n;
        if (t >= d) continue;
        const double ek = widen(rk[p.row0 + e2][t]), ev = widen(rv[p.row0 + e2][t]);
        if (kind == 1) {
          ak = __dadd_rn(ak, ek);
          av = __dadd_rn(av, ev);
        } else if (kind == 2) {
          ak = __dadd_rn(ak, __dmul_rn(0.5, __dadd_rn(ek, xk)));
          av = __dadd_rn(av, __dmul_rn(0.5, __dadd_rn(ev, xv)));
        } else {
          const double s = sim[p.ev0 + j0 + i];
          ak = __fma_rn(s, ek, ak);
          av = __fma_rn(s, ev, av);
        }
      }
    }
    if (t0 == 0 && threadIdx.x == 0) count[g] = n;
    if (n == 0 || t >= d) continue;  // nothing merged: the kept row stays as it is
    const double w = __ddiv_rn(1.0, static_cast<double>(n + 1));
    const int64_t o = g * d + t;
    ok[o] = __float2half_rn(__double2float_rn(__dmul_rn(__dadd_rn(xk, ak), w)));
    ov[o] = __float2half_rn(__double2float_rn(__dmul_rn(__dadd_rn(xv, av), w)));
  }
}

}  // namespace

void segment_rows(const RowSegment* runs, int n_runs, int64_t n_rows, int d, const __half** k, const __half** v,
                  cudaStream_t s) {
  if (n_rows == 0) return;
  segment_rows_kernel<<<static_cast<unsigned>((n_rows + 255) / 256), 256, 0, s>>>(runs, n_runs, n_rows, d, k, v);
  KV_LAUNCH("segment_rows_kernel", std::to_string(n_rows) + " rows in " + std::to_string(n_runs) + " runs");
}

void evicted_rows(const AssignProblem* problems, int n_problems, const int* keep, int* evicted, cudaStream_t s) {
  if (n_problems == 0) return;
  evicted_rows_kernel<<<(n_problems + 7) / 8, 256, 0, s>>>(problems, n_problems, keep, evicted);
  KV_LAUNCH("evicted_rows_kernel", std::to_string(n_problems) + " problems");
}

void merge_sources(const AssignProblem* problems, int n_problems, int group, const int* evicted, const double* sim,
                   bool prefix, int* scratch, int* src, cudaStream_t s) {
  if (n_problems == 0) return;
  merge_sources_kernel<<<(n_problems + group - 1) / group, 256, 0, s>>>(problems, n_problems, group, evicted, sim,
                                                                        prefix, scratch, src);
  KV_LAUNCH("merge_sources_kernel", std::to_string(n_problems) + " problems in groups of " + std::to_string(group));
}

void merge_kept(const __half* const* k, const __half* const* v, const AssignProblem* problems, int n_problems,
                int64_t n_kept, const int* keep, const int* evicted, const int* src, const int* best, const double* sim,
                int d, int kind, __half* ok, __half* ov, int* count, cudaStream_t s) {
  if (n_kept == 0) return;
  const int threads = d >= 128 ? 128 : (d + 31) / 32 * 32;
  merge_kept_kernel<<<static_cast<unsigned>(n_kept), threads, 0, s>>>(k, v, problems, n_problems, keep, evicted, src,
                                                                     best, sim, d, kind, ok, ov, count);
  KV_LAUNCH("merge_kept_kernel", std::to_string(n_kept) + " kept rows of " + std::to_string(d) + ", kind " +
                                     std::to_string(kind));
}

}  // namespace kvlens::cuda
