// Matrix-vector product for decode (one token): every weight is read once, 16 bytes per load,
// fp32 accumulation. CPU twins: cpu::linear with M = 1, after rms_norm (norm input) or
// gated_act (gated input).
//
// Each block first stages the input vector x in shared memory in the weights' dtype — x itself,
// RMSNorm(h)·g, or act(gate)·up, rounded exactly as rms_norm / gated_act store it — so each x
// chunk is read once per warp and shared by its R rows. Each warp owns R consecutive rows and
// walks K in stages of 8 loads a lane (R rows × 8/R chunks), double-buffered: the next stage's
// weights are in flight while the current one is multiplied. The weights are streamed past L1
// with L2 evict-first hints, the rows are reduced by warp shuffles, and each warp has exactly
// one group of rows, so every warp finishes at about the same time.
//
// Launch with programmatic dependent launch: the weights do not depend on earlier kernels, so a
// block issues its first stage of weight loads before waiting for the previous kernel
// (griddepcontrol.wait), then reads x; the previous kernel's tail and this kernel's start
// overlap. Nothing produced upstream is read, and nothing is written, before the wait.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
enum Mode : int { kPlain = 0, kNorm = 1, kGated = 2 };

struct Args {
  const uint4* W;
  const uint4* x;
  const float* h;
  const float* g;
  float eps;
  const float* gu;
  int act;
  const float* bias;
  float* y;
  int N, K, accumulate;
};

// An L2 policy that evicts these lines first.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// 16 bytes of weights, read once: no L1 allocation, first out of L2.
__device__ __forceinline__ uint4 ld_stream(const uint4* p, uint64_t pol) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(pol));
  return v;
}

template <class T>
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const T a = from_f<T>(f[2 * i]), b = from_f<T>(f[2 * i + 1]);
    uint16_t ua, ub;
    memcpy(&ua, &a, 2);
    memcpy(&ub, &b, 2);
    w[i] = static_cast<uint32_t>(ua) | (static_cast<uint32_t>(ub) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// x[K] into shared memory as T (K/8 chunks of 16 bytes).
template <class T, int MODE>
__device__ __forceinline__ void stage_x(const Args& a, uint4* xs) {
  const int K8 = a.K >> 3;
  if constexpr (MODE == kPlain) {
    for (int c = threadIdx.x; c < K8; c += kThreads) xs[c] = a.x[c];
  } else if constexpr (MODE == kNorm) {
    // 1/rms of h, reduced as rms_norm_kernel reduces it
    __shared__ float sh[kWarps];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < a.K; i += kThreads) ss += a.h[i] * a.h[i];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = ss;
    __syncthreads();
    float t = (threadIdx.x & 31) < kWarps ? sh[threadIdx.x & 31] : 0.0f;
    t = warp_sum(t);
    const float inv = rsqrtf(t / a.K + a.eps);
    for (int c = threadIdx.x; c < K8; c += kThreads) {
      const float4* h4 = reinterpret_cast<const float4*>(a.h) + 2 * c;
      const float4* g4 = reinterpret_cast<const float4*>(a.g) + 2 * c;
      const float4 h0 = h4[0], h1 = h4[1], g0 = g4[0], g1 = g4[1];
      const float hv[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
      const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = gv[i] * (hv[i] * inv);
      xs[c] = pack8<T>(f);
    }
  } else {
    for (int c = threadIdx.x; c < K8; c += kThreads) {
      const float4* g4 = reinterpret_cast<const float4*>(a.gu) + 2 * c;
      const float4* u4 = reinterpret_cast<const float4*>(a.gu + a.K) + 2 * c;
      const float4 g0 = g4[0], g1 = g4[1], u0 = u4[0], u1 = u4[1];
      const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      const float uv[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = activate(gv[i], a.act) * uv[i];
      xs[c] = pack8<T>(f);
    }
  }
}

template <class T, int R, int MODE>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const Args a) {
  constexpr int U = 8 / R;  // chunks of each row per stage
  extern __shared__ uint4 xs[];
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * R;
  const int K8 = a.K >> 3, stages = (K8 + 32 * U - 1) / (32 * U);
  const bool active = row0 < a.N;
  // Rows past N (the last group only) read row N-1 again; their sums are dropped.
  const uint4* w0 = a.W + static_cast<int64_t>(min(row0, a.N - 1)) * K8;
  int roff[R];
#pragma unroll
  for (int r = 0; r < R; ++r) roff[r] = (min(row0 + r, a.N - 1) - min(row0, a.N - 1)) * K8;

  const uint64_t pol = evict_first_policy();
  uint4 b0[R][U], b1[R][U];
  auto load = [&](uint4(&b)[R][U], int s) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (s * U + u) * 32 + lane;
#pragma unroll
      for (int r = 0; r < R; ++r) b[r][u] = c < K8 ? ld_stream(w0 + roff[r] + c, pol) : make_uint4(0, 0, 0, 0);
    }
  };
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  auto mul = [&](const uint4(&b)[R][U], int s) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (s * U + u) * 32 + lane;
      if (c < K8) {
        float xf[8];
        unpack8<T>(xs[c], xf);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float wf[8];
          unpack8<T>(b[r][u], wf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r] = fmaf(wf[i], xf[i], acc[r]);
        }
      }
    }
  };

  if (active) load(b0, 0);
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's results are visible
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  stage_x<T, MODE>(a, xs);
  __syncthreads();
  if (!active) return;
  for (int s = 0; s < stages; s += 2) {
    if (s + 1 < stages) load(b1, s + 1);
    mul(b0, s);
    if (s + 1 >= stages) break;
    if (s + 2 < stages) load(b0, s + 2);
    mul(b1, s + 1);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
  float v = acc[0];
#pragma unroll
  for (int r = 1; r < R; ++r)
    if (lane == r) v = acc[r];
  const int row = row0 + lane;
  if (lane < R && row < a.N) {
    if (a.bias) v += a.bias[row];
    a.y[row] = a.accumulate ? a.y[row] + v : v;
  }
}

bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("KVLENS_CUDA_PDL");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return on;
}

template <class T, int R, int MODE>
void launch(const Args& a, bool pdl, cudaStream_t s) {
  const int groups = (a.N + R - 1) / R;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>((groups + kWarps - 1) / kWarps));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(a.K) * sizeof(T);
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  KV_CUDA(cudaLaunchKernelEx(&cfg, gemv_kernel<T, R, MODE>, a), std::to_string(a.N) + "x" + std::to_string(a.K));
}

// Resident warps of the R = 8 kernel on the whole GPU (the largest register budget of the four;
// registers, not the staged x, bound the blocks a multiprocessor holds).
template <class T, int MODE>
int resident_warps(int K, int n_sm) {
  static int per_sm = 0;
  if (per_sm == 0) {
    KV_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<T, 8, MODE>, kThreads,
                                                          static_cast<size_t>(K) * sizeof(T)),
            "gemv occupancy");
    per_sm = std::max(per_sm, 1);
  }
  return per_sm * kWarps * n_sm;
}

template <class T, int MODE>
void go(const GemvParams& p, const Args& a, int n_sm, cudaStream_t s) {
  int R = p.rows_per_warp;
  if (R == 0) {  // the fewest rows a warp that keep every warp resident at once
    const int cap = resident_warps<T, MODE>(p.K, n_sm);
    R = 8;
    for (int r : {1, 2, 4})
      if ((p.N + r - 1) / r <= cap) {
        R = r;
        break;
      }
  }
  const bool pdl = p.pdl && pdl_enabled();
  switch (R) {
    case 1: return launch<T, 1, MODE>(a, pdl, s);
    case 2: return launch<T, 2, MODE>(a, pdl, s);
    case 4: return launch<T, 4, MODE>(a, pdl, s);
    case 8: return launch<T, 8, MODE>(a, pdl, s);
  }
  throw InternalError("gemv: rows_per_warp must be 0, 1, 2, 4 or 8, got " + std::to_string(R));
}

}  // namespace

bool gemv_supported(Dt dt, int K) { return (dt == Dt::F16 || dt == Dt::BF16) && K > 0 && K % 8 == 0 && K <= kGemvMaxK; }

void gemv(const GemvParams& p, int n_sm, cudaStream_t s) {
  if (p.N == 0) return;
  if (!gemv_supported(p.dt, p.K))
    throw InternalError("gemv: needs f16/bf16 and K a multiple of 8 up to " + std::to_string(kGemvMaxK) + ", got " +
                        std::string(dt_name(p.dt)) + " K=" + std::to_string(p.K));
  const int mode = p.h ? kNorm : p.gu ? kGated : kPlain;
  if (mode == kPlain && !p.x) throw InternalError("gemv: no input (x, h or gu)");
  const Args a{static_cast<const uint4*>(p.W), static_cast<const uint4*>(p.x), p.h, p.g, p.eps, p.gu, p.act, p.bias,
               p.y, p.N, p.K, p.accumulate ? 1 : 0};
  auto by_mode = [&](auto t) {
    using T = decltype(t);
    if (mode == kNorm) go<T, kNorm>(p, a, n_sm, s);
    else if (mode == kGated) go<T, kGated>(p, a, n_sm, s);
    else go<T, kPlain>(p, a, n_sm, s);
  };
  if (p.dt == Dt::F16) by_mode(__half{});
  else by_mode(__nv_bfloat16{});
}

}  // namespace kvlens::cuda
