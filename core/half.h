// IEEE binary16 (fp16) conversion on the CPU, round to nearest even. The KV store keeps dense
// rows as half-rounded floats (RowStorage::Fp16) and the quantizers store scales as fp16.
#pragma once
#include <cstdint>

namespace kvlens {

uint16_t to_half(float x);
float from_half(uint16_t h);
inline float round_half(float x) { return from_half(to_half(x)); }

}  // namespace kvlens
