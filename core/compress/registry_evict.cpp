#include "core/compress/evict_methods.h"
#include "core/compress/registry.h"
#include "core/compress/select.h"

namespace kvlens {

std::vector<MethodSpec> plain_eviction_methods() {
  return {vlcache_method(), lookm_method(),        h2o_method(),
          snapkv_method(),  streamingllm_method(), pyramidkv_method()};
}

MethodSpec eviction_spec(std::string name, std::string summary, const std::string& budget_help,
                         std::vector<ParamSpec> more) {
  MethodSpec m;
  m.name = std::move(name);
  m.family = "eviction";
  m.summary = std::move(summary);
  m.params = {param::real("budget", kMinBudget, 1.0, "0.1", budget_help)};
  for (ParamSpec& p : more) m.params.push_back(std::move(p));
  return m;
}

std::vector<MethodSpec> eviction_methods() {
  std::vector<MethodSpec> all = plain_eviction_methods();
  all.push_back(stack_method());
  return all;
}

}  // namespace kvlens
