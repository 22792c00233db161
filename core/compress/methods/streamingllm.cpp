// StreamingLLM (Xiao et al.): the first `sinks` tokens (attention sinks) plus the most recent
// tokens. Each layer keeps floor(budget · T) rows per KV head: min(sinks, kept) sink tokens and
// the last (kept − sinks) tokens. Needs no attention.
#include <algorithm>
#include <memory>

#include "core/compress/evict_methods.h"
#include "core/compress/select.h"

namespace kvlens {

namespace {

class StreamingLLMPolicy : public ScoreEvictPolicy {
 public:
  StreamingLLMPolicy(double budget, int sinks)
      : ScoreEvictPolicy("streamingllm"), budget_(budget), sinks_(sinks) {}
  bool needs_prefill_attention() const override { return false; }

 protected:
  std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const override {
    std::vector<LayerPlan> plans;
    for (const PrefillContext& c : layers) {
      const int keep = budget_rows(budget_, c.prompt_len);
      plans.push_back(make_plan(keep, keep - std::min(sinks_, keep), c.prompt_len));
    }
    return plans;
  }

  // Sinks score 1, every other token 0: the top-k outside the window are the sinks.
  std::vector<double> score(const PrefillContext& c, int kv_head) const override {
    std::vector<double> s(c.prompt_len, 0.0);
    for (int i = 0; i < std::min(sinks_, c.prompt_len); ++i) s[i] = 1.0;
    return s;
  }

 private:
  double budget_;
  int sinks_;
};

}  // namespace

MethodSpec streamingllm_method() {
  MethodSpec m = eviction_spec("streamingllm", "StreamingLLM: attention-sink tokens + recent window",
      "each layer keeps floor(budget*T) rows per KV head: sinks + the most recent tokens",
      {
          {"sinks", ParamSpec::Type::Int, 0, 1024, {}, "4",
           "initial tokens always kept (attention sinks); recent window = kept - sinks"},
      });
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<StreamingLLMPolicy>(p.num("budget"), p.integer("sinks"));
  };
  return m;
}

}  // namespace kvlens
