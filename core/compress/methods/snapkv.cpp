// SnapKV (Li et al.): the last `window` prompt queries (the observation window) vote for the
// earlier keys, votes are pooled over neighbouring keys so clusters survive together, and each
// KV head keeps its top keys plus the window itself.
//   votes_j = Σ_{i ∈ window} A_ij  (a GQA group's query heads averaged), j < T − window
//   score_j = pool_{|j'−j| ≤ kernel/2} votes_j'   (stride 1, same padding; max by default)
// Each layer keeps floor(budget · T) rows per KV head: the window (or its last `kept` tokens
// when the budget is smaller) and the top of the earlier tokens by pooled score.
// Defaults follow SnapKV's released configuration (window 32, kernel 7, max pooling).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "core/errors.h"
#include "core/compress/evict_methods.h"
#include "core/compress/select.h"

namespace kvlens {

std::vector<double> snapkv_scores(const PrefillContext& c, int kv_head, int window, int kernel,
                                  Pooling pooling) {
  if (kernel < 1 || kernel % 2 == 0)
    throw InputError("snapkv: kernel must be a positive odd number, got " + std::to_string(kernel));
  if (window < 1) throw InputError("snapkv: window must be at least 1, got " + std::to_string(window));
  const int T = c.prompt_len;
  const int prefix = snapkv_rows(c, window).first;
  const std::vector<double> votes = column_sums(c, kv_head, prefix, T);
  std::vector<double> out(T, std::numeric_limits<double>::infinity());
  const int half = kernel / 2;
  for (int j = 0; j < prefix; ++j) {
    const int lo = std::max(0, j - half), hi = std::min(prefix - 1, j + half);
    double acc = pooling == Pooling::Max ? -std::numeric_limits<double>::infinity() : 0.0;
    for (int t = lo; t <= hi; ++t)
      acc = pooling == Pooling::Max ? std::max(acc, votes[t]) : acc + votes[t];
    out[j] = pooling == Pooling::Max ? acc : acc / kernel;
  }
  return out;
}

std::pair<int, int> snapkv_rows(const PrefillContext& c, int window) {
  return {c.prompt_len - std::min(window, c.prompt_len), c.prompt_len};
}

namespace {


class SnapKVPolicy : public ScoreEvictPolicy {
 public:
  SnapKVPolicy(double budget, int window, int kernel, Pooling pooling)
      : ScoreEvictPolicy("snapkv"), budget_(budget), window_(window), kernel_(kernel),
        pooling_(pooling) {
    if (kernel % 2 == 0)
      throw InputError("snapkv: kernel must be odd (same padding), got " + std::to_string(kernel));
  }

 protected:
  std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const override {
    std::vector<LayerPlan> plans;
    for (const PrefillContext& c : layers) {
      const int keep = budget_rows(budget_, c.prompt_len);
      plans.push_back(make_plan(keep, std::min(window_, keep), c.prompt_len));
    }
    return plans;
  }

  std::vector<double> score(const PrefillContext& c, int kv_head) const override {
    return snapkv_scores(c, kv_head, window_, kernel_, pooling_);
  }
  std::pair<int, int> scored_rows(const PrefillContext& c) const override { return snapkv_rows(c, window_); }

 private:
  double budget_;
  int window_, kernel_;
  Pooling pooling_;
};

}  // namespace

Pooling parse_pooling(const std::string& s) { return s == "avg" ? Pooling::Avg : Pooling::Max; }

std::vector<ParamSpec> snapkv_selection_params() {
  return {
      {"window", ParamSpec::Type::Int, 1, 4096, {}, "32",
       "observation window: the last `window` prompt queries vote, votes_j = sum_i A_ij; always kept"},
      {"kernel", ParamSpec::Type::Int, 1, 63, {}, "7",
       "pooling kernel over keys (odd, stride 1, same padding): score_j = pool(votes)[j]"},
      {"pooling", ParamSpec::Type::Choice, 0, 0, {"max", "avg"}, "max",
       "max: max over the kernel; avg: sum over the kernel / kernel (padding counts as 0)"},
  };
}

MethodSpec snapkv_method() {
  MethodSpec m = eviction_spec("snapkv", "SnapKV: observation-window votes pooled over keys + the window",
      "each layer keeps floor(budget*T) rows per KV head, the observation window included", {});
  for (ParamSpec& p : snapkv_selection_params()) m.params.push_back(std::move(p));
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<SnapKVPolicy>(p.num("budget"), p.integer("window"), p.integer("kernel"),
                                          parse_pooling(p.str("pooling")));
  };
  return m;
}

}  // namespace kvlens
