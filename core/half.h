// IEEE binary16 (fp16) conversion on the CPU, round to nearest even. The KV store keeps dense
// rows as half-rounded floats (RowStorage::Fp16) and the quantizers store scales as fp16.
#pragma once
#include <cstdint>

namespace kvlens {

uint16_t to_half(float x);
float from_half(uint16_t h);
inline float round_half(float x) { return from_half(to_half(x)); }
// x[i] = round_half(x[i]) for i < n, with the CPU's own fp16 conversions where it has them (F16C:
// the same values, round to nearest even; a NaN stays a NaN, its payload may differ).
void round_half_n(float* x, int64_t n);
// out[i] = to_half(in[i]) for i < n (F16C where the CPU has it: the same bits, a NaN's payload aside).
void to_half_n(const float* in, uint16_t* out, int64_t n);
// out[i] = from_half(in[i]) for i < n (F16C where the CPU has it, else a table of every half).
void from_half_n(const uint16_t* in, float* out, int64_t n);

}  // namespace kvlens
