// H2O (Zhang et al.): heavy hitters by accumulated attention plus a recent window.
// Each layer keeps floor(budget · T) rows per KV head: the last floor(recent_ratio · kept)
// tokens and the top of the rest by ψ_j = Σ_i A_ij over every prompt query i (causal column
// sums of the prefill attention, a GQA group's query heads averaged).
//
// H2O splits its cache evenly between heavy hitters and recent tokens (recent_ratio 0.5);
// VL-Cache's comparison fixes every method's recent window at 10 % of the budget (preset
// "vlcache_eval").
#include <cmath>
#include <memory>

#include "core/compress/evict_methods.h"
#include "core/compress/select.h"

namespace kvlens {

namespace {

class H2OPolicy : public ScoreEvictPolicy {
 public:
  H2OPolicy(double budget, double recent_ratio)
      : ScoreEvictPolicy("h2o"), budget_(budget), recent_ratio_(recent_ratio) {}

 protected:
  std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const override {
    std::vector<LayerPlan> plans;
    for (const PrefillContext& c : layers) {
      const int keep = budget_rows(budget_, c.prompt_len);
      const int recent = static_cast<int>(std::floor(recent_ratio_ * keep + 1e-6));
      plans.push_back(make_plan(keep, recent, c.prompt_len));
    }
    return plans;
  }

  std::vector<double> score(const PrefillContext& c, int kv_head) const override {
    return column_sums(c, kv_head, 0, c.prompt_len);
  }
  std::pair<int, int> scored_rows(const PrefillContext& c) const override { return {0, c.prompt_len}; }

 private:
  double budget_, recent_ratio_;
};

}  // namespace

MethodSpec h2o_method() {
  MethodSpec m = eviction_spec("h2o", "H2O: accumulated-attention heavy hitters + recent window",
      "each layer keeps floor(budget*T) rows per KV head",
      {
          {"recent_ratio", ParamSpec::Type::Float, 0.0, 1.0, {}, "0.5",
           "recent window = floor(recent_ratio*kept) last tokens; the rest top by psi_j = sum_i A_ij "
           "over all prompt queries"},
      });
  m.presets = {{"paper", {{"recent_ratio", "0.5"}}}, {"vlcache_eval", {{"recent_ratio", "0.1"}}}};
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<H2OPolicy>(p.num("budget"), p.num("recent_ratio"));
  };
  return m;
}

}  // namespace kvlens
