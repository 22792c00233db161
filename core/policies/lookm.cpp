// LOOK-M: text-prior eviction of the prompt KV cache, then merging of the evicted
// KV pairs into the kept ones.
//
// Eviction (Eq. 4–8): A_s = Σ_i A_p[i, :] over every prompt query (causal column sums of the
// prefill attention, a GQA group's query heads averaged); with the text prior,
// A_s[T] += T_p, T_p = max(A_s), for the text tokens T (every non-visual prompt token). Each
// KV head keeps the recent window of M = floor(α1·T) tokens and the top N = floor(α2·T) of the
// rest by A_s, so S = N + M rows (at least 1).
//
// Merging (Eq. 9–12): each evicted key goes to its most cosine-similar kept key; the same
// assignment (and, for weighted merging, the same similarities) is used for the values. The
// three rules are implemented as printed, see lookm_merge in evict_methods.h. As printed,
// pivotal merging is k_c ← (k_c + ½ Σ (k_e + k_c)) / (L+1) (the kept key is the "closest" of
// each of its evicted keys), and weighted merging keeps the 1/(L+1) normalisation, so its
// weights s_ec do not sum to one; the authors' code computes the same two formulas
// (a scatter mean including the kept row).
//
// Interpretations (kvlens):
// - Eq. 8 says I is "the union of textual token indices T and the Top N tokens" while the
//   cache size is S = N + M. `text_keep=budget` (default, "paper" preset) reads the prior as a
//   ranking inside N: text tokens outrank every visual token, so all text is kept when N (plus
//   the window) has room. `text_keep=all` ("official" preset) keeps every text token on top of
//   the budget, as the authors' text-prior code does (it only ever evicts image tokens).
// - The authors' weighted/average code also merges only evicted tokens whose best similarity is
//   above the mean; the paper does not mention it and kvlens merges every evicted token.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include "core/errors.h"
#include "core/policies/evict_methods.h"
#include "core/policies/select.h"

namespace kvlens {

namespace {

// lookm_merge, also giving in count[c] (n entries) how many evicted rows row c absorbed.
void merge_counted(MergeKind kind, int d, const std::vector<int>& keep, std::vector<float>& k,
                   std::vector<float>& v, std::vector<int>& count) {
  count.clear();
  if (kind == MergeKind::None) return;
  if (d < 1 || k.size() % d != 0 || v.size() != k.size())
    throw InternalError("lookm_merge: k/v are not [n][d]");
  const int n = static_cast<int>(k.size() / d);
  std::vector<char> kept(n, 0);
  for (int c : keep) {
    if (c < 0 || c >= n) throw InternalError("lookm_merge: kept index out of range");
    kept[c] = 1;
  }
  if (keep.empty()) return;
  std::vector<double> norm(n, 0.0);
  for (int i = 0; i < n; ++i) {
    double s = 0.0;
    for (int t = 0; t < d; ++t) s += static_cast<double>(k[i * d + t]) * k[i * d + t];
    norm[i] = std::sqrt(s);
  }
  auto cosine = [&](int a, int b) {
    if (norm[a] == 0.0 || norm[b] == 0.0) return 0.0;
    double s = 0.0;
    for (int t = 0; t < d; ++t) s += static_cast<double>(k[a * d + t]) * k[b * d + t];
    return s / (norm[a] * norm[b]);
  };
  // Accumulate Σ over each kept row's evicted set, against the original kept values.
  std::vector<double> acc_k(static_cast<size_t>(n) * d, 0.0), acc_v(acc_k.size(), 0.0);
  count.assign(n, 0);
  for (int e = 0; e < n; ++e) {
    if (kept[e]) continue;
    int best = keep[0];
    double best_s = cosine(e, best);
    for (size_t j = 1; j < keep.size(); ++j) {
      const double s = cosine(e, keep[j]);
      if (s > best_s) {
        best_s = s;
        best = keep[j];
      }
    }
    ++count[best];
    for (int t = 0; t < d; ++t) {
      const double ke = k[e * d + t], ve = v[e * d + t];
      const double kc = k[best * d + t], vc = v[best * d + t];
      double* ak = &acc_k[static_cast<size_t>(best) * d + t];
      double* av = &acc_v[static_cast<size_t>(best) * d + t];
      switch (kind) {
        case MergeKind::Average: *ak += ke; *av += ve; break;
        case MergeKind::Pivotal: *ak += 0.5 * (ke + kc); *av += 0.5 * (ve + vc); break;
        case MergeKind::Weighted: *ak += best_s * ke; *av += best_s * ve; break;
        case MergeKind::None: break;
      }
    }
  }
  for (int c : keep) {
    if (count[c] == 0) continue;  // nothing merged: the row stays an exact copy
    const double w = 1.0 / (count[c] + 1);
    for (int t = 0; t < d; ++t) {
      const size_t i = static_cast<size_t>(c) * d + t;
      k[i] = static_cast<float>((k[i] + acc_k[i]) * w);
      v[i] = static_cast<float>((v[i] + acc_v[i]) * w);
    }
  }
}

}  // namespace

void lookm_merge(MergeKind kind, int d, const std::vector<int>& keep, std::vector<float>& k,
                 std::vector<float>& v) {
  std::vector<int> count;
  merge_counted(kind, d, keep, k, v, count);
}

namespace {

bool is_text(SegmentKind s) { return s == SegmentKind::System || s == SegmentKind::PostVisionText; }

MergeKind parse_merge(const std::string& s) {
  if (s == "none") return MergeKind::None;
  if (s == "average") return MergeKind::Average;
  if (s == "weighted") return MergeKind::Weighted;
  if (s == "pivotal") return MergeKind::Pivotal;
  throw InputError("lookm: merge must be one of none, average, pivotal, weighted; got '" + s + "'");
}

class LookMPolicy : public ScoreEvictPolicy {
 public:
  LookMPolicy(double alpha1, double alpha2, bool text_prior, bool keep_all_text, MergeKind merge)
      : ScoreEvictPolicy("lookm"), alpha1_(alpha1), alpha2_(alpha2), text_prior_(text_prior),
        keep_all_text_(keep_all_text), merge_(merge) {}

 protected:
  std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const override {
    std::vector<LayerPlan> plans;
    for (const PrefillContext& c : layers) {
      const int T = c.prompt_len;
      const int M = static_cast<int>(std::floor(alpha1_ * T + 1e-6));
      const int N = static_cast<int>(std::floor(alpha2_ * T + 1e-6));
      plans.push_back(make_plan(std::max(M + N, 1), M, T));
    }
    return plans;
  }

  std::vector<double> score(const PrefillContext& c, int kv_head) const override {
    std::vector<double> s = column_sums(c, kv_head, 0, c.prompt_len);
    if (text_prior_) {
      const double tp = *std::max_element(s.begin(), s.end());
      for (int j = 0; j < c.prompt_len; ++j)
        if (is_text((*c.token_kinds)[j])) s[j] += tp;
    }
    return s;
  }

  std::vector<int> select(const PrefillContext& c, int kv_head, const LayerPlan& plan,
                          const std::vector<double>& score) const override {
    std::vector<int> keep = select_recent_topk(score, plan);
    if (!keep_all_text_) return keep;
    std::vector<char> mask(c.prompt_len, 0);
    for (int i : keep) mask[i] = 1;
    for (int j = 0; j < c.prompt_len; ++j)
      if (is_text((*c.token_kinds)[j])) mask[j] = 1;
    keep.clear();
    for (int j = 0; j < c.prompt_len; ++j)
      if (mask[j]) keep.push_back(j);
    return keep;
  }

  bool merges() const override { return merge_ != MergeKind::None; }
  // Merges, and remembers for each kept row (in order) how many evicted rows it absorbed; the
  // counts go into HeadRows::merged once the base class has kept the rows (record_merged).
  // Called for several KV heads at once.
  void merge(const PrefillContext& c, int kv_head, const std::vector<int>& keep,
             std::vector<float>& k, std::vector<float>& v) const override {
    std::vector<int> count;
    merge_counted(merge_, c.head_dim, keep, k, v, count);
    std::vector<int> per_kept(keep.size(), 0);
    if (!count.empty())
      for (size_t j = 0; j < keep.size(); ++j) per_kept[j] = count[static_cast<size_t>(keep[j])];
    std::lock_guard<std::mutex> lock(mu_);
    counts_[{c.layer, kv_head}] = std::move(per_kept);
  }

 public:
  void on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) override {
    clear_counts();
    ScoreEvictPolicy::on_prefill(layers, store);
    for (const PrefillContext& c : layers) record_merged(c.layer, store.layer(c.layer));
    clear_counts();
  }
  void on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) override {
    clear_counts();
    ScoreEvictPolicy::on_prefill_layer(ctx, layer);
    record_merged(ctx.layer, layer);
    clear_counts();
  }

 private:
  void clear_counts() {
    std::lock_guard<std::mutex> lock(mu_);
    counts_.clear();
  }
  // Adds each kept row's merge count onto HeadRows::merged (rows are in the order kept).
  void record_merged(int layer_index, LayerKV& layer) {
    if (merge_ == MergeKind::None || layer.segments.empty()) return;
    const int H = static_cast<int>(layer.segments.front().heads.size());
    for (int h = 0; h < H; ++h) {
      auto it = counts_.find({layer_index, h});
      if (it == counts_.end())
        throw InternalError("lookm: no merge counts for layer " + std::to_string(layer_index) +
                            " KV head " + std::to_string(h));
      const std::vector<int>& kc = it->second;
      size_t j = 0;
      for (KVSegment& s : layer.segments) {
        HeadRows& r = s.heads.at(h);
        if (r.merged.size() < static_cast<size_t>(r.n())) r.merged.resize(r.n(), 0);
        for (int i = 0; i < r.n(); ++i, ++j) {
          if (j >= kc.size()) throw InternalError("lookm: more kept rows than merge counts");
          r.merged[i] = static_cast<uint16_t>(std::min<int>(65535, r.merged[i] + kc[j]));
        }
      }
      if (j != kc.size()) throw InternalError("lookm: fewer kept rows than merge counts");
    }
  }

  mutable std::mutex mu_;
  mutable std::map<std::pair<int, int>, std::vector<int>> counts_;  // (layer, KV head) → per kept row

  double alpha1_, alpha2_;
  bool text_prior_, keep_all_text_;
  MergeKind merge_;
};

}  // namespace

MethodSpec lookm_method() {
  MethodSpec m;
  m.name = "lookm";
  m.family = "merge";
  m.summary = "LOOK-M: text-prior eviction + merging evicted KV pairs into the kept ones";
  m.params = {
      {"alpha1", ParamSpec::Type::Float, 0.0, 1.0, {}, "0.1",
       "recent ratio: keep the last M = floor(alpha1*T) tokens"},
      {"alpha2", ParamSpec::Type::Float, 0.0, 1.0, {}, "0.1",
       "important ratio: keep the top N = floor(alpha2*T) of the rest by A_s = sum_i A_p[i,:] (Eq. 4, 8)"},
      {"text_prior", ParamSpec::Type::Bool, 0, 0, {}, "true",
       "A_s[T] += max(A_s) on every text (non-visual) token (Eq. 5)"},
      {"text_keep", ParamSpec::Type::Choice, 0, 0, {"budget", "all"}, "budget",
       "budget: text outranks visual inside N (S = N + M); all: every text token kept beyond "
       "the budget (I = T u Top_N, authors' code)"},
      {"merge", ParamSpec::Type::Choice, 0, 0, {"none", "average", "pivotal", "weighted"}, "pivotal",
       "evicted -> most cosine-similar kept key: average k_c=(k_c+sum k_e)/(L+1) (Eq. 10); pivotal "
       "k_c=(k_c+1/2 sum(k_e+k_c))/(L+1) (Eq. 11); weighted k_c=(k_c+sum s*k_e)/(L+1) (Eq. 12)"},
  };
  m.presets = {{"paper", {{"text_keep", "budget"}}}, {"official", {{"text_keep", "all"}}}};
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    return std::make_unique<LookMPolicy>(p.num("alpha1"), p.num("alpha2"), p.flag("text_prior"),
                                         p.str("text_keep") == "all", parse_merge(p.str("merge")));
  };
  return m;
}

}  // namespace kvlens
