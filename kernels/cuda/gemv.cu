// Matrix-vector product for decode (one token): every weight is read once, 16 bytes per load,
// fp32 accumulation. CPU twin: cpu::linear with M = 1.
//
// Each warp computes R consecutive rows: lane l reads 16-byte chunks l, l+32, ... of each row
// (UN chunks per iteration, so UN·R = 8 loads are in flight before the first use) and the chunk
// of x at the same offset (x is small and stays in L1); a warp reduction finishes each row. R is
// chosen so that there are enough warps to keep every multiprocessor's memory pipe full.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

template <class T, int R, int UN>
__global__ void __launch_bounds__(256) gemv_kernel(const T* __restrict__ W, const T* __restrict__ x,
                                                   const float* __restrict__ bias, float* __restrict__ y, int N,
                                                   int K, int accumulate) {
  const int lane = threadIdx.x & 31;
  const int groups = (N + R - 1) / R, K8 = K >> 3;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  // Grid-stride over groups of R rows: the grid is as large as the GPU holds at once, so no
  // second, partly filled wave of blocks is left at the end.
  for (int grp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); grp < groups;
       grp += gridDim.x * (blockDim.x >> 5)) {
    const int row0 = grp * R;
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(min(row0 + r, N - 1)) * K);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    int c = lane;
    for (; c + 32 * (UN - 1) < K8; c += 32 * UN) {
      uint4 w[UN][R], xu[UN];
#pragma unroll
      for (int u = 0; u < UN; ++u) {
#pragma unroll
        for (int r = 0; r < R; ++r) w[u][r] = __ldcs(wr[r] + c + 32 * u);  // read once: stream
        xu[u] = __ldg(xv + c + 32 * u);
      }
#pragma unroll
      for (int u = 0; u < UN; ++u) {
        float xf[8];
        unpack8<T>(xu[u], xf);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float wf[8];
          unpack8<T>(w[u][r], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r] = fmaf(wf[i], xf[i], acc[r]);
        }
      }
    }
    for (; c < K8; c += 32) {
      float xf[8];
      unpack8<T>(__ldg(xv + c), xf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[8];
        unpack8<T>(__ldcs(wr[r] + c), wf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r] = fmaf(wf[i], xf[i], acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int row = row0 + r;
        if (row < N) {
          const float v = acc[r] + (bias ? bias[row] : 0.0f);
          y[row] = accumulate ? y[row] + v : v;
        }
      }
    }
  }
}

template <class T, int R, int UN>
void launch(const void* W, const void* x, int N, int K, const float* bias, float* y, bool accumulate, int n_sm,
            cudaStream_t s) {
  static int per_sm = 0;  // resident blocks per multiprocessor for this instantiation
  if (per_sm == 0) {
    KV_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<T, R, UN>, 256, 0), "gemv occupancy");
    per_sm = std::max(per_sm, 1);
  }
  const int groups = (N + R - 1) / R;
  const int blocks = std::min((groups + 7) / 8, per_sm * n_sm);
  gemv_kernel<T, R, UN><<<blocks, 256, 0, s>>>(static_cast<const T*>(W), static_cast<const T*>(x), bias, y, N, K,
                                               accumulate ? 1 : 0);
}

}  // namespace

void gemv(const void* W, const void* x, Dt dt, int N, int K, const float* bias, float* y, bool accumulate, int n_sm,
          cudaStream_t s) {
  if (N == 0) return;
  if (K % 8 != 0 || (dt != Dt::F16 && dt != Dt::BF16))
    throw InternalError("gemv: needs f16/bf16 and K a multiple of 8, got " + std::string(dt_name(dt)) + " K=" +
                        std::to_string(K));
  // Enough warps for ~16 per multiprocessor before rows are grouped.
  const int want = 16 * n_sm;
  const int R = N >= 4 * want ? 4 : N >= 2 * want ? 2 : 1;
  auto go = [&](auto t) {
    using T = decltype(t);
    if (R == 4) launch<T, 4, 2>(W, x, N, K, bias, y, accumulate, n_sm, s);
    else if (R == 2) launch<T, 2, 4>(W, x, N, K, bias, y, accumulate, n_sm, s);
    else launch<T, 1, 8>(W, x, N, K, bias, y, accumulate, n_sm, s);
  };
  if (dt == Dt::F16) go(__half{});
  else go(__nv_bfloat16{});
  KV_LAUNCH("gemv_kernel", std::to_string(N) + "x" + std::to_string(K));
}

}  // namespace kvlens::cuda
