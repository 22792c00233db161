// Shared pieces of the CUDA kernels: error checks that name the call, the size and the place,
// dtype conversions, vector loads and warp reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "core/backend.h"
#include "core/errors.h"

namespace kvlens::cuda {

// Throws DeviceError naming the call, what it was for (a buffer name and size) and where.
inline void check(cudaError_t e, const char* call, const std::string& what, const char* file, int line) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a sticky-free error so later calls report their own
  throw DeviceError(std::string(call) + " failed for " + what + ": " + cudaGetErrorString(e) + " (" +
                    cudaGetErrorName(e) + ") at " + file + ":" + std::to_string(line));
}
#define KV_CUDA(call, what) ::kvlens::cuda::check((call), #call, (what), __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors surface here, execution errors at the
// next synchronizing call.
#define KV_LAUNCH(kernel, what) ::kvlens::cuda::check(cudaGetLastError(), "launch of " kernel, (what), __FILE__, __LINE__)

inline std::string mib(int64_t bytes) {
  char b[64];
  std::snprintf(b, sizeof b, "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return b;
}

// ---- conversions ------------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ float from_f<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// 8 consecutive 16-bit values (one 16-byte load) as floats.
template <class T>
__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      __half2 h;
      *reinterpret_cast<uint32_t*>(&h) = w[i];
      const float2 p = __half22float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    } else {
      __nv_bfloat162 h;
      *reinterpret_cast<uint32_t*>(&h) = w[i];
      const float2 p = __bfloat1622float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The warp's largest value in one `redux.sync` (sm_80+) instead of five dependent shuffles: a
// float's bits, with a negative value's magnitude bits flipped, order as signed integers, −inf
// included. For the decode loops' running maxima, whose values are never NaN.
__device__ __forceinline__ float warp_max_redux(float v) {
  const int i = __float_as_int(v);
  const int m = __reduce_max_sync(0xffffffffu, i >= 0 ? i : i ^ 0x7fffffff);
  return __int_as_float(m >= 0 ? m : m ^ 0x7fffffff);
}

// The activations of Act, as the CPU twins compute them in fp32.
__device__ __forceinline__ float activate(float v, int act) {
  switch (act) {
    case static_cast<int>(Act::Gelu): return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case static_cast<int>(Act::GeluTanh):
      return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case static_cast<int>(Act::QuickGelu): return v / (1.0f + expf(-1.702f * v));
    case static_cast<int>(Act::Silu): return v / (1.0f + expf(-v));
    case static_cast<int>(Act::Relu): return v > 0.0f ? v : 0.0f;
  }
  return v;
}

// Calls f with the C++ type of a float-like dtype (f32 / f16 / bf16).
template <class F>
void dispatch_float(Dt dt, F&& f) {
  switch (dt) {
    case Dt::F32: f(float{}); return;
    case Dt::F16: f(__half{}); return;
    case Dt::BF16: f(__nv_bfloat16{}); return;
    case Dt::I32: break;
  }
  throw InternalError("cuda: an integer buffer where a float one is needed");
}

// ---- asynchronous copies to shared memory (sm_80+) --------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { cp_async_wait<0>(); }

// *p += v at device scope with acquire-release order; returns the old value.
__device__ __forceinline__ int atomic_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// RoPE of the channel pair (a, b), a from the row's first half, at the angle whose sine and
// cosine are sn, cs: a' = a·cos − b·sin and b' = b·cos + a·sin, each a product and a fused
// multiply-add in this order, so that every kernel rotating a row (rope_append's and the decode
// kernels' fused tokens) gives the same bits.
__device__ __forceinline__ float rope_first(float a, float b, float sn, float cs) { return __fmaf_rn(a, cs, -__fmul_rn(b, sn)); }
__device__ __forceinline__ float rope_second(float a, float b, float sn, float cs) { return __fmaf_rn(b, cs, __fmul_rn(a, sn)); }

// ---- programmatic dependent launch ----------------------------------------------------------
// A kernel started by launch_dependent() may begin while the previous kernel in the stream is
// still running: it calls pdl_wait() before it touches memory that earlier kernels write (it
// may read constant data, such as weights, before). pdl_trigger() lets the next such kernel be
// scheduled once every block of this one has called it or exited; the next kernel's pdl_wait()
// still waits for this one to finish. Both are no-ops when the kernel was launched normally.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// On unless KVLENS_CUDA_PDL=0 (to measure what it gains).
inline bool pdl_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("KVLENS_CUDA_PDL");
    return !(e && std::string(e) == "0");
  }();
  return on;
}
template <class... P, class... A>
cudaError_t launch_dependent(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, bool pdl,
                             A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl && pdl_enabled() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

inline int blocks_for(int64_t n, int threads) { return static_cast<int>((n + threads - 1) / threads); }

}  // namespace kvlens::cuda
