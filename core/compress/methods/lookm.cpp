// LOOK-M: text-prior eviction of the prompt KV cache, then merging of the evicted
// KV pairs into the kept ones.
//
// Eviction (Eq. 4–8): A_s = Σ_i A_p[i, :] over every prompt query (causal column sums of the
// prefill attention, a GQA group's query heads averaged); with the text prior,
// A_s[T] += T_p, T_p = max(A_s), for the text tokens T (every non-visual prompt token). Each
// KV head keeps the recent window of M = floor(α1·T) tokens and the top N = floor(α2·T) of the
// rest by A_s, so S = N + M rows (at least 1).
//
// Merging (Eq. 9–12): each evicted key goes to its most cosine-similar kept key (ties to the
// earlier kept row); the same assignment (and, for weighted merging, the same similarities) is
// used for the values. As printed, pivotal merging is k_c ← (k_c + ½ Σ (k_e + k_c)) / (L+1)
// (the kept key is the "closest" of each of its evicted keys), and weighted merging keeps the
// 1/(L+1) normalisation, so its weights s_ec do not sum to one.
//
// The authors' code (SUSTechBruce/LOOK-M, LLaVA-mix_merge_v1/llava/model/kv_token_merge/
// modify_llama.py: TextPivotMerge_LayerWise, TextAVGMergeKVCache_LayerWise,
// TextWeightedMerge_LayerWise for LOOK-M, and the same without "Text" for the no-prior variants)
// differs from the equations as follows; each difference is a parameter, and `preset=official`
// sets the code's choice where it differs:
// - Text prior: the code adds −65516 to every image token's score (and to the recent window),
//   takes the top N of the rest, then keeps every token whose score is still ≥ 0: all text
//   tokens, even beyond N (I = T ∪ Top_N, Eq. 8's wording) → `text_keep=all`. The ranking is
//   the same as Eq. 5's (text above every image token). `text_keep=budget` (paper preset) reads
//   the prior as a ranking inside N (S = N + M).
// - Similarity filter: the average and weighted paths merge only the evicted rows whose best
//   cosine similarity, averaged over heads at the same evicted index j (the j-th evicted row of
//   each head), is ≥ the mean over all heads and evicted rows; the pivotal path merges every
//   evicted row → `merge_filter=code` (`above_mean` filters every merge kind, `all` none).
// - Average merge source rows: the code scatters the unfiltered evicted rows with the filtered
//   assignments (index and source of different lengths), so the f-th kept assignment receives the
//   f-th evicted row in order, not the row it was assigned → `average_source=prefix`. Identical
//   to `assigned` when the filter keeps everything.
// - Reduction: all three paths are a scatter mean that includes the kept row, i.e. Eq. 10–12 as
//   printed with L = the rows actually merged; kvlens computes the same.
// - Sink tokens: the no-prior classes force the first 4 prompt tokens into the top N (score
//   +inf); the text-prior classes do not (the first tokens are text) → `sinks` (0 in both presets).
// - Recent window and N: int(T·ratio), as Eq. 6–8 (floor); the text-prior code cannot run with
//   α1 = 0 (its [:, :-0] slice is empty), kvlens can.
// - Not modelled: the code computes in bf16 (ties and the filter's mean may fall differently),
//   sums A_p over the query heads of a KV head instead of averaging (the same ranking), and
//   finds image tokens as 576 positions after each <image> placeholder.
#include <algorithm>
#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <mutex>

#include "core/errors.h"
#include "core/compress/evict_methods.h"
#include "core/compress/select.h"

namespace kvlens {

namespace {

using Assignment = LookMAssignment;

void check_rows(int d, const std::vector<float>& k, const std::vector<float>& v) {
  if (d < 1 || k.size() % d != 0 || v.size() != k.size())
    throw InternalError("lookm_merge: k/v are not [n][d]");
}

// Eq. 9 for every evicted row (ascending), against the kept rows `keep` of k[n][d], on the host.
std::vector<Assignment> assign_evicted(int d, const std::vector<int>& keep, const std::vector<float>& k) {
  const int n = static_cast<int>(k.size() / d);
  std::vector<Assignment> out;
  if (keep.empty()) return out;
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
  std::vector<char> kept(n, 0);
  for (int c : keep) kept[c] = 1;
  for (int e = 0; e < n; ++e) {
    if (kept[e]) continue;
    Assignment a{e, keep[0], cosine(e, keep[0])};
    for (size_t j = 1; j < keep.size(); ++j) {
      const double s = cosine(e, keep[j]);
      if (s > a.s) a.s = s, a.c = keep[j];
    }
    out.push_back(a);
  }
  return out;
}

// lookm_assign_heads over the heads' kept rows and keys as given (no copy of either).
std::vector<std::vector<LookMAssignment>> assign_heads(int d, const std::vector<const std::vector<int>*>& keep,
                                                       const std::vector<const std::vector<float>*>& k, Backend* backend) {
  if (keep.size() != k.size()) throw InternalError("lookm_assign: kept rows and keys of different head counts");
  const size_t H = k.size();
  std::vector<const std::vector<float>*> kp;
  std::vector<const std::vector<int>*> keepp;
  for (size_t h = 0; h < H; ++h) {
    if (d < 1 || k[h]->size() % d != 0) throw InternalError("lookm_assign: k is not [n][d]");
    const int n = static_cast<int>(k[h]->size() / d);
    const std::vector<int>& kh = *keep[h];
    for (size_t j = 0; j < kh.size(); ++j)
      if (kh[j] < 0 || kh[j] >= n || (j > 0 && kh[j] <= kh[j - 1]))
        throw InternalError("lookm_merge: kept indices must be ascending and below " + std::to_string(n));
    if (!kh.empty()) {  // a head without kept rows assigns nothing
      kp.push_back(k[h]);
      keepp.push_back(&kh);
    }
  }
  std::vector<std::vector<LookMAssignment>> out(H), dev;
  if (!backend || kp.empty() || !backend->cosine_assign(d, kp, keepp, dev)) {
    for (size_t h = 0; h < H; ++h) out[h] = assign_evicted(d, *keep[h], *k[h]);
    return out;
  }
  for (size_t h = 0, x = 0; h < H; ++h)
    if (!keep[h]->empty()) out[h] = std::move(dev[x++]);
  return out;
}

}  // namespace

std::vector<std::vector<LookMAssignment>> lookm_assign_heads(int d, const std::vector<std::vector<int>>& keep,
                                                             const std::vector<std::vector<float>>& k, Backend* backend) {
  std::vector<const std::vector<int>*> keepp;
  std::vector<const std::vector<float>*> kp;
  for (const auto& x : keep) keepp.push_back(&x);
  for (const auto& x : k) kp.push_back(&x);
  return assign_heads(d, keepp, kp, backend);
}

std::vector<LookMAssignment> lookm_assign(int d, const std::vector<int>& keep, const std::vector<float>& k,
                                          Backend* backend) {
  return assign_heads(d, {&keep}, {&k}, backend).front();
}

void lookm_merge(MergeKind kind, int d, const std::vector<int>& keep, std::vector<float>& k,
                 std::vector<float>& v) {
  if (kind == MergeKind::None) return;
  check_rows(d, k, v);
  std::vector<int> count;
  merge_rows(kind, d, lookm_assign(d, keep, k), k, v, count);
}

std::vector<char> lookm_above_mean(const std::vector<std::vector<double>>& s) {
  size_t J = 0;
  double total = 0, n = 0;
  for (const auto& h : s) {
    J = std::max(J, h.size());
    for (double x : h) total += x, n += 1;
  }
  std::vector<double> sum(J, 0.0), cnt(J, 0.0);
  for (const auto& h : s)
    for (size_t j = 0; j < h.size(); ++j) sum[j] += h[j], cnt[j] += 1;
  std::vector<char> pass(J, 0);
  const double mean = n > 0 ? total / n : 0.0;
  for (size_t j = 0; j < J; ++j) pass[j] = sum[j] / cnt[j] >= mean;
  return pass;
}

std::vector<std::vector<LookMAssignment>> lookm_contributions(std::vector<std::vector<LookMAssignment>> a,
                                                              const LookMMergeSpec& spec) {
  if (!spec.above_mean) return a;
  const size_t H = a.size();
  std::vector<std::vector<double>> s(H);
  for (size_t h = 0; h < H; ++h)
    for (const Assignment& x : a[h]) s[h].push_back(x.s);
  const std::vector<char> pass = lookm_above_mean(s);
  std::vector<std::vector<Assignment>> out(H);
  for (size_t h = 0; h < H; ++h) {
    for (size_t j = 0; j < a[h].size(); ++j)
      if (pass[j]) out[h].push_back(a[h][j]);
    if (spec.kind == MergeKind::Average && spec.prefix_sources)
      for (size_t f = 0; f < out[h].size(); ++f) out[h][f].e = a[h][f].e;
  }
  return out;
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

enum class MergeFilter { All, AboveMean, Code };

struct LookMOptions {
  double alpha1 = 0.1, alpha2 = 0.1;
  bool text_prior = true, keep_all_text = false;
  MergeKind merge = MergeKind::Pivotal;
  MergeFilter filter = MergeFilter::All;
  bool prefix_source = false;  // average_source=prefix
  int sinks = 0;
};

class LookMPolicy : public ScoreEvictPolicy {
 public:
  explicit LookMPolicy(const LookMOptions& o) : ScoreEvictPolicy("lookm"), o_(o) {}

 protected:
  std::vector<LayerPlan> plan(const std::vector<PrefillContext>& layers) const override {
    std::vector<LayerPlan> plans;
    for (const PrefillContext& c : layers) {
      const int T = c.prompt_len;
      const int M = static_cast<int>(std::floor(o_.alpha1 * T + 1e-6));
      const int N = static_cast<int>(std::floor(o_.alpha2 * T + 1e-6));
      plans.push_back(make_plan(std::max(M + N, 1), M, T));
    }
    return plans;
  }

  std::vector<double> score(const PrefillContext& c, int kv_head) const override {
    std::vector<double> s = column_sums(c, kv_head, 0, c.prompt_len);
    if (o_.text_prior) {
      const double tp = *std::max_element(s.begin(), s.end());
      for (int j = 0; j < c.prompt_len; ++j)
        if (is_text((*c.token_kinds)[j])) s[j] += tp;
    }
    for (int j = 0; j < std::min(o_.sinks, c.prompt_len); ++j) s[j] = INFINITY;
    return s;
  }
  std::pair<int, int> scored_rows(const PrefillContext& c) const override { return {0, c.prompt_len}; }

  std::vector<int> select(const PrefillContext& c, int kv_head, const LayerPlan& plan,
                          const std::vector<double>& score) const override {
    std::vector<int> keep = select_recent_topk(score, plan);
    if (!o_.keep_all_text) return keep;
    std::vector<char> mask(c.prompt_len, 0);
    for (int i : keep) mask[i] = 1;
    for (int j = 0; j < c.prompt_len; ++j)
      if (is_text((*c.token_kinds)[j])) mask[j] = 1;
    keep.clear();
    for (int j = 0; j < c.prompt_len; ++j)
      if (mask[j]) keep.push_back(j);
    return keep;
  }

  bool merges() const override { return o_.merge != MergeKind::None; }

  // Assigns every head's evicted rows (Eq. 9), applies the similarity filter across heads when
  // asked, merges — on the host rows when the job has them, else in the device cache, every
  // layer at once and every step there — and remembers for each kept row (in order) how many
  // evicted rows it absorbed; the counts go into HeadRows::merged once the base class has kept
  // the rows (record_merged).
  void merge_layers(const std::vector<MergeJob>& jobs) const override {
    if (jobs.empty()) return;
    if (!jobs.front().k) {  // the rows are in the device cache alone: merged there
      Backend* be = jobs.front().c->backend;
      DeviceKV* dev = jobs.front().c->device;
      if (!be || !dev) throw InternalError("lookm: a layout without rows and no device cache to merge in");
      std::vector<LayerMerge> lm;
      for (const MergeJob& j : jobs) {
        if (j.k || j.c->backend != be || j.c->device != dev)
          throw InternalError("lookm: layers merged together on different caches");
        LayerMerge m;
        m.layer = j.c->layer;
        m.layout = j.layer;
        m.keep = *j.keep;
        lm.push_back(std::move(m));
      }
      if (!be->kv_lookm_merge(*dev, spec(), lm))
        throw InternalError("lookm: the " + be->name() + " backend cannot merge (kv_lookm_merge) rows its cache alone holds");
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t x = 0; x < jobs.size(); ++x)
        for (size_t h = 0; h < lm[x].merged.size(); ++h)
          counts_[{jobs[x].c->layer, static_cast<int>(h)}] = std::move(lm[x].merged[h]);
      return;
    }
    for (const MergeJob& j : jobs) {
      const std::vector<std::vector<Assignment>> contrib = lookm_contributions(assign_job(j), spec());
      const std::vector<std::vector<int>>& keep = *j.keep;
      const int H = static_cast<int>(keep.size());
      std::vector<std::vector<int>> per_kept(keep.size());  // each kept row's count, from merge_rows'
      std::exception_ptr err;
#pragma omp parallel for schedule(dynamic)
      for (int h = 0; h < H; ++h) {
        try {
          std::vector<int> count;
          merge_rows(o_.merge, j.c->head_dim, contrib[h], (*j.k)[h], (*j.v)[h], count);
          for (int c : keep[h]) per_kept[h].push_back(count.at(static_cast<size_t>(c)));
        } catch (...) {
#pragma omp critical(kvlens_lookm_error)
          if (!err) err = std::current_exception();
        }
      }
      if (err) std::rethrow_exception(err);
      std::lock_guard<std::mutex> lock(mu_);
      for (int h = 0; h < H; ++h) counts_[{j.c->layer, h}] = std::move(per_kept[static_cast<size_t>(h)]);
    }
  }

 private:
  // Eq. 9 for every KV head of a job with host rows: on the job's backend (one call for the
  // layer) where it has one, else on the host.
  std::vector<std::vector<Assignment>> assign_job(const MergeJob& j) const {
    const int H = static_cast<int>(j.keep->size()), d = j.c->head_dim;
    for (int h = 0; h < H; ++h) check_rows(d, (*j.k)[h], (*j.v)[h]);
    if (j.c->backend) return lookm_assign_heads(d, *j.keep, *j.k, j.c->backend);
    std::vector<std::vector<Assignment>> a(H);
    std::exception_ptr err;
#pragma omp parallel for schedule(dynamic)
    for (int h = 0; h < H; ++h) {
      try {
        a[h] = lookm_assign(d, (*j.keep)[h], (*j.k)[h]);
      } catch (...) {
#pragma omp critical(kvlens_lookm_error)
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return a;
  }

  // The merge as lookm_contributions and Backend::kv_lookm_merge take it: the similarity filter
  // for above_mean, and for code with the average and weighted rules.
  LookMMergeSpec spec() const {
    LookMMergeSpec m;
    m.kind = o_.merge;
    m.above_mean = o_.filter == MergeFilter::AboveMean ||
                   (o_.filter == MergeFilter::Code && (o_.merge == MergeKind::Average || o_.merge == MergeKind::Weighted));
    m.prefix_sources = o_.prefix_source;
    return m;
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
    if (o_.merge == MergeKind::None || layer.segments.empty()) return;
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

  LookMOptions o_;
};

}  // namespace

MethodSpec lookm_method() {
  MethodSpec m;
  m.name = "lookm";
  m.family = "merge";
  m.summary = "LOOK-M: text-prior eviction + merging evicted KV pairs into the kept ones";
  m.params = {
      {"alpha1", ParamSpec::Type::Float, 0.0, 1.0, {}, "0.1",
       "recent ratio: keep the last M = floor(alpha1*T) tokens (Eq. 6-8; code: int(T*recent_ratio))"},
      {"alpha2", ParamSpec::Type::Float, 0.0, 1.0, {}, "0.1",
       "important ratio: keep the top N = floor(alpha2*T) of the rest by A_s = sum_i A_p[i,:] (Eq. 4, 8)"},
      {"text_prior", ParamSpec::Type::Bool, 0, 0, {}, "true",
       "A_s[T] += max(A_s) on every text (non-visual) token (Eq. 5; code: -65516 on image tokens, same ranking)"},
      {"text_keep", ParamSpec::Type::Choice, 0, 0, {"budget", "all"}, "budget",
       "budget: text outranks visual inside N, S = N + M (Eq. 8 size); all: every text token kept beyond "
       "the budget (I = T u Top_N; authors' code keeps every score >= 0)"},
      {"merge", ParamSpec::Type::Choice, 0, 0, {"none", "average", "pivotal", "weighted"}, "pivotal",
       "evicted -> most cosine-similar kept key (Eq. 9): average k_c=(k_c+sum k_e)/(L+1) (Eq. 10); pivotal "
       "k_c=(k_c+1/2 sum(k_e+k_c))/(L+1) (Eq. 11); weighted k_c=(k_c+sum s*k_e)/(L+1) (Eq. 12)"},
      {"merge_filter", ParamSpec::Type::Choice, 0, 0, {"all", "above_mean", "code"}, "all",
       "all: merge every evicted row (Eq. 10-12); above_mean: only rows whose best cosine, mean over heads "
       "at the same evicted index, is >= the mean over heads and rows; code: above_mean for average and "
       "weighted, all for pivotal (authors' Text{AVG,Weighted,Pivot}Merge)"},
      {"average_source", ParamSpec::Type::Choice, 0, 0, {"assigned", "prefix"}, "assigned",
       "average merge sources: assigned = each merged row itself (Eq. 10); prefix = the f-th merged "
       "assignment takes the f-th evicted row in order (authors' avg-merge scatter of unfiltered rows)"},
      {"sinks", ParamSpec::Type::Int, 0, 1000000, {}, "0",
       "first n prompt tokens always in the top N (score +inf); not in the paper; the authors' code forces 4 "
       "in its no-prior classes, none with the text prior"},
  };
  m.presets = {
      {"paper", {{"text_keep", "budget"}, {"merge_filter", "all"}, {"average_source", "assigned"}, {"sinks", "0"}}},
      {"official", {{"text_keep", "all"}, {"merge_filter", "code"}, {"average_source", "prefix"}, {"sinks", "0"}}},
  };
  m.make = [](const Params& p) -> std::unique_ptr<KVPolicy> {
    LookMOptions o;
    o.alpha1 = p.num("alpha1");
    o.alpha2 = p.num("alpha2");
    o.text_prior = p.flag("text_prior");
    o.keep_all_text = p.str("text_keep") == "all";
    o.merge = parse_merge(p.str("merge"));
    const std::string f = p.str("merge_filter");
    o.filter = f == "above_mean" ? MergeFilter::AboveMean : f == "code" ? MergeFilter::Code : MergeFilter::All;
    o.prefix_source = p.str("average_source") == "prefix";
    o.sinks = p.integer("sinks");
    return std::make_unique<LookMPolicy>(o);
  };
  return m;
}

}  // namespace kvlens
