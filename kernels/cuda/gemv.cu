// Matrix-vector product for decode (one token): every weight is read once, 16 bytes per load,
// fp32 accumulation. CPU twins: cpu::linear with M = 1, after rms_norm (norm input), and for the
// paired mode gated_act after it.
//
// Each block first stages the input vector x in shared memory in the weights' dtype — x itself,
// or RMSNorm(h)·g rounded exactly as rms_norm stores it — so each x chunk is read once per warp
// and shared by its R rows. Each warp owns groups of R consecutive rows — one group a warp, blocks
// past the first wave starting as slots free up; or, on a grid held to fewer blocks
// (max_blocks), groups warp, warp + all warps, ... — and walks K in stages of 8 loads a lane
// (R rows × 8/R chunks), two stages in flight: the stage after next is loaded while the current
// one is multiplied, from one group into the next. The weights are streamed past L1 with L2 evict-first hints; the rows are reduced
// by warp shuffles.
//
// Paired mode (the MLP's gate and up products of a decode step): W holds 2N rows, the N gate
// rows then the N up rows; warp i owns rows i and N + i, with the same per-lane order of loads
// and sums as one row a warp, and writes act(gate)·up rounded to the weights' dtype, as
// gated_act computes it from the two fp32 sums — so the down product reads a plain fp16 input
// and no fp32 gate/up vector is written or read.
//
// Launched as a programmatic dependent (common.cuh): the weights do not depend on earlier
// kernels, so a block issues its first two stages of weight loads before it waits for the
// previous kernel, then reads x; the previous kernel's tail and this kernel's start overlap.
// Nothing produced upstream is read, and nothing is written, before the wait.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kernels.h"

namespace kvlens::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
// Dynamic shared memory a block may have without asking (x past it, up to kGemvMaxK, is asked for).
constexpr size_t kDefaultSmem = 48 * 1024 - 256;
enum Mode : int { kPlain = 0, kNorm = 1, kNormPair = 2 };

struct Args {
  const uint4* W;
  const uint4* x;
  const float* h;
  const float* g;
  float eps;
  int act;
  const float* bias;
  float* y;
  void* out;  // kNormPair: act(gate)·up, N values in the weights' dtype
  int N, K, accumulate;
  unsigned long long* check;
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

// x[K] into shared memory as T (K/8 chunks of 16 bytes). Each thread issues the loads of two of
// its chunks before using them, so a block's staging takes few L2 round trips.
template <class T, int MODE>
__device__ __forceinline__ void stage_x(const Args& a, uint4* xs) {
  const int K8 = a.K >> 3;
  if constexpr (MODE == kPlain) {
    for (int c = threadIdx.x; c < K8; c += kThreads) xs[c] = a.x[c];
  } else {
    // 1/rms of h, summed in rms_norm_kernel's order (thread t: h[t], h[t + 256], ...)
    __shared__ float sh[kWarps];
    float ss = 0.0f;
    int i = threadIdx.x;
    const bool check = a.check && blockIdx.x == 0;
    auto checked = [&](float v, int at) {
      if (check && !isfinite(v))
        atomicMin(a.check, (static_cast<unsigned long long>(at) << 32) | __float_as_uint(v));
    };
    for (; i + 7 * kThreads < a.K; i += 8 * kThreads) {
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = a.h[i + j * kThreads];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        ss += v[j] * v[j];
        checked(v[j], i + j * kThreads);
      }
    }
    for (; i < a.K; i += kThreads) {
      ss += a.h[i] * a.h[i];
      checked(a.h[i], i);
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = ss;
    __syncthreads();
    float t = (threadIdx.x & 31) < kWarps ? sh[threadIdx.x & 31] : 0.0f;
    t = warp_sum(t);
    const float inv = rsqrtf(t / a.K + a.eps);
    for (int c0 = threadIdx.x; c0 < K8; c0 += 2 * kThreads) {
      float4 pv[2][2], qv[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = c0 + j * kThreads;
        if (c < K8) {
          const float4* p4 = reinterpret_cast<const float4*>(a.h) + 2 * c;
          const float4* q4 = reinterpret_cast<const float4*>(a.g) + 2 * c;
          pv[j][0] = p4[0], pv[j][1] = p4[1], qv[j][0] = q4[0], qv[j][1] = q4[1];
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = c0 + j * kThreads;
        if (c >= K8) break;
        const float pf[8] = {pv[j][0].x, pv[j][0].y, pv[j][0].z, pv[j][0].w, pv[j][1].x, pv[j][1].y, pv[j][1].z, pv[j][1].w};
        const float qf[8] = {qv[j][0].x, qv[j][0].y, qv[j][0].z, qv[j][0].w, qv[j][1].x, qv[j][1].y, qv[j][1].z, qv[j][1].w};
        float f[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = qf[i] * (pf[i] * inv);  // g·(h/rms), as rms_norm
        xs[c] = pack8<T>(f);
      }
    }
  }
}

template <class T, int R, int MODE>
__global__ void __launch_bounds__(kThreads, 2) gemv_kernel(const Args a) {
  constexpr int U = 8 / R;  // chunks of each row per stage
  constexpr bool PAIR = MODE == kNormPair;
  static_assert(!PAIR || R == 2, "a paired warp owns two rows");
  extern __shared__ uint4 xs[];
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * kWarps;
  const int warp = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int groups = PAIR ? a.N : (a.N + R - 1) / R;
  const int K8 = a.K >> 3, stages = (K8 + 32 * U - 1) / (32 * U);
  // This warp's row groups are warp, warp + warps, ...; it walks their stages as one sequence of
  // items (group, stage), so the loads of the next group are in flight while this one ends.
  const int items = warp < groups ? ((groups - 1 - warp) / warps + 1) * stages : 0;
  // The first row of a group and each of its R rows' offset from it. Rows past N (the last
  // group only) read row N-1 again; their sums are dropped.
  auto rows = [&](int g, int64_t(&off)[R]) -> const uint4* {
    const int row0 = PAIR ? g : g * R;
    const int first = min(row0, a.N - 1);
#pragma unroll
    for (int r = 0; r < R; ++r)
      off[r] = PAIR ? static_cast<int64_t>(r) * a.N * K8 : static_cast<int64_t>(min(row0 + r, a.N - 1) - first) * K8;
    return a.W + static_cast<int64_t>(first) * K8;
  };

  const uint64_t pol = evict_first_policy();
  uint4 b0[R][U], b1[R][U];
  int lg = warp, ls = 0;  // the next item to load
  auto load = [&](uint4(&b)[R][U]) {
    int64_t off[R];
    const uint4* w0 = rows(lg, off);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (ls * U + u) * 32 + lane;
#pragma unroll
      for (int r = 0; r < R; ++r) b[r][u] = c < K8 ? ld_stream(w0 + off[r] + c, pol) : make_uint4(0, 0, 0, 0);
    }
    if (++ls == stages) ls = 0, lg += warps;
  };
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  int mg = warp, ms = 0;  // the next item to multiply
  // A group's sums, reduced across the warp, written and cleared.
  auto finish = [&] {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
    const int row0 = PAIR ? mg : mg * R;
    if constexpr (PAIR) {
      if (lane == 0) static_cast<T*>(a.out)[row0] = from_f<T>(activate(acc[0], a.act) * acc[1]);  // as gated_act
    } else {
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
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  };
  auto mul = [&](const uint4(&b)[R][U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = (ms * U + u) * 32 + lane;
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
    if (++ms == stages) {
      finish();
      ms = 0, mg += warps;
    }
  };

  // Two items of weights in flight before the wait and while x is staged.
  if (items > 0) load(b0);
  if (items > 1) load(b1);
  pdl_wait();  // the previous kernel's results are visible from here on
  pdl_trigger();
  stage_x<T, MODE>(a, xs);
  __syncthreads();
  for (int j = 0; j < items; j += 2) {
    mul(b0);
    if (j + 2 < items) load(b0);
    if (j + 1 >= items) break;
    mul(b1);
    if (j + 3 < items) load(b1);
  }
}

// Blocks of gemv_kernel<T, R, MODE> with x[K] staged that one multiprocessor holds at once, on
// the current device, times its multiprocessors (asked once per device and K). The first call on
// a device also lets the kernel stage x past the default 48 KiB of shared memory.
template <class T, int R, int MODE>
int resident_blocks(int K) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, int> known;  // (device, K) → blocks; (device, 0): room made
  int dev = 0;
  KV_CUDA(cudaGetDevice(&dev), "gemv: the current device");
  std::lock_guard<std::mutex> lock(mu);
  if (!known.count({dev, 0})) {
    KV_CUDA(cudaFuncSetAttribute(gemv_kernel<T, R, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(kGemvMaxK * sizeof(T))),
            "gemv_kernel: shared memory for x of " + std::to_string(kGemvMaxK) + " values");
    known[{dev, 0}] = 0;
  }
  auto it = known.find({dev, K});
  if (it != known.end()) return it->second;
  int per_sm = 0, sms = 0;
  KV_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_kernel<T, R, MODE>, kThreads,
                                                        static_cast<size_t>(K) * sizeof(T)),
          "gemv_kernel occupancy");
  KV_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "gemv: multiprocessors");
  return known[{dev, K}] = std::max(1, per_sm * sms);
}

template <class T, int R, int MODE>
void launch(const Args& a, int max_blocks, bool pdl, cudaStream_t s) {
  const int groups = MODE == kNormPair ? a.N : (a.N + R - 1) / R;
  const size_t smem = static_cast<size_t>(a.K) * sizeof(T);
  int blocks = (groups + kWarps - 1) / kWarps;
  if (max_blocks == kGemvResident || smem > kDefaultSmem) {
    const int resident = resident_blocks<T, R, MODE>(a.K);
    if (max_blocks == kGemvResident) blocks = std::min(blocks, resident);
  }
  if (max_blocks > 0) blocks = std::min(blocks, max_blocks);
  KV_CUDA(launch_dependent(gemv_kernel<T, R, MODE>, blocks, kThreads, smem, s, pdl, a),
          "gemv_kernel " + std::to_string(a.N) + "x" + std::to_string(a.K));
}

template <class T, int MODE>
void go(const GemvParams& p, const Args& a, cudaStream_t s) {
  // Rows a warp, as measured by `kvlens bench gemv` on an H100 at the decode step's sizes: at
  // K = 4096 one or two (4 or 2 KB of a row a warp and stage; blocks in several waves, each
  // starting as a slot frees) streamed fastest, within 5 % of each other over two runs
  // (2.5-3.07 TB/s, against 1.9-2.97 with eight); at K = 11008 (the down product) two beat one
  // by 12-15 % while its blocks staged SiLU(gate)·up from fp32, and since it reads that vector
  // as fp16 (the gate in the gate/up epilogue) the two are within 0.5 % (33.8 and 34.0 µs, 89.7
  // and 89.3 % of copy; four 38.5 µs, eight 45.0 µs), so two stays.
  if constexpr (MODE == kNormPair) {
    launch<T, 2, MODE>(a, p.max_blocks, p.pdl, s);
  } else {
    int R = p.rows_per_warp;
    if (R == 0) R = p.K > 8192 ? 2 : 1;
    switch (R) {
      case 1: return launch<T, 1, MODE>(a, p.max_blocks, p.pdl, s);
      case 2: return launch<T, 2, MODE>(a, p.max_blocks, p.pdl, s);
      case 4: return launch<T, 4, MODE>(a, p.max_blocks, p.pdl, s);
      case 8: return launch<T, 8, MODE>(a, p.max_blocks, p.pdl, s);
    }
    throw InternalError("gemv: rows_per_warp must be 0, 1, 2, 4 or 8, got " + std::to_string(R));
  }
}

}  // namespace

bool gemv_supported(Dt dt, int K) { return (dt == Dt::F16 || dt == Dt::BF16) && K > 0 && K % 8 == 0 && K <= kGemvMaxK; }

void gemv(const GemvParams& p, cudaStream_t s) {
  if (p.N == 0) return;
  if (!gemv_supported(p.dt, p.K))
    throw InternalError("gemv: needs f16/bf16 and K a multiple of 8 up to " + std::to_string(kGemvMaxK) + ", got " +
                        std::string(dt_name(p.dt)) + " K=" + std::to_string(p.K));
  if (!p.W) throw InternalError("gemv: no weights");
  if (p.max_blocks < kGemvResident)
    throw InternalError("gemv: max_blocks must be 0, kGemvResident or a block count, got " + std::to_string(p.max_blocks));
  if (!p.x == !p.h) throw InternalError("gemv: one input needed, x or h (with g), not both or neither");
  if (p.h && !p.g) throw InternalError("gemv: the norm input h needs its weight g");
  if (p.check && !p.h) throw InternalError("gemv: the finiteness check rides on the norm input (h) only");
  const int mode = p.h ? (p.out ? kNormPair : kNorm) : kPlain;
  if (p.out && !p.h) throw InternalError("gemv: the paired gate/up product (out) needs the norm input (h, g)");
  if (mode == kNormPair) {
    if (p.bias || p.accumulate || p.y)
      throw InternalError("gemv: the paired gate/up product writes act(gate)·up only (no bias, y or accumulate)");
    if (p.rows_per_warp != 0 && p.rows_per_warp != 2)
      throw InternalError("gemv: a paired warp owns a gate row and its up row (rows_per_warp 0 or 2), got " +
                          std::to_string(p.rows_per_warp));
    if (p.act < static_cast<int>(Act::Gelu) || p.act > static_cast<int>(Act::Relu))
      throw InternalError("gemv: act " + std::to_string(p.act) + " is no Act");
  } else if (!p.y) {
    throw InternalError("gemv: no output (y)");
  }
  const Args a{static_cast<const uint4*>(p.W), static_cast<const uint4*>(p.x), p.h, p.g, p.eps, p.act, p.bias,
               p.y, p.out, p.N, p.K, p.accumulate ? 1 : 0, p.check};
  auto by_mode = [&](auto t) {
    using T = decltype(t);
    if (mode == kNorm) go<T, kNorm>(p, a, s);
    else if (mode == kNormPair) go<T, kNormPair>(p, a, s);
    else go<T, kPlain>(p, a, s);
  };
  if (p.dt == Dt::F16) by_mode(__half{});
  else by_mode(__nv_bfloat16{});
}

}  // namespace kvlens::cuda
