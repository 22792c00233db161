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

constexpr int kWarps = 8;           // warps a block
constexpr int kRowsPerBlock = 64;   // evicted rows a block (kRowsPerBlock / kWarps a warp, in turn)
constexpr int kSharedLimit = 200 * 1024;  // at most; less where the device allows less a block

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

// Block b holds evicted rows [64·(b − tile0), +64) of the problem whose tiles contain b; each
// warp takes its rows in turn, the row widened to double in shared memory. Each lane scans its
// share of the kept rows in ascending order (from shared memory, transposed so that the lanes
// read consecutive values, when kShared; else where they are), keeping the first largest
// similarity; the warp then takes the largest, ties to the earlier kept row.
template <class T, bool kShared>
__global__ void cosine_assign_kernel(const T* const* __restrict__ rows, const double* __restrict__ norm,
                                     const AssignProblem* __restrict__ P, int np, const int* __restrict__ keep,
                                     const int* __restrict__ ev, int d, int* __restrict__ best, double* __restrict__ sim) {
  extern __shared__ double smem[];
  int lo = 0, hi = np - 1;  // the last problem whose first tile is ≤ this block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (P[mid].tile0 <= blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const AssignProblem p = P[lo];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  double* er = smem + static_cast<int64_t>(warp) * d;  // this warp's evicted row
  double* kn = smem + static_cast<int64_t>(kWarps) * d;  // kept norms [K] (kShared)
  T* ks = reinterpret_cast<T*>(kn + p.K);                // kept rows [d][K] (kShared)
  if (kShared) {
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(p.K) * d; x += blockDim.x) {
      const int j = static_cast<int>(x / d), t = static_cast<int>(x % d);
      ks[static_cast<int64_t>(t) * p.K + j] = rows[p.row0 + keep[p.kept0 + j]][t];
    }
    for (int j = threadIdx.x; j < p.K; j += blockDim.x) kn[j] = norm[p.row0 + keep[p.kept0 + j]];
    __syncthreads();
  }
  const int64_t first = (static_cast<int64_t>(blockIdx.x) - p.tile0) * kRowsPerBlock;
  for (int r = warp; r < kRowsPerBlock; r += kWarps) {
    const int64_t i = first + r;
    if (i >= p.E) break;
    const int e = ev[p.ev0 + i];
    const T* re = rows[p.row0 + e];
    for (int t = lane; t < d; t += 32) er[t] = wide(re[t]);
    __syncwarp();
    const double ne = norm[p.row0 + e];
    double bs = 0.0;
    int bj = -1;
    for (int j = lane; j < p.K; j += 32) {
      const double nc = kShared ? kn[j] : norm[p.row0 + keep[p.kept0 + j]];
      double s = 0.0;
      if (ne != 0.0 && nc != 0.0) {
        double dot = 0.0;
        if (kShared) {
          for (int t = 0; t < d; ++t) dot += er[t] * wide(ks[static_cast<int64_t>(t) * p.K + j]);
        } else {
          const T* rc = rows[p.row0 + keep[p.kept0 + j]];
          for (int t = 0; t < d; ++t) dot += er[t] * wide(rc[t]);
        }
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
    __syncwarp();  // (the row's buffer is rewritten next)
  }
}

// The dynamic shared memory a block of this device may opt in to, capped at kSharedLimit.
int shared_limit() {
  int dev = 0, optin = 0;
  KV_CUDA(cudaGetDevice(&dev), "cosine_assign: the current device");
  KV_CUDA(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
          "cosine_assign: the device's shared memory a block");
  return optin < kSharedLimit ? optin : kSharedLimit;
}

// Opts the shared-memory kernel in to `bytes` of dynamic shared memory the first time a launch
// needs more than before (past the 48 KiB a block gets without).
template <class T>
void allow_shared(int64_t bytes) {
  static int64_t allowed = 0;
  if (bytes <= allowed) return;
  KV_CUDA(cudaFuncSetAttribute(cosine_assign_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "cosine_assign_kernel shared memory of " + std::to_string(bytes) + " bytes");
  allowed = bytes;
}

template <class T>
void launch(const T* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems, int64_t n_tiles,
            int max_kept, const int* keep, const int* evicted, double* norm, int* best, double* sim, cudaStream_t s) {
  if (n_rows == 0 || n_tiles == 0) return;
  row_norms_kernel<<<static_cast<unsigned>((n_rows + 127) / 128), 128, 0, s>>>(rows, n_rows, d, norm);
  KV_LAUNCH("row_norms_kernel", std::to_string(n_rows) + " rows of " + std::to_string(d));
  const int64_t base = static_cast<int64_t>(kWarps) * d * 8;
  const int64_t shared = base + static_cast<int64_t>(max_kept) * (8 + static_cast<int64_t>(d) * sizeof(T)) + 16;
  const std::string what = std::to_string(n_problems) + " heads, " + std::to_string(n_tiles) + " tiles, " +
                           std::to_string(max_kept) + " kept at most";
  static const int limit = shared_limit();  // (one device a process)
  if (shared <= limit) {
    allow_shared<T>(shared);
    cosine_assign_kernel<T, true><<<static_cast<unsigned>(n_tiles), 32 * kWarps, static_cast<size_t>(shared), s>>>(
        rows, norm, problems, n_problems, keep, evicted, d, best, sim);
  } else {
    cosine_assign_kernel<T, false><<<static_cast<unsigned>(n_tiles), 32 * kWarps, static_cast<size_t>(base), s>>>(
        rows, norm, problems, n_problems, keep, evicted, d, best, sim);
  }
  KV_LAUNCH("cosine_assign_kernel", what);
}

}  // namespace

int64_t cosine_assign_tiles(int n_evicted) { return (n_evicted + kRowsPerBlock - 1) / kRowsPerBlock; }

void cosine_assign(const float* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems,
                   int64_t n_tiles, int max_kept, const int* keep, const int* evicted, double* norm, int* best,
                   double* sim, cudaStream_t s) {
  launch(rows, n_rows, d, problems, n_problems, n_tiles, max_kept, keep, evicted, norm, best, sim, s);
}
void cosine_assign(const __half* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems,
                   int64_t n_tiles, int max_kept, const int* keep, const int* evicted, double* norm, int* best,
                   double* sim, cudaStream_t s) {
  launch(rows, n_rows, d, problems, n_problems, n_tiles, max_kept, keep, evicted, norm, best, sim, s);
}

}  // namespace kvlens::cuda
