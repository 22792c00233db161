#include "core/compress/quant_methods.h"
#include "core/compress/registry.h"

namespace kvlens {

std::vector<MethodSpec> quantization_methods() {
  return {full_method(),       uniform_method(),    kivi_method(),         calibquant_method(),
          zipcache_method(),   turboquant_method(), hadamard_int4_method()};
}

}  // namespace kvlens
