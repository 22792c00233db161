// VL-Cache (Tu et al.): sparsity-aware layer budgets and modality-aware (post-vision) token
// scores, both from the post-vision attention A' = the prompt rows of the language tokens that
// follow the last visual token (τ of them).
//
// - ThresholdFilter(A', p) zeroes A'_ij < p · max_j A'_ij; γ(l) is the share of zeros among the
//   unmasked post-vision entries (i ≥ m − τ, j ≤ i), averaged over the layer's query heads.
// - Algorithm 1: β(l) = clip((1 − γ(l)) / Z · α · L, 0.01, 1), Z = Σ_l (1 − γ(l)).
// - Layer l keeps floor(β(l) · T) rows per KV head: a recent window of recent_ratio of them
//   (10 %, the window the paper gives every method) and the top of the rest by
//   ψ_j = Σ_{i post-vision} A'_ij.
//
// Interpretations (kvlens): A' is taken from the model's causal prefill probabilities, i.e.
// softmax(QKᵀ/√d) as in §3.2 (Algorithm 1 line 17 prints /d). Scores are per KV head (a GQA
// group's query heads averaged), so heads may keep different tokens; γ(l) averages all query
// heads, as Algorithm 1 line 7 does. A prompt with no visual token uses every prompt query;
// one that ends with a visual token uses the last prompt query alone (τ = 1).
#include <algorithm>
#include <cmath>
#include <memory>

#include "core/errors.h"
#include "core/compress/evict_methods.h"
#include "core/compress/select.h"

namespace kvlens {

int post_vision_begin(const PrefillContext& c) {
  const int T = c.prompt_len;
  if (!c.token_kinds || static_cast<int>(c.token_kinds->size()) != T || T < 1)
    throw InputError("vlcache: layer " + std::to_string(c.layer) +
                     ": token kinds must have one entry per prompt token");
  int last_visual = -1;
  for (int i = 0; i < T; ++i)
    if ((*c.token_kinds)[i] == SegmentKind::Visual) last_visual = i;
  return std::min(last_visual + 1, T - 1);
}

namespace {

// Every query head's sparsity: entries below p · (row max), or 0 after ThresholdFilter, over the
// post-vision queries' causal entries, counted where the attention is (one reduction).
std::vector<double> post_vision_head_sparsities(const PrefillContext& c, double p) {
  if (!c.attention) throw InputError("vlcache: layer " + std::to_string(c.layer) + ": no prefill probabilities");
  const int T = c.prompt_len;
  std::vector<int64_t> below(static_cast<size_t>(c.n_heads));
  AttentionReduction r;
  r.queries = AttentionReduction::range(post_vision_begin(c), T, T);
  r.below = below.data();
  r.p = p;
  r.zeros_below = true;
  c.attention->reduce(c.layer, r);
  int64_t total = 0;
  for (int i : r.queries) total += i + 1;
  std::vector<double> g(below.size());
  for (size_t h = 0; h < below.size(); ++h) g[h] = static_cast<double>(below[h]) / static_cast<double>(total);
  return g;
}

}  // namespace

double post_vision_head_sparsity(const PrefillContext& c, int head, double p) {
  if (head < 0 || head >= c.n_heads) throw InputError("vlcache: no query head " + std::to_string(head));
  return post_vision_head_sparsities(c, p)[static_cast<size_t>(head)];
}

double post_vision_sparsity(const PrefillContext& c, double p) {
  double s = 0.0;
  for (double g : post_vision_head_sparsities(c, p)) s += g;  // (heads in order, as before)
  return s / c.n_heads;
}

std::vector<double> sparsity_budgets(const std::vector<double>& gamma, double alpha) {
  const double L = static_cast<double>(gamma.size());
  double Z = 0.0;
  for (double g : gamma) Z += 1.0 - g;
  std::vector<double> beta(gamma.size(), alpha);
  if (!(Z > 0.0)) return beta;  // cannot happen with real attention: each row's max survives
  for (size_t l = 0; l < gamma.size(); ++l)
    beta[l] = std::clamp((1.0 - gamma[l]) / Z * alpha * L, 0.01, 1.0);
  return beta;
}

namespace {

class VLCachePolicy : public ScoreEvictPolicy {
 public:
  VLCachePolicy(double alpha, double p, double recent_ratio, bool sparsity_mode)
      : ScoreEvictPolicy("vlcache"),
        alpha_(alpha), p_(p), recent_ratio_(recent_ratio), sparsity_mode_(sparsity_mode) {}

 protected:
  std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const override {
    std::vector<double> beta(layers.size(), alpha_);
    if (sparsity_mode_) {
      std::vector<double> gamma;
      // Every layer's counts (and the column sums score() reads) at once where the attention is.
      if (!layers.empty()) {
        std::vector<const PrefillContext*> cs;
        for (const PrefillContext& c : layers) cs.push_back(&c);
        prepare_layers(cs, scored_rows(layers.front()), p_, true);
      }
      for (const PrefillContext& c : layers) gamma.push_back(post_vision_sparsity(c, p_));
      beta = sparsity_budgets(gamma, alpha_);
    }
    std::vector<LayerPlan> plans;
    for (size_t l = 0; l < layers.size(); ++l) {
      const int T = layers[l].prompt_len;
      const int keep = budget_rows(beta[l], T);
      const int recent = static_cast<int>(std::floor(recent_ratio_ * keep + 1e-6));
      plans.push_back(make_plan(keep, recent, T));
    }
    return plans;
  }

  std::vector<double> score(const PrefillContext& c, int kv_head) const override {
    return column_sums(c, kv_head, post_vision_begin(c), c.prompt_len);
  }
  std::pair<int, int> scored_rows(const PrefillContext& c) const override {
    return {post_vision_begin(c), c.prompt_len};
  }

 private:
  double alpha_, p_, recent_ratio_;
  bool sparsity_mode_;
};

}  // namespace

MethodSpec vlcache_method() {
  MethodSpec m = eviction_spec("vlcache", "VL-Cache: sparsity-aware layer budgets + post-vision attention token scores",
      "overall budget alpha: layer l keeps floor(beta(l)*T) rows, "
      "beta(l) = clip((1-gamma(l))/Z*alpha*L, 0.01, 1), Z = sum_l (1-gamma(l)) (Algorithm 1)",
      {
          {"p", ParamSpec::Type::Float, 0.0, 1.0, {}, "0.01",
           "ThresholdFilter keeps A'_ij >= p*max_j A'_ij; gamma(l) = share of zeros among unmasked "
           "post-vision entries, mean over heads (Sec. 3.1; Algorithm 1 lines 5-7, p = 1%)"},
          {"recent_ratio", ParamSpec::Type::Float, 0.0, 1.0, {}, "0.1",
           "recent window = floor(recent_ratio*kept) last tokens (Sec. 5: 10% of the budget for every "
           "method); the rest top by psi_j = sum_{i post-vision} A'_ij (Sec. 3.2)"},
          {"budget_mode", ParamSpec::Type::Choice, 0, 0, {"sparsity", "uniform"}, "sparsity",
           "sparsity: beta(l) from Algorithm 1; uniform: beta(l) = alpha in every layer (the paper's ablation baseline)"},
      });
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<VLCachePolicy>(p.num("budget"), p.num("p"), p.num("recent_ratio"),
                                           p.str("budget_mode") == "sparsity");
  };
  return m;
}

}  // namespace kvlens
