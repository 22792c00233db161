// LOOK-M's assignment of evicted rows to kept rows by cosine similarity (Eq. 9), on the device,
// over fp32 keys (copied from the host) or fp16 keys (a device cache's rows). Every dot product and norm is added in double in ascending component order from 0.0, as the
// host's lookm_assign does: a product of two floats is exact in double, so a fused multiply-add
// rounds the same as the host's multiply then add, and sqrt and division are correctly rounded
// on both sides. The similarities, and so the choices, equal the host's bit for bit.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

__device__ __forceinline__ double wide(float x) { return static_cast<double>(x); }
__device__ __forceinline__ double wide(__half x) { return static_cast<double>(__half2float(x)); }

template <class T>
__global__ void row_norms_kernel(const T* __restrict__ k, int n, int d, double* __restrict__ norm) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const T* r = k + static_cast<int64_t>(i) * d;
  double s = 0.0;
  for (int t = 0; t < d; ++t) s += wide(r[t]) * wide(r[t]);
  norm[i] = sqrt(s);
}

// One block per evicted row: each thread scans its share of the kept rows in ascending order,
// keeping the first largest similarity; the block then takes the largest, ties to the earlier.
template <class T>
__global__ void cosine_assign_kernel(const T* __restrict__ k, int d, const double* __restrict__ norm,
                                     const int* __restrict__ keep, int n_keep, const int* __restrict__ evicted,
                                     int* __restrict__ best, double* __restrict__ sim) {
  __shared__ double ss[256];
  __shared__ int sj[256];
  const int e = evicted[blockIdx.x];
  const T* re = k + static_cast<int64_t>(e) * d;
  const double ne = norm[e];
  double bs = 0.0;
  int bj = -1;
  for (int j = threadIdx.x; j < n_keep; j += blockDim.x) {
    const int c = keep[j];
    double s = 0.0;
    if (ne != 0.0 && norm[c] != 0.0) {
      const T* rc = k + static_cast<int64_t>(c) * d;
      double dot = 0.0;
      for (int t = 0; t < d; ++t) dot += wide(re[t]) * wide(rc[t]);
      s = dot / (ne * norm[c]);
    }
    if (bj < 0 || s > bs) bs = s, bj = j;
  }
  ss[threadIdx.x] = bs;
  sj[threadIdx.x] = bj;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      const double o = ss[threadIdx.x + w];
      const int oj = sj[threadIdx.x + w];
      const int mj = sj[threadIdx.x];
      if (oj >= 0 && (mj < 0 || o > ss[threadIdx.x] || (o == ss[threadIdx.x] && oj < mj))) {
        ss[threadIdx.x] = o;
        sj[threadIdx.x] = oj;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    best[blockIdx.x] = keep[sj[0]];
    sim[blockIdx.x] = ss[0];
  }
}

template <class T>
void launch(const T* k, int n, int d, const int* keep, int n_keep, const int* evicted, int n_evicted, double* norm,
            int* best, double* sim, cudaStream_t s) {
  if (n == 0 || n_evicted == 0 || n_keep == 0) return;
  row_norms_kernel<<<(n + 127) / 128, 128, 0, s>>>(k, n, d, norm);
  KV_LAUNCH("row_norms_kernel", std::to_string(n) + " rows of " + std::to_string(d));
  cosine_assign_kernel<<<n_evicted, 256, 0, s>>>(k, d, norm, keep, n_keep, evicted, best, sim);
  KV_LAUNCH("cosine_assign_kernel", std::to_string(n_evicted) + " evicted x " + std::to_string(n_keep) + " kept");
}

}  // namespace

void cosine_assign(const float* k, int n, int d, const int* keep, int n_keep, const int* evicted, int n_evicted,
                   double* norm, int* best, double* sim, cudaStream_t s) {
  launch(k, n, d, keep, n_keep, evicted, n_evicted, norm, best, sim, s);
}
void cosine_assign(const __half* k, int n, int d, const int* keep, int n_keep, const int* evicted, int n_evicted,
                   double* norm, int* best, double* sim, cudaStream_t s) {
  launch(k, n, d, keep, n_keep, evicted, n_evicted, norm, best, sim, s);
}

}  // namespace kvlens::cuda
