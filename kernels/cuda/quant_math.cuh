// The arithmetic of uniform quantization on the device, step by step as the host's
// quant::make_affine and quant::encode (core/compress/quantize.cpp): shared by the quantize-and-
// pack kernels (quant_pack.cu) and the decode step's per-token quantizing append (kv_kernels.cu),
// so both give the host's codes and fp16 ranges; and quant::block_hadamard's rotation.
#pragma once
#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace kvlens::cuda {

// The range [lo, hi] (shrunk by `shrink` about zero or its centre first) as fp16 zero = half(lo)
// and scale = half((hi − lo)/(2^b − 1)), 0 for an empty range.
__device__ __forceinline__ void affine(float lo, float hi, int bits, float shrink, bool about_zero, __half* scale,
                                       __half* zero) {
  if (shrink != 1.0f) {
    const float c = about_zero ? 0.0f : 0.5f * (lo + hi);
    lo = fmaf(shrink, lo - c, c);
    hi = fmaf(shrink, hi - c, c);
  }
  const float L = static_cast<float>((1u << bits) - 1u);
  *zero = __float2half_rn(lo);
  *scale = hi > lo ? __float2half_rn(__fdiv_rn(hi - lo, L)) : __float2half_rn(0.0f);
}

// code = clamp(rint((x − α)/scale), 0, 2^b − 1); 0 when the scale is 0.
__device__ __forceinline__ uint32_t encode(float x, float alpha, float scale, int bits) {
  if (!(scale > 0.0f)) return 0;
  const float c = rintf(__fdiv_rn(x - alpha, scale));
  return static_cast<uint32_t>(fminf(fmaxf(c, 0.0f), static_cast<float>((1u << bits) - 1u)));
}

// 8 codes of `bits` bits (code c at bits [c·bits, (c+1)·bits) of w) into `bits` bytes at out,
// least significant first: the host's packing.
__device__ __forceinline__ void put_codes8(uint8_t* out, uint64_t w, int bits) {
  for (int b = 0; b < bits; ++b) out[b] = static_cast<uint8_t>(w >> (8 * b));
}

// One warp quantizes the fp32 row x[D] with its own range (quant::quantize_block, Axis::PerToken):
// the range taken by the warp, the fp16 scale and zero written by lane 0, the codes at out.
__device__ inline void quantize_row_warp(const float* x, int D, int bits, int lane, __half* scale, __half* zero,
                                         uint8_t* out) {
  float lo = INFINITY, hi = -INFINITY;
  for (int c = lane; c < D; c += 32) {
    lo = fminf(lo, x[c]);
    hi = fmaxf(hi, x[c]);
  }
  lo = -warp_max(-lo);
  hi = warp_max(hi);
  __half s, z;
  affine(lo, hi, bits, 1.0f, true, &s, &z);
  if (lane == 0) {
    *scale = s;
    *zero = z;
  }
  const float a = __half2float(z), sc = __half2float(s);
  for (int c8 = lane; c8 < D / 8; c8 += 32) {
    uint64_t w = 0;
    for (int c = 0; c < 8; ++c) w |= static_cast<uint64_t>(encode(x[c8 * 8 + c], a, sc, bits)) << (c * bits);
    put_codes8(out + c8 * bits, w, bits);
  }
}

// Each block of R values of x[D] (shared memory) through the orthonormal Hadamard transform, with
// quant::hadamard's fp32 operations: butterflies of increasing span (a + c on the lower value,
// a − c on the upper), then the scale 1/√R. A span's D/2 butterflies are independent, so the
// block's threads share them, a barrier between spans; each value goes through the same
// operations in the same order as one thread walking the block would take it, so the results are
// the host's bit for bit. Every thread of the block calls it, after writing x.
__device__ inline void hadamard_blocks(float* x, int D, int R) {
  for (int len = 1; len < R; len <<= 1) {
    __syncthreads();
    for (int t = threadIdx.x; t < D / 2; t += blockDim.x) {
      const int j = (t / len) * 2 * len + t % len;  // the lower value of butterfly t at this span
      const float a = x[j], c = x[j + len];
      x[j] = a + c;
      x[j + len] = a - c;
    }
  }
  __syncthreads();
  const float s = 1.0f / sqrtf(static_cast<float>(R));
  for (int i = threadIdx.x; i < D; i += blockDim.x) x[i] *= s;
}

// Row r[D] through hadamard_blocks in place, the block's threads together: staged in `row`
// (shared memory, D floats) after every thread's earlier writes to r.
__device__ inline void hadamard_in_place(float* r, float* row, int D, int R) {
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) row[c] = r[c];
  hadamard_blocks(row, D, R);
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) r[c] = row[c];
}

}  // namespace kvlens::cuda
