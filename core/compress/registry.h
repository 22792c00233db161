// The two halves of the method registry; methods() (core/compress/method.cpp) lists the quantization
// methods first, then the eviction / merge / composition methods.
#pragma once
#include <vector>

#include "core/compress/method.h"

namespace kvlens {

// full, uniform, kivi, calibquant, zipcache, turboquant, hadamard_int4 (core/compress/registry_quant.cpp)
std::vector<MethodSpec> quantization_methods();
// The eviction, merge and composition methods (core/compress/registry_evict.cpp)
std::vector<MethodSpec> eviction_methods();

}  // namespace kvlens
