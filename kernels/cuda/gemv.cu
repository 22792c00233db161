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

// The 8 inputs of chunk c: x itself, or (NORM) RMSNorm computed on the fly from fp32 h and g
// with the block's 1/rms, rounded to T exactly as rms_norm stores it.
template <class T, bool NORM>
__device__ __forceinline__ void x_chunk(const uint4* xv, const float* h, const float* g, float inv, int c, float* f) {
  if constexpr (NORM) {
    const float4 h0 = __ldg(reinterpret_cast<const float4*>(h) + 2 * c), h1 = __ldg(reinterpret_cast<const float4*>(h) + 2 * c + 1);
    const float4 g0 = __ldg(reinterpret_cast<const float4*>(g) + 2 * c), g1 = __ldg(reinterpret_cast<const float4*>(g) + 2 * c + 1);
    const float hv[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_f<T>(from_f<T>(gv[i] * (hv[i] * inv)));
  } else {
    unpack8<T>(__ldg(xv + c), f);
  }
}

template <class T, int R, int UN, bool NORM>
__global__ void __launch_bounds__(256) gemv_kernel(const T* __restrict__ W, const T* __restrict__ x,
                                                   const float* __restrict__ h, const float* __restrict__ gw,
                                                   float eps, const float* __restrict__ bias, float* __restrict__ y,
                                                   int N, int K, int accumulate) {
  const int lane = threadIdx.x & 31;
  const int groups = (N + R - 1) / R, K8 = K >> 3;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float inv = 0.0f;
  if constexpr (NORM) {  // 1/rms of h, reduced as rms_norm_kernel reduces it
    __shared__ float sh[32];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) ss += h[i] * h[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = ss;
    __syncthreads();
    float t = (threadIdx.x & 31) < static_cast<int>(blockDim.x >> 5) ? sh[threadIdx.x & 31] : 0.0f;
    t = warp_sum(t);
    inv = rsqrtf(t / K + eps);
  }
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
        if constexpr (!NORM) xu[u] = __ldg(xv + c + 32 * u);
      }
#pragma unroll
      for (int u = 0; u < UN; ++u) {
        float xf[8];
        if constexpr (NORM) x_chunk<T, true>(xv, h, gw, inv, c + 32 * u, xf);
        else unpack8<T>(xu[u], xf);
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
      x_chunk<T, NORM>(xv, h, gw, inv, c, xf);
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

template <class T, int R, int UN, bool NORM>
void launch(const void* W, const void* x, const float* h, const float* g, float eps, int N, int K, const float* bias,
            float* y, bool accumulate, int n_sm, cudaStream_t s) {
  static int per_sm = 0;  // resident blocks per multiprocessor for this instantiation
  if (per_sm == 0) {
    KV_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<T, R, UN, NORM>, 256, 0),
            "gemv occupancy");
    per_sm = std::max(per_sm, 1);
  }
  const int groups = (N + R - 1) / R;
  const int blocks = std::min((groups + 7) / 8, per_sm * n_sm);
  gemv_kernel<T, R, UN, NORM><<<blocks, 256, 0, s>>>(static_cast<const T*>(W), static_cast<const T*>(x), h, g, eps,
                                                     bias, y, N, K, accumulate ? 1 : 0);
}

template <bool NORM>
void dispatch(const void* W, const void* x, const float* h, const float* g, float eps, Dt dt, int N, int K,
              const float* bias, float* y, bool accumulate, int n_sm, cudaStream_t s) {
  if (N == 0) return;
  if (K % 8 != 0 || (dt != Dt::F16 && dt != Dt::BF16))
    throw InternalError("gemv: needs f16/bf16 and K a multiple of 8, got " + std::string(dt_name(dt)) + " K=" +
                        std::to_string(K));
  // Enough warps for ~16 per multiprocessor before rows are grouped.
  const int want = 16 * n_sm;
  const int R = N >= 4 * want ? 4 : N >= 2 * want ? 2 : 1;
  auto go = [&](auto t) {
    using T = decltype(t);
    if (R == 4) launch<T, 4, 2, NORM>(W, x, h, g, eps, N, K, bias, y, accumulate, n_sm, s);
    else if (R == 2) launch<T, 2, 4, NORM>(W, x, h, g, eps, N, K, bias, y, accumulate, n_sm, s);
    else launch<T, 1, 8, NORM>(W, x, h, g, eps, N, K, bias, y, accumulate, n_sm, s);
  };
  if (dt == Dt::F16) go(__half{});
  else go(__nv_bfloat16{});
  KV_LAUNCH("gemv_kernel", std::to_string(N) + "x" + std::to_string(K));
}

}  // namespace

void gemv(const void* W, const void* x, Dt dt, int N, int K, const float* bias, float* y, bool accumulate, int n_sm,
          cudaStream_t s) {
  dispatch<false>(W, x, nullptr, nullptr, 0.0f, dt, N, K, bias, y, accumulate, n_sm, s);
}

void gemv_norm(const void* W, Dt dt, int N, int K, const float* h, const float* g, float eps, const float* bias,
               float* y, int n_sm, cudaStream_t s) {
  dispatch<true>(W, nullptr, h, g, eps, dt, N, K, bias, y, false, n_sm, s);
}

}  // namespace kvlens::cuda
