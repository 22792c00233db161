#include "core/compress/select.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>

#include "core/errors.h"
#include "core/parallel.h"
#include "core/trace.h"
#include "core/half.h"
#include "core/compress/quantize.h"

namespace kvlens {

namespace {

std::string where(const std::string& method, int layer) {
  return method + ": layer " + std::to_string(layer);
}

int bytes_per_value(const std::string& method, const KVSegment& s) {
  if (s.dense()) return s.dense_value_bytes();
  throw InputError(method + ": cannot evict rows of a segment stored as '" + s.storage +
                   "'; evict before quantizing");
}

}  // namespace

int budget_rows(double fraction, int n) {
  if (!std::isfinite(fraction) || fraction < 0.0 || fraction > 1.0)
    throw InputError("budget must be in [0, 1], got " + std::to_string(fraction));
  if (n < 1) throw InputError("budget of an empty prompt");
  // The small epsilon keeps e.g. 0.29·100 at 29 despite 0.29 not being representable.
  const long long r = static_cast<long long>(std::floor(fraction * n + 1e-6));
  return static_cast<int>(std::clamp<long long>(r, 1, n));
}

LayerPlan make_plan(int keep, int recent, int n) {
  LayerPlan p;
  p.keep = std::clamp(keep, 1, std::max(n, 1));
  p.recent = std::clamp(recent, 0, p.keep);
  return p;
}

std::vector<int> top_k(const std::vector<double>& score, int k, const std::vector<char>* allowed) {
  const int n = static_cast<int>(score.size());
  if (allowed && static_cast<int>(allowed->size()) != n)
    throw InternalError("top_k: mask and scores differ in length");
  // (key, index) pairs side by side, NaN keyed as −∞ so that it ranks last and the order stays a
  // strict weak ordering.
  struct Entry {
    double key;
    int i;
  };
  std::vector<Entry> e;
  e.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i)
    if (!allowed || (*allowed)[static_cast<size_t>(i)])
      e.push_back({std::isnan(score[static_cast<size_t>(i)]) ? -std::numeric_limits<double>::infinity()
                                                             : score[static_cast<size_t>(i)],
                   i});
  k = std::clamp(k, 0, static_cast<int>(e.size()));
  // A strict total order (ties to the smaller index), so the k best form one set whatever order
  // nth_element leaves them in.
  auto better = [](const Entry& a, const Entry& b) { return a.key != b.key ? a.key > b.key : a.i < b.i; };
  std::nth_element(e.begin(), e.begin() + k, e.end(), better);
  std::vector<int> idx(static_cast<size_t>(k));
  for (int j = 0; j < k; ++j) idx[static_cast<size_t>(j)] = e[static_cast<size_t>(j)].i;
  std::sort(idx.begin(), idx.end());
  return idx;
}

std::vector<int> select_recent_topk(const std::vector<double>& score, const LayerPlan& plan) {
  const int n = static_cast<int>(score.size());
  const LayerPlan p = make_plan(plan.keep, plan.recent, n);
  std::vector<char> allowed(n, 0);
  for (int i = 0; i < n - p.recent; ++i) allowed[i] = 1;
  std::vector<int> keep = top_k(score, p.keep - p.recent, &allowed);
  for (int i = n - p.recent; i < n; ++i) keep.push_back(i);
  return keep;  // top-k indices all precede the window, so this is ascending
}

std::vector<double> column_sums(const PrefillContext& c, int kv_head, int q_begin, int q_end) {
  const int T = c.prompt_len;
  if (!c.attention) throw InputError("layer " + std::to_string(c.layer) + ": no prefill probabilities");
  // Each query head's sums come from where the attention is (a device reduces them there, and the
  // capture shares them with every KV head that asks); the group's heads are then averaged.
  const auto sums = c.attention->column_sums(c.layer, AttentionReduction::range(q_begin, q_end, T));
  const int group = c.n_heads / c.n_kv_heads;
  std::vector<double> out(T, 0.0);
  for (int g = 0; g < group; ++g) {
    const double* s = sums->data() + static_cast<size_t>(kv_head * group + g) * T;
    for (int j = 0; j < T; ++j) out[j] += s[j];
  }
  for (double& x : out) x /= group;
  return out;
}

void check_prefill(const std::string& method, const PrefillContext& c, const LayerKV& layer,
                   bool needs_probs) {
  const std::string at = where(method, c.layer);
  if (c.n_heads < 1 || c.n_kv_heads < 1 || c.n_heads % c.n_kv_heads != 0)
    throw InputError(at + ": n_heads " + std::to_string(c.n_heads) +
                     " is not a multiple of n_kv_heads " + std::to_string(c.n_kv_heads));
  if (c.head_dim < 1) throw InputError(at + ": head_dim must be positive");
  if (c.prompt_len < 1) throw InputError(at + ": empty prompt");
  if (!c.token_kinds || static_cast<int>(c.token_kinds->size()) != c.prompt_len)
    throw InputError(at + ": token kinds must have one entry per prompt token (" +
                     std::to_string(c.prompt_len) + ")");
  if (needs_probs && !c.attention) throw InputError(at + ": needs the prefill attention probabilities");
  std::vector<int> rows(c.n_kv_heads, 0);
  for (const KVSegment& s : layer.segments) {
    if (static_cast<int>(s.heads.size()) != c.n_kv_heads)
      throw InputError(at + ": a segment has " + std::to_string(s.heads.size()) +
                       " KV heads, expected " + std::to_string(c.n_kv_heads));
    bytes_per_value(method, s);
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const HeadRows& r = s.heads[h];
      const size_t want = s.layout_only ? 0 : static_cast<size_t>(r.n()) * c.head_dim;
      if (r.k.size() != want || r.v.size() != want)
        throw InputError(at + ": head " + std::to_string(h) + " rows and positions disagree");
      rows[h] += r.n();
    }
  }
  for (int h = 0; h < c.n_kv_heads; ++h)
    if (rows[h] != c.prompt_len)
      throw InputError(at + ": KV head " + std::to_string(h) + " holds " + std::to_string(rows[h]) +
                       " rows, expected the " + std::to_string(c.prompt_len) + " prompt rows");
}

void gather_head(const LayerKV& layer, int h, int head_dim, std::vector<float>& k,
                 std::vector<float>& v, std::vector<int32_t>& pos,
                 std::vector<SegmentKind>* kinds) {
  k.clear();
  v.clear();
  pos.clear();
  if (kinds) kinds->clear();
  for (const KVSegment& s : layer.segments) {
    if (s.layout_only)
      throw InternalError("gather_head: a " + std::string(segment_kind_name(s.kind)) +
                          " segment's rows are in the device cache alone");
    const HeadRows& r = s.heads.at(h);
    k.insert(k.end(), r.k.begin(), r.k.end());
    v.insert(v.end(), r.v.begin(), r.v.end());
    pos.insert(pos.end(), r.pos.begin(), r.pos.end());
    if (kinds) kinds->insert(kinds->end(), r.pos.size(), s.kind);
  }
  if (k.size() != pos.size() * static_cast<size_t>(head_dim))
    throw InternalError("gather_head: rows and positions disagree");
}

void keep_rows(const std::string& method, LayerKV& layer, int head_dim,
               const std::vector<std::vector<int>>& keep,
               const std::vector<std::vector<float>>* k,
               const std::vector<std::vector<float>>* v) {
  const int H = static_cast<int>(keep.size());
  const size_t D = static_cast<size_t>(head_dim);
  for (const KVSegment& s : layer.segments) {
    bytes_per_value(method, s);
    if (static_cast<int>(s.heads.size()) != H)
      throw InternalError(method + ": keep list and segment head counts differ");
    if (k && s.layout_only)
      throw InternalError(method + ": merged rows for a segment whose rows are in the device cache alone");
  }
  for (int h = 0; h < H; ++h) {
    int n = 0;
    for (const KVSegment& s : layer.segments) n += s.heads[h].n();
    std::vector<char> mask(n, 0);
    int prev = -1;
    for (int i : keep[h]) {
      if (i <= prev || i >= n)
        throw InternalError(method + ": kept rows must be ascending indices below " +
                            std::to_string(n));
      mask[i] = 1;
      prev = i;
    }
    if (k && ((*k)[h].size() != n * D || (*v)[h].size() != n * D))
      throw InternalError(method + ": merged rows do not match the head's rows");
    int g = 0;  // row index over all segments
    for (KVSegment& s : layer.segments) {
      HeadRows& r = s.heads[h];
      // Kept rows keep their annotations (rows appended after one was written read as the
      // segment's storage and as nothing merged).
      const int seg_bits = 8 * bytes_per_value(method, s);
      const bool has_bits = !r.bits.empty(), has_merged = !r.merged.empty();
      HeadRows out;
      for (int i = 0; i < r.n(); ++i, ++g) {
        if (!mask[g]) continue;
        if (!s.layout_only) {  // (a layout_only segment: positions and annotations alone)
          const float* kr = k ? (*k)[h].data() + g * D : r.k.data() + i * D;
          const float* vr = v ? (*v)[h].data() + g * D : r.v.data() + i * D;
          out.k.insert(out.k.end(), kr, kr + D);
          out.v.insert(out.v.end(), vr, vr + D);
          if (k && seg_bits == 16)  // a merged row is stored as the segment stores rows
            for (size_t x = out.k.size() - D; x < out.k.size(); ++x) {
              out.k[x] = round_half(out.k[x]);
              out.v[x] = round_half(out.v[x]);
            }
        }
        out.pos.push_back(r.pos[i]);
        if (has_bits) out.bits.push_back(static_cast<uint8_t>(quant::row_bits(r, i, seg_bits)));
        if (has_merged) out.merged.push_back(static_cast<uint16_t>(quant::row_merged(r, i)));
      }
      r = std::move(out);
    }
  }
  std::vector<KVSegment> kept;
  for (KVSegment& s : layer.segments) {
    bool any = false;
    for (const HeadRows& r : s.heads) any = any || r.n() > 0;
    if (!any) continue;
    s.bytes = s.dense_bytes(head_dim, bytes_per_value(method, s));
    kept.push_back(std::move(s));
  }
  layer.segments = std::move(kept);
}

std::vector<int> ScoreEvictPolicy::select(const PrefillContext& c, int kv_head,
                                          const LayerPlan& plan,
                                          const std::vector<double>& score) const {
  return select_recent_topk(score, plan);
}

std::vector<std::vector<int>> ScoreEvictPolicy::select_layer(const PrefillContext& c, const LayerPlan& plan,
                                                            const LayerKV& layer) const {
  const int H = c.n_kv_heads;
  std::vector<std::vector<int>> keep(H);
  std::exception_ptr err;
#pragma omp parallel for schedule(dynamic)
  for (int h = 0; h < H; ++h) {
    try {
      const std::vector<double> s = score(c, h);
      if (static_cast<int>(s.size()) != c.prompt_len)
        throw InternalError(name_ + ": score has the wrong length");
      keep[h] = select(c, h, plan, s);
      if (keep[h].empty()) throw InternalError(name_ + ": a head kept no row");
    } catch (...) {
#pragma omp critical(kvlens_evict_error)
      if (!err) err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
  return keep;
}

void prepare_layers(const std::vector<const PrefillContext*>& cs, std::pair<int, int> rows, double below_p,
                    bool zeros_below) {
  if (cs.size() < 2 || !cs.front()->attention || rows.first >= rows.second) return;
  const PrefillContext& c0 = *cs.front();
  std::vector<int> layers;
  for (const PrefillContext* c : cs) {
    if (c->attention != c0.attention || c->prompt_len != c0.prompt_len) return;  // (contexts made apart)
    layers.push_back(c->layer);
  }
  c0.attention->prepare(layers, AttentionReduction::range(rows.first, rows.second, c0.prompt_len), below_p,
                        zeros_below);
}

void ScoreEvictPolicy::compress_layers(const std::vector<const PrefillContext*>& cs, const std::vector<LayerPlan>& plans,
                                       const std::vector<LayerKV*>& layers) const {
  const int n = static_cast<int>(cs.size());
  const bool merging = merges();
  std::vector<std::vector<std::vector<int>>> keep(cs.size());
  std::vector<char> later(cs.size(), 0);  // merged in the device cache, with the other such layers
  if (!cs.empty()) {
    trace::Scope span("evict.prepare");
    prepare_layers(cs, scored_rows(*cs.front()));  // every layer's sums at once
  }
  // Layers select independently once planned (scores and selection of one layer read nothing of
  // another; the capture and the backend serialise the device work they ask for): on threads of
  // their own, the same result as in turn. A layer whose rows the host holds merges there, alone.
  parallel_for(n, 8, [&](int i) {
    const size_t x = static_cast<size_t>(i);
    const PrefillContext& c = *cs[x];
    LayerKV& layer = *layers[x];
    trace::Scope span("evict.layer", c.layer);
    keep[x] = select_layer(c, plans[x], layer);
    const bool host_rows = std::none_of(layer.segments.begin(), layer.segments.end(),
                                        [](const KVSegment& s) { return s.layout_only; });
    if (!merging) {
      keep_rows(name_, layer, c.head_dim, keep[x]);
    } else if (host_rows) {
      const int H = c.n_kv_heads;
      std::vector<std::vector<float>> K(H), V(H);
      std::exception_ptr err;
#pragma omp parallel for schedule(dynamic)
      for (int h = 0; h < H; ++h) {
        try {
          std::vector<int32_t> pos;
          gather_head(layer, h, c.head_dim, K[h], V[h], pos);
        } catch (...) {
#pragma omp critical(kvlens_evict_error)
          if (!err) err = std::current_exception();
        }
      }
      if (err) std::rethrow_exception(err);
      merge_layers({MergeJob{&c, &layer, &keep[x], &K, &V}});
      keep_rows(name_, layer, c.head_dim, keep[x], &K, &V);
    } else {
      later[x] = 1;
    }
  });
  std::vector<MergeJob> jobs;
  for (size_t x = 0; x < cs.size(); ++x)
    if (later[x]) jobs.push_back(MergeJob{cs[x], layers[x], &keep[x], nullptr, nullptr});
  if (jobs.empty()) return;
  merge_layers(jobs);
  trace::Scope span("evict.keep");
  parallel_for(n, 8, [&](int i) {
    const size_t x = static_cast<size_t>(i);
    if (later[x]) keep_rows(name_, *layers[x], cs[x]->head_dim, keep[x]);
  });
}

void ScoreEvictPolicy::on_prefill(const std::vector<PrefillContext>& layers, KVStore& store) {
  for (const PrefillContext& c : layers) {
    if (c.n_kv_heads != store.n_kv_heads() || c.head_dim != store.head_dim())
      throw InputError(where(name_, c.layer) + ": context and KV store disagree on heads or head_dim");
    check_prefill(name_, c, store.layer(c.layer), needs_prefill_attention());
  }
  std::vector<LayerPlan> plans = plan(layers);
  if (plans.size() != layers.size()) throw InternalError(name_ + ": one plan per layer expected");
  for (size_t i = 0; i < layers.size(); ++i)
    plans[i] = make_plan(plans[i].keep, plans[i].recent, layers[i].prompt_len);
  std::vector<const PrefillContext*> cs;
  std::vector<LayerKV*> ls;
  for (const PrefillContext& c : layers) {
    cs.push_back(&c);
    ls.push_back(&store.layer(c.layer));
  }
  compress_layers(cs, plans, ls);
  plans_ = std::move(plans);
}

void ScoreEvictPolicy::on_prefill_layer(const PrefillContext& ctx, LayerKV& layer) {
  check_prefill(name_, ctx, layer, needs_prefill_attention());
  std::vector<LayerPlan> plans = plan({ctx});
  if (plans.size() != 1) throw InternalError(name_ + ": one plan per layer expected");
  plans[0] = make_plan(plans[0].keep, plans[0].recent, ctx.prompt_len);
  compress_layers({&ctx}, plans, {&layer});
  plans_ = std::move(plans);
}

}  // namespace kvlens
