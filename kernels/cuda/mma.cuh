// Tensor-core pieces shared by the prefill attention kernel (attention.cu) and the GQA decode
// kernel (decode/decode_gqa.cuh): ldmatrix loads of fp16 fragments from shared memory, the
// m16n8k16 fp16 product with fp32 accumulators, exp2 on the special-function unit, and two floats
// as an f16x2 operand.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

namespace kvlens::cuda {

// Four 8×8 fp16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and r[i] holds
// (row lane/4, columns 2·(lane%4), +1) of matrix i — or with .trans (rows 2·(lane%4), +1, column
// lane/4).
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// c (16×8, fp32) += a (16×16, fp16, row-major) · b (16×8, fp16, column-major).
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// Two floats as an f16x2 register (lo in the low half: the lower column of a fragment pair).
__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace kvlens::cuda
