// The two halves of the method registry; methods() (core/method.cpp) lists the quantization
// methods first, then the eviction / merge / composition methods.
#pragma once
#include <vector>

#include "core/method.h"

namespace kvlens {

// full, uniform, kivi, calibquant, zipcache, turboquant, hadamard_int4 (core/policies/registry_quant.cpp)
std::vector<MethodSpec> quantization_methods();
// The eviction, merge and composition methods (core/policies/registry_evict.cpp)
std::vector<MethodSpec> eviction_methods();

}  // namespace kvlens
