// LOOK-M's merge of evicted rows into kept ones (Eq. 10–12) on the device: the twin of
// core/row_merge.cpp's merge_rows. Each step is the one correctly rounded double operation the
// host does (__dadd_rn / __dmul_rn, so the compiler fuses nothing, and fma where the host calls
// std::fma); fp16 inputs widen to double exactly. So a merged row equals the host's bit for bit,
// after the same roundings to float and then to fp16.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

__device__ __forceinline__ double widen(__half x) { return static_cast<double>(__half2float(x)); }

// One block per merged row, a thread per component (strided).
__global__ void merge_rows_kernel(const __half* const* __restrict__ kc, const __half* const* __restrict__ vc,
                                  const int* __restrict__ first, const __half* const* __restrict__ ke,
                                  const __half* const* __restrict__ ve, const double* __restrict__ s, int d, int kind,
                                  __half* __restrict__ ok, __half* __restrict__ ov) {
  const int i = blockIdx.x;
  const int j0 = first[i], j1 = first[i + 1];
  const double w = __ddiv_rn(1.0, static_cast<double>(j1 - j0 + 1));
  for (int t = threadIdx.x; t < d; t += blockDim.x) {
    const double xk = widen(kc[i][t]), xv = widen(vc[i][t]);
    double ak = 0.0, av = 0.0;
    for (int j = j0; j < j1; ++j) {
      const double ek = widen(ke[j][t]), ev = widen(ve[j][t]);
      if (kind == 1) {
        ak = __dadd_rn(ak, ek);
        av = __dadd_rn(av, ev);
      } else if (kind == 2) {
        ak = __dadd_rn(ak, __dmul_rn(0.5, __dadd_rn(ek, xk)));
        av = __dadd_rn(av, __dmul_rn(0.5, __dadd_rn(ev, xv)));
      } else {
        ak = __fma_rn(s[j], ek, ak);
        av = __fma_rn(s[j], ev, av);
      }
    }
    const int64_t o = static_cast<int64_t>(i) * d + t;
    ok[o] = __float2half_rn(__double2float_rn(__dmul_rn(__dadd_rn(xk, ak), w)));
    ov[o] = __float2half_rn(__double2float_rn(__dmul_rn(__dadd_rn(xv, av), w)));
  }
}

}  // namespace

void merge_rows(const __half* const* kc, const __half* const* vc, const int* first, const __half* const* ke,
                const __half* const* ve, const double* s, int m, int d, int kind, __half* ok, __half* ov,
                cudaStream_t st) {
  if (m == 0) return;
  const int threads = d >= 128 ? 128 : (d + 31) / 32 * 32;
  merge_rows_kernel<<<m, threads, 0, st>>>(kc, vc, first, ke, ve, s, d, kind, ok, ov);
  KV_LAUNCH("merge_rows_kernel", std::to_string(m) + " rows of " + std::to_string(d) + ", kind " + std::to_string(kind));
}

}  // namespace kvlens::cuda
