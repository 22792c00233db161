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

// Each kept row's contributions as a list, ascending like the evicted rows (one warp a problem):
// an evicted row j with a source, assigned to kept row c (best[ev0 + j], found in the kept list),
// counts for c; the counts' running sum places each kept row's list (off[g]: its start, moved
// past the list as it fills); the rows are then placed in ascending j, those of one chunk that
// share a kept row ranked by lane. After it off[g] is the end of g's list, count[g] its length.
__global__ void merge_lists_kernel(const AssignProblem* __restrict__ P, int np, const int* __restrict__ keep,
                                   const int* __restrict__ src, const int* __restrict__ best, int* __restrict__ count,
                                   int* __restrict__ off, int* __restrict__ list) {
  const int x = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (x >= np) return;
  const AssignProblem p = P[x];
  if (p.K == 0) return;
  const int* kp = keep + p.kept0;
  auto slot_of = [&](int j) {  // the kept slot row j folds into, or −1
    if (j >= p.E || (src && src[p.ev0 + j] < 0)) return -1;
    const int b = best[p.ev0 + j];
    const int s = last_at_or_below(p.K, b, [&](int i) { return static_cast<int64_t>(kp[i]); });
    return kp[s] == b ? s : -1;
  };
  for (int base = 0; base < p.E; base += 32) {
    const int s = slot_of(base + lane);
    if (s >= 0) atomicAdd(&count[p.kept0 + s], 1);
  }
  __syncwarp();
  int run = 0;
  for (int base = 0; base < p.K; base += 32) {
    const int i = base + lane, c = i < p.K ? count[p.kept0 + i] : 0;
    int incl = c;
    for (int w = 1; w < 32; w <<= 1) {
      const int o = __shfl_up_sync(0xffffffffu, incl, w);
      if (lane >= w) incl += o;
    }
    if (i < p.K) off[p.kept0 + i] = run + incl - c;
    run += __shfl_sync(0xffffffffu, incl, 31);
  }
  __syncwarp();
  for (int base = 0; base < p.E; base += 32) {
    const int j = base + lane, s = slot_of(j);
    const unsigned peers = __match_any_sync(0xffffffffu, s >= 0 ? s : -1 - lane);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    const int at = s >= 0 ? off[p.kept0 + s] : 0;
    if (s >= 0) list[p.ev0 + at + rank] = j;
    __syncwarp();
    if (s >= 0 && rank == 0) off[p.kept0 + s] = at + __popc(peers);
    __syncwarp();
  }
}

// One warp a kept row, a lane a component (strided): its list's rows folded in, in order; a row
// without contributions copied as it is.
__global__ void merge_kept_kernel(const __half* const* __restrict__ rk, const __half* const* __restrict__ rv,
                                  const AssignProblem* __restrict__ P, int np, int64_t n_kept,
                                  const int* __restrict__ keep, const int* __restrict__ evicted,
                                  const int* __restrict__ src, const double* __restrict__ sim,
                                  const int* __restrict__ count, const int* __restrict__ off,
                                  const int* __restrict__ list, int d, int kind, __half* __restrict__ ok,
                                  __half* __restrict__ ov) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (g >= n_kept) return;
  const int n = count[g];
  const AssignProblem p = P[last_at_or_below(np, g, [&](int i) { return P[i].kept0; })];
  const int* js = list + p.ev0 + off[g] - n;
  const int c = keep[g];
  const __half* kc = rk[p.row0 + c];
  const __half* vc = rv[p.row0 + c];
  if (n == 0) {
    for (int t = lane; t < d; t += 32) ok[g * d + t] = kc[t], ov[g * d + t] = vc[t];
    return;
  }
  const double w = __ddiv_rn(1.0, static_cast<double>(n + 1));
  for (int t = lane; t < d; t += 32) {
    const double xk = widen(kc[t]), xv = widen(vc[t]);
    double ak = 0.0, av = 0.0;
    for (int i = 0; i < n; ++i) {
      const int j = js[i];
      const int e = src ? src[p.ev0 + j] : evicted[p.ev0 + j];
      const double ek = widen(rk[p.row0 + e][t]), ev = widen(rv[p.row0 + e][t]);
      if (kind == 1) {
        ak = __dadd_rn(ak, ek);
        av = __dadd_rn(av, ev);
      } else if (kind == 2) {
        ak = __dadd_rn(ak, __dmul_rn(0.5, __dadd_rn(ek, xk)));
        av = __dadd_rn(av, __dmul_rn(0.5, __dadd_rn(ev, xv)));
      } else {
        const double s = sim[p.ev0 + j];
        ak = __fma_rn(s, ek, ak);
        av = __fma_rn(s, ev, av);
      }
    }
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
                int64_t n_kept, int64_t n_evicted, const int* keep, const int* evicted, const int* src, const int* best,
                const double* sim, int d, int kind, __half* ok, __half* ov, int* count, int* scratch, cudaStream_t s) {
  if (n_kept == 0) return;
  int* off = scratch;
  int* list = scratch + n_kept;
  KV_CUDA(cudaMemsetAsync(count, 0, static_cast<size_t>(n_kept) * sizeof(int), s), "merge_kept: the counts");
  const std::string what = std::to_string(n_kept) + " kept rows of " + std::to_string(d) + ", " +
                           std::to_string(n_evicted) + " evicted, kind " + std::to_string(kind);
  merge_lists_kernel<<<(n_problems + 7) / 8, 256, 0, s>>>(problems, n_problems, keep, src, best, count, off, list);
  KV_LAUNCH("merge_lists_kernel", what);
  merge_kept_kernel<<<static_cast<unsigned>((n_kept + 7) / 8), 256, 0, s>>>(k, v, problems, n_problems, n_kept, keep,
                                                                          evicted, src, sim, count, off, list, d, kind,
                                                                          ok, ov);
  KV_LAUNCH("merge_kept_kernel", what);
}

}  // namespace kvlens::cuda
