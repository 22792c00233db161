#include "core/policies/evict_methods.h"
#include "core/policies/registry.h"

namespace kvlens {

std::vector<MethodSpec> plain_eviction_methods() {
  return {vlcache_method(), lookm_method(),        h2o_method(),
          snapkv_method(),  streamingllm_method(), pyramidkv_method()};
}

std::vector<MethodSpec> eviction_methods() {
  std::vector<MethodSpec> all = plain_eviction_methods();
  all.push_back(stack_method());
  return all;
}

}  // namespace kvlens
