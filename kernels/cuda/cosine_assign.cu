// LOOK-M's assignment of evicted rows to kept rows by cosine similarity (Eq. 9), on the device,
// for many KV heads at once (every head of every layer of a compression in one launch), over
// rows given by pointer: fp32 keys copied from the host, or fp16 keys where a device cache
// holds them. Every dot product and norm is added in double in ascending component order from
// 0.0, as the host's lookm_assign does: a product of two floats (or halves) is exact in double,
// so a fused multiply-add rounds the same as the host's multiply then add, and sqrt and division
// are correctly rounded on both sides. The similarities, and so the choices, equal the host's
// bit for bit.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kWarps = 8;  // evicted rows a block (a warp each)

__device__ __forceinline__ double wide(float x) { return static_cast<double>(x); }
__device__ __forceinline__ double wide(__half x) { return static_cast<double>(__half2float(x)); }

template <class T>
__global__ void row_norms_kernel(const T* const* __restrict__ rows, int64_t n, int d, double* __restrict__ norm) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const T* r = rows[i];
  double s = 0.0;
  for (int t = 0; t < d; ++t) s += wide(r[t]) * wide(r[t]);
  norm[i] = sqrt(s);
}

// Block b holds evicted rows [8·(b − tile0), +8) of the problem whose tiles contain b, a warp
// each: each lane scans its share of the kept rows in ascending order, keeping the first largest
// similarity; the warp then takes the largest, ties to the earlier kept row.
template <class T>
__global__ void cosine_assign_kernel(const T* const* __restrict__ rows, const double* __restrict__ norm,
                                     const AssignProblem* __restrict__ P, int np, const int* __restrict__ keep,
                                     const int* __restrict__ ev, int d, int* __restrict__ best, double* __restrict__ sim) {
  int lo = 0, hi = np - 1;  // the last problem whose first tile is ≤ this block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (P[mid].tile0 <= blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const AssignProblem p = P[lo];
  const int lane = threadIdx.x & 31;
  const int64_t i = (static_cast<int64_t>(blockIdx.x) - p.tile0) * kWarps + threadIdx.x / 32;
  if (i >= p.E) return;
  const int e = ev[p.ev0 + i];
  const T* re = rows[p.row0 + e];
  const double ne = norm[p.row0 + e];
  double bs = 0.0;
  int bj = -1;
  for (int j = lane; j < p.K; j += 32) {
    const int c = keep[p.kept0 + j];
    const double nc = norm[p.row0 + c];
    double s = 0.0;
    if (ne != 0.0 && nc != 0.0) {
      const T* rc = rows[p.row0 + c];
      double dot = 0.0;
      for (int t = 0; t < d; ++t) dot += wide(re[t]) * wide(rc[t]);
      s = dot / (ne * nc);
    }
    if (bj < 0 || s > bs) bs = s, bj = j;
  }
  for (int w = 16; w > 0; w >>= 1) {
    const double o = __shfl_down_sync(0xffffffffu, bs, w);
    const int oj = __shfl_down_sync(0xffffffffu, bj, w);
    if (oj >= 0 && (bj < 0 || o > bs || (o == bs && oj < bj))) bs = o, bj = oj;
  }
  if (lane == 0) {
    best[p.ev0 + i] = keep[p.kept0 + bj];
    sim[p.ev0 + i] = bs;
  }
}

template <class T>
void launch(const T* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems, int64_t n_tiles,
            const int* keep, const int* evicted, double* norm, int* best, double* sim, cudaStream_t s) {
  if (n_rows == 0 || n_tiles == 0) return;
  row_norms_kernel<<<static_cast<unsigned>((n_rows + 127) / 128), 128, 0, s>>>(rows, n_rows, d, norm);
  KV_LAUNCH("row_norms_kernel", std::to_string(n_rows) + " rows of " + std::to_string(d));
  cosine_assign_kernel<<<static_cast<unsigned>(n_tiles), 32 * kWarps, 0, s>>>(rows, norm, problems, n_problems, keep,
                                                                             evicted, d, best, sim);
  KV_LAUNCH("cosine_assign_kernel", std::to_string(n_problems) + " heads, " + std::to_string(n_tiles) + " tiles");
}

}  // namespace

int64_t cosine_assign_tiles(int n_evicted) { return (n_evicted + kWarps - 1) / kWarps; }

void cosine_assign(const float* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems,
                   int64_t n_tiles, const int* keep, const int* evicted, double* norm, int* best, double* sim,
                   cudaStream_t s) {
  launch(rows, n_rows, d, problems, n_problems, n_tiles, keep, evicted, norm, best, sim, s);
}
void cosine_assign(const __half* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems,
                   int64_t n_tiles, const int* keep, const int* evicted, double* norm, int* best, double* sim,
                   cudaStream_t s) {
  launch(rows, n_rows, d, problems, n_problems, n_tiles, keep, evicted, norm, best, sim, s);
}

}  // namespace kvlens::cuda
