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
constexpr int kRowsPerBlock = 64;   // evicted rows a block (kRowsPerBlock / kWarps a warp)
constexpr int kRowsAtOnce = 4;      // of a warp's rows, those whose dot products share a kept value
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

// The dot products of a warp's kRowsAtOnce evicted rows (er, [kRowsAtOnce][d] in double) with
// kept row j, each added in ascending component order from 0.0 (fused: a product of two widened
// halves or floats is exact). Each kept value is widened once for all the rows; kPairs (d even):
// the rows' values read two at a time.
template <class T, bool kShared, bool kPairs>
__device__ __forceinline__ void dot_rows(const double* er, int d, const T* ks, int K, int j, const T* rc, double* acc) {
#pragma unroll
  for (int q = 0; q < kRowsAtOnce; ++q) acc[q] = 0.0;
  auto kept = [&](int t) { return wide(kShared ? ks[static_cast<int64_t>(t) * K + j] : rc[t]); };
  int t = 0;
  if (kPairs)
    for (; t + 4 <= d; t += 4) {
      const double c0 = kept(t), c1 = kept(t + 1), c2 = kept(t + 2), c3 = kept(t + 3);
#pragma unroll
      for (int q = 0; q < kRowsAtOnce; ++q) {
        const double2 a = *reinterpret_cast<const double2*>(er + q * d + t);
        const double2 b = *reinterpret_cast<const double2*>(er + q * d + t + 2);
        acc[q] = fma(a.x, c0, acc[q]);
        acc[q] = fma(a.y, c1, acc[q]);
        acc[q] = fma(b.x, c2, acc[q]);
        acc[q] = fma(b.y, c3, acc[q]);
      }
    }
  for (; t < d; ++t) {
    const double c = kept(t);
#pragma unroll
    for (int q = 0; q < kRowsAtOnce; ++q) acc[q] = fma(er[q * d + t], c, acc[q]);
  }
}

// Block b holds evicted rows [64·(b − tile0), +64) of the problem whose tiles contain b; each
// warp takes its 8 rows kRowsAtOnce at a time, widened to double in shared memory. Each lane
// scans its share of the kept rows in ascending order (from shared memory, transposed so that
// the lanes read consecutive values, when kShared; else where they are), keeping for each row
// the first largest similarity; the warp then takes each row's largest, ties to the earlier
// kept row.
template <class T, bool kShared, bool kPairs>
__global__ void cosine_assign_kernel(const T* const* __restrict__ rows, const double* __restrict__ norm,
                                     const AssignProblem* __restrict__ P, int np, const int* __restrict__ keep,
                                     const int* __restrict__ ev, int d, int* __restrict__ best, double* __restrict__ sim) {
  extern __shared__ __align__(16) double smem[];
  int lo = 0, hi = np - 1;  // the last problem whose first tile is ≤ this block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (P[mid].tile0 <= blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const AssignProblem p = P[lo];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  double* er = smem + static_cast<int64_t>(warp) * kRowsAtOnce * d;  // this warp's evicted rows
  double* kn = smem + static_cast<int64_t>(kWarps) * kRowsAtOnce * d;  // kept norms [K] (kShared)
  T* ks = reinterpret_cast<T*>(kn + p.K);                               // kept rows [d][K] (kShared)
  if (kShared) {
    for (int64_t x = threadIdx.x; x < static_cast<int64_t>(p.K) * d; x += blockDim.x) {
      const int j = static_cast<int>(x / d), t = static_cast<int>(x % d);
      ks[static_cast<int64_t>(t) * p.K + j] = rows[p.row0 + keep[p.kept0 + j]][t];
    }
    for (int j = threadIdx.x; j < p.K; j += blockDim.x) kn[j] = norm[p.row0 + keep[p.kept0 + j]];
    __syncthreads();
  }
  constexpr int kPerWarp = kRowsPerBlock / kWarps;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) - p.tile0) * kRowsPerBlock + warp * kPerWarp;
  for (int r0 = 0; r0 < kPerWarp; r0 += kRowsAtOnce) {
    const int64_t i0 = first + r0;
    if (i0 >= p.E) break;
    const int nr = static_cast<int>(min(static_cast<int64_t>(kRowsAtOnce), p.E - i0));
    double ne[kRowsAtOnce];
#pragma unroll
    for (int q = 0; q < kRowsAtOnce; ++q) {
      const int e = q < nr ? ev[p.ev0 + i0 + q] : -1;
      const T* re = e >= 0 ? rows[p.row0 + e] : nullptr;
      for (int t = lane; t < d; t += 32) er[q * d + t] = re ? wide(re[t]) : 0.0;
      ne[q] = re ? norm[p.row0 + e] : 0.0;
    }
    __syncwarp();
    double bs[kRowsAtOnce], acc[kRowsAtOnce];
    int bj[kRowsAtOnce];
#pragma unroll
    for (int q = 0; q < kRowsAtOnce; ++q) bs[q] = 0.0, bj[q] = -1;
    for (int j = lane; j < p.K; j += 32) {
      const double nc = kShared ? kn[j] : norm[p.row0 + keep[p.kept0 + j]];
      const T* rc = kShared ? nullptr : rows[p.row0 + keep[p.kept0 + j]];
      dot_rows<T, kShared, kPairs>(er, d, ks, p.K, j, rc, acc);
#pragma unroll
      for (int q = 0; q < kRowsAtOnce; ++q) {
        const double s = ne[q] != 0.0 && nc != 0.0 ? acc[q] / (ne[q] * nc) : 0.0;
        if (bj[q] < 0 || s > bs[q]) bs[q] = s, bj[q] = j;
      }
    }
#pragma unroll
    for (int q = 0; q < kRowsAtOnce; ++q) {
      for (int w = 16; w > 0; w >>= 1) {
        const double o = __shfl_down_sync(0xffffffffu, bs[q], w);
        const int oj = __shfl_down_sync(0xffffffffu, bj[q], w);
        if (oj >= 0 && (bj[q] < 0 || o > bs[q] || (o == bs[q] && oj < bj[q]))) bs[q] = o, bj[q] = oj;
      }
      if (lane == 0 && q < nr) {
        best[p.ev0 + i0 + q] = keep[p.kept0 + bj[q]];
        sim[p.ev0 + i0 + q] = bs[q];
      }
    }
    __syncwarp();  // (the rows' buffer is rewritten next)
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

// Opts the kernel in to `bytes` of dynamic shared memory the first time a launch needs more than
// before (past the 48 KiB a block gets without).
template <class T, bool kShared, bool kPairs>
void allow_shared(int64_t bytes) {
  static int64_t allowed = 48 * 1024;
  if (bytes <= allowed) return;
  KV_CUDA(cudaFuncSetAttribute(cosine_assign_kernel<T, kShared, kPairs>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes)),
          "cosine_assign_kernel shared memory of " + std::to_string(bytes) + " bytes");
  allowed = bytes;
}

template <class T, bool kShared, bool kPairs>
void launch_assign(int64_t n_tiles, int64_t shared, const T* const* rows, const double* norm,
                   const AssignProblem* problems, int n_problems, const int* keep, const int* evicted, int d, int* best,
                   double* sim, cudaStream_t s) {
  allow_shared<T, kShared, kPairs>(shared);
  cosine_assign_kernel<T, kShared, kPairs><<<static_cast<unsigned>(n_tiles), 32 * kWarps, static_cast<size_t>(shared), s>>>(
      rows, norm, problems, n_problems, keep, evicted, d, best, sim);
}

template <class T>
void launch(const T* const* rows, int64_t n_rows, int d, const AssignProblem* problems, int n_problems, int64_t n_tiles,
            int max_kept, const int* keep, const int* evicted, double* norm, int* best, double* sim, cudaStream_t s) {
  if (n_rows == 0 || n_tiles == 0) return;
  row_norms_kernel<<<static_cast<unsigned>((n_rows + 127) / 128), 128, 0, s>>>(rows, n_rows, d, norm);
  KV_LAUNCH("row_norms_kernel", std::to_string(n_rows) + " rows of " + std::to_string(d));
  const int64_t base = static_cast<int64_t>(kWarps) * kRowsAtOnce * d * 8;
  const int64_t shared = base + static_cast<int64_t>(max_kept) * (8 + static_cast<int64_t>(d) * sizeof(T)) + 16;
  const std::string what = std::to_string(n_problems) + " heads, " + std::to_string(n_tiles) + " tiles, " +
                           std::to_string(max_kept) + " kept at most";
  static const int limit = shared_limit();  // (one device a process)
  const bool staged = shared <= limit, pairs = d % 2 == 0;
  if (staged && pairs) launch_assign<T, true, true>(n_tiles, shared, rows, norm, problems, n_problems, keep, evicted, d, best, sim, s);
  else if (staged) launch_assign<T, true, false>(n_tiles, shared, rows, norm, problems, n_problems, keep, evicted, d, best, sim, s);
  else if (pairs) launch_assign<T, false, true>(n_tiles, base, rows, norm, problems, n_problems, keep, evicted, d, best, sim, s);
  else launch_assign<T, false, false>(n_tiles, base, rows, norm, problems, n_problems, keep, evicted, d, best, sim, s);
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
