// PyramidKV (Cai et al.): budgets that shrink linearly with depth (attention funnels from broad
// in shallow layers to focused in deep ones), with SnapKV's selection inside each layer.
// With mean budget α and the PyramidKV code's β: the last layer keeps α/β of the prompt, the
// first 2α − α/β, the layers between on the straight line (first/last = 2β − 1; β = 1 is
// uniform). If the first layer's share would exceed 1 it becomes 1 and the last 2α − 1, which
// keeps the mean at α (the code's cap at the prompt length does the same).
//
// Interpretation (kvlens): the schedule is applied to the whole per-layer budget as a fraction
// of the prompt, window included (the PyramidKV code shares out the budget minus a fixed window);
// the selection is snapkv_scores with the same window/kernel/pooling parameters as snapkv.
#include <algorithm>
#include <cmath>
#include <memory>

#include "core/errors.h"
#include "core/compress/evict_methods.h"
#include "core/compress/select.h"

namespace kvlens {

std::vector<double> pyramid_budgets(int n_layers, double alpha, double beta) {
  if (n_layers < 1) throw InputError("pyramidkv: needs at least one layer");
  if (!(beta >= 1.0)) throw InputError("pyramidkv: beta must be >= 1, got " + std::to_string(beta));
  if (n_layers == 1) return {alpha};
  double last = alpha / beta;
  double first = 2.0 * alpha - last;
  if (first > 1.0) {
    first = 1.0;
    last = 2.0 * alpha - 1.0;
  }
  std::vector<double> out(n_layers);
  for (int l = 0; l < n_layers; ++l)
    out[l] = first + (last - first) * static_cast<double>(l) / (n_layers - 1);
  return out;
}

namespace {

class PyramidKVPolicy : public ScoreEvictPolicy {
 public:
  PyramidKVPolicy(double alpha, double beta, int window, int kernel, Pooling pooling)
      : ScoreEvictPolicy("pyramidkv"), alpha_(alpha), beta_(beta), window_(window),
        kernel_(kernel), pooling_(pooling) {
    if (kernel % 2 == 0)
      throw InputError("pyramidkv: kernel must be odd (same padding), got " + std::to_string(kernel));
  }

 protected:
  std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const override {
    std::vector<LayerPlan> plans;
    for (size_t i = 0; i < layers.size(); ++i) {
      const PrefillContext& c = layers[i];
      const int L = c.n_layers > 0 ? c.n_layers : static_cast<int>(layers.size());
      const int l = c.n_layers > 0 ? c.layer : static_cast<int>(i);
      if (l < 0 || l >= L)
        throw InputError("pyramidkv: layer " + std::to_string(l) + " outside [0, " +
                         std::to_string(L) + ")");
      const double frac = std::clamp(pyramid_budgets(L, alpha_, beta_)[l], 0.0, 1.0);
      const int keep = budget_rows(frac, c.prompt_len);
      plans.push_back(make_plan(keep, std::min(window_, keep), c.prompt_len));
    }
    return plans;
  }

  std::vector<double> score(const PrefillContext& c, int kv_head) const override {
    return snapkv_scores(c, kv_head, window_, kernel_, pooling_);
  }
  std::pair<int, int> scored_rows(const PrefillContext& c) const override { return snapkv_rows(c, window_); }

 private:
  double alpha_, beta_;
  int window_, kernel_;
  Pooling pooling_;
};

}  // namespace

MethodSpec pyramidkv_method() {
  MethodSpec m = eviction_spec("pyramidkv", "PyramidKV: layer budgets decreasing linearly with depth, SnapKV selection",
      "mean budget alpha over layers; layer l keeps floor(beta_l*T) rows per KV head",
      {
          {"beta", ParamSpec::Type::Float, 1.0, 1000.0, {}, "20",
           "last layer alpha/beta, first 2*alpha - alpha/beta, linear between (first/last = 2*beta-1)"},
      });
  for (ParamSpec& p : snapkv_selection_params()) m.params.push_back(std::move(p));
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<PyramidKVPolicy>(
        p.num("budget"), p.num("beta"), p.integer("window"), p.integer("kernel"),
        parse_pooling(p.str("pooling")));
  };
  return m;
}

}  // namespace kvlens
