#include "core/diagnostics/diagnostics.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <memory>

#include "core/errors.h"
#include "core/compress/select.h"
#include "core/exact_attention.h"
#include "core/parallel.h"
#include "core/team.h"
#include "core/trace.h"

namespace kvlens {

void DecodeRecorder::record_only(const std::vector<int>& steps) {
  only_.assign(static_cast<size_t>(std::max(max_steps_, 0)), 0);
  for (int s : steps) {
    if (s < 0 || s >= max_steps_)
      throw InternalError("decode recorder: step " + std::to_string(s) + " is outside 0 .. " +
                          std::to_string(max_steps_ - 1));
    only_[static_cast<size_t>(s)] = 1;
  }
}

void DecodeRecorder::on_attention(const AttentionEvent& e) {
  if (e.phase != Phase::Decode || !reads_step(e.step)) return;
  trace::Scope span("recorder.on_attention", e.layer);
  Entry r;
  r.step = e.step; r.layer = e.layer; r.n_heads = e.n_heads; r.n_kv_heads = e.n_kv_heads;
  r.n_k = e.n_k; r.head_dim = e.head_dim; r.query_pos = e.query_pos[0];
  const size_t hk = static_cast<size_t>(e.n_heads) * e.n_k, kvk = static_cast<size_t>(e.n_kv_heads) * e.n_k;
  r.scores.assign(e.scores, e.scores + hk);
  r.probs.assign(e.probs, e.probs + hk);
  r.q.assign(e.q, e.q + static_cast<size_t>(e.n_heads) * e.head_dim);
  if (keep_rows_) {
    if (!e.k || !e.v) throw InternalError("decode recorder: step " + std::to_string(e.step) + " layer " +
                                          std::to_string(e.layer) + " came without its keys and values");
    r.k.assign(e.k, e.k + kvk * e.head_dim);
    r.v.assign(e.v, e.v + kvk * e.head_dim);
  }
  r.key_pos.assign(e.key_pos, e.key_pos + kvk);
  r.key_kind.assign(e.key_kind, e.key_kind + kvk);
  if (compare_) {
    ExactAttention own;
    const ExactAttention* x = e.exact;
    if (!x) {
      if (!e.k || !e.v)
        throw InternalError("decode recorder: step " + std::to_string(e.step) + " layer " + std::to_string(e.layer) +
                            " came with neither its rows nor its exact attention");
      const int T = pv_.prompt_len;
      own = exact_attention(e.q, e.n_heads, e.head_dim, 1.0f / std::sqrt(static_cast<float>(e.head_dim)),
                            prompt_rows(*pv_.full, e.layer, T),
                            rows_from(e.k, e.v, e.key_pos, e.n_kv_heads, e.n_k, e.head_dim, T));
      x = &own;
    }
    r.comparison = compare_query(e, *x, *pv_.kinds, e.step == 0);
    r.compared = true;
  }
  // In (step, layer) order whatever order the events came in (a step's layers may come at once).
  std::lock_guard<std::mutex> lock(mu_);
  const auto at = std::upper_bound(entries_.begin(), entries_.end(), r, [](const Entry& a, const Entry& b) {
    return a.step != b.step ? a.step < b.step : a.layer < b.layer;
  });
  entries_.insert(at, std::move(r));
}

const DecodeRecorder::Entry* DecodeRecorder::find(int step, int layer) const {
  for (const Entry& e : entries_)
    if (e.step == step && e.layer == layer) return &e;
  return nullptr;
}

int DecodeRecorder::steps() const {
  int s = 0;
  for (const Entry& e : entries_) s = std::max(s, e.step + 1);
  return s;
}

void VisualAttentionRecorder::on_attention(const AttentionEvent& e) {
  if (e.phase != Phase::Decode) return;
  std::vector<float> out(static_cast<size_t>(e.n_heads) * n_visual_);
  span_attention_sums(e.probs, e.key_pos, e.n_heads, e.n_kv_heads, e.n_k, first_, n_visual_, out.data());
  keep(e.step, e.layer, e.n_heads, std::move(out));
}

void VisualAttentionRecorder::on_span_attention(int step, int layer, int n_heads, const float* sums) {
  keep(step, layer, n_heads, std::vector<float>(sums, sums + static_cast<size_t>(n_heads) * n_visual_));
}

void VisualAttentionRecorder::keep(int step, int layer, int n_heads, std::vector<float> row) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rows_.size() <= static_cast<size_t>(step)) rows_.resize(step + 1);
  auto& by_layer = rows_[step];
  if (by_layer.size() <= static_cast<size_t>(layer)) by_layer.resize(layer + 1);
  n_heads_ = n_heads;
  by_layer[layer] = std::move(row);
}

std::vector<float> VisualAttentionRecorder::attention(int step, int layer, int head) const {
  if (step < 0 || step >= steps() || layer < 0 || layer >= static_cast<int>(rows_[step].size())) return {};
  const std::vector<float>& r = rows_[step][layer];
  if (r.empty() || head >= n_heads_) return {};
  std::vector<float> out(n_visual_, 0.0f);
  for (int h = head < 0 ? 0 : head; h < (head < 0 ? n_heads_ : head + 1); ++h)
    for (int i = 0; i < n_visual_; ++i) out[i] += r[static_cast<size_t>(h) * n_visual_ + i];
  if (head < 0 && n_heads_ > 0)
    for (float& x : out) x /= n_heads_;
  return out;
}

std::vector<float> decode_attention_rows(const DecodeRecorder& rec, int layer, int steps, int n_cols) {
  std::vector<float> out(static_cast<size_t>(steps) * n_cols, 0.0f);
  for (const auto& e : rec.entries()) {
    if (e.layer != layer || e.step >= steps) continue;
    const int G = e.n_heads / e.n_kv_heads;
    for (int h = 0; h < e.n_heads; ++h)
      for (int j = 0; j < e.n_k; ++j) {
        const int32_t pos = e.key_pos[static_cast<size_t>(h / G) * e.n_k + j];
        if (pos >= 0 && pos < n_cols)
          out[static_cast<size_t>(e.step) * n_cols + pos] += e.probs[static_cast<size_t>(h) * e.n_k + j] / e.n_heads;
      }
  }
  return out;
}

double sparsity(const float* probs, int n_heads, int n_q, int n_k, double p) {
  double total = 0.0;
  for (int h = 0; h < n_heads; ++h) {
    int64_t zeros = 0, seen = 0;
    for (int i = 0; i < n_q; ++i) {
      const float* row = probs + (static_cast<int64_t>(h) * n_q + i) * n_k;
      const int visible = std::min(n_k, i + 1 + (n_k - n_q));  // causal, aligned at the end
      const float mx = *std::max_element(row, row + visible);
      for (int j = 0; j < visible; ++j) zeros += row[j] < p * mx ? 1 : 0;
      seen += visible;
    }
    total += seen ? static_cast<double>(zeros) / seen : 0.0;
  }
  return n_heads ? total / n_heads : 0.0;
}

double prefill_sparsity(const PrefillView& pv, int layer, double p) {
  // sparsity() of the layer's probabilities, its counts made where the attention is.
  const int T = pv.prompt_len, H = pv.n_heads;
  std::vector<int64_t> below(static_cast<size_t>(H));
  AttentionReduction r;
  r.queries = AttentionReduction::range(0, T, T);
  r.below = below.data();
  r.p = p;
  pv.attention->reduce(layer, r);
  const int64_t seen = static_cast<int64_t>(T) * (T + 1) / 2;
  double total = 0.0;
  for (int h = 0; h < H; ++h) total += seen ? static_cast<double>(below[h]) / seen : 0.0;
  return H ? total / H : 0.0;
}

std::vector<double> prefill_sparsities(const PrefillView& pv, double p) {
  const int L = pv.attention->n_layers();
  pv.attention->prepare_every_layer(AttentionReduction::range(0, pv.prompt_len, pv.prompt_len), p);
  std::vector<double> out;
  for (int l = 0; l < L; ++l) out.push_back(prefill_sparsity(pv, l, p));
  return out;
}

std::vector<double> decode_sparsities(const DecodeRecorder& rec, int n_layers, int steps, double p) {
  std::vector<std::vector<const DecodeRecorder::Entry*>> steps_of(static_cast<size_t>(std::max(n_layers, 0)));
  for (const auto& e : rec.entries())
    if (e.layer >= 0 && e.layer < n_layers && e.step < steps) steps_of[static_cast<size_t>(e.layer)].push_back(&e);
  std::vector<double> out(steps_of.size(), 0.0);
  team_each(n_layers, product_threads(), [&](int64_t l) {  // (each writes its own entry)
    double s = 0;
    for (const DecodeRecorder::Entry* e : steps_of[static_cast<size_t>(l)])
      s += sparsity(e->probs.data(), e->n_heads, 1, e->n_k, p);
    const size_t n = steps_of[static_cast<size_t>(l)].size();
    out[static_cast<size_t>(l)] = n ? s / static_cast<double>(n) : 0.0;
  });
  return out;
}

namespace {

// Key bits of a row from its segment's storage label, for rows without a per-row annotation
// (HeadRows::bits). Every quantizing policy writes per-row bits, so this mostly sees "fp32" and
// "fp16"; it still reads the labels the policies write: "q<b> k:.. v:..", "q<b>-channel",
// "kivi q<b>", "turboquant k:q<b−1>+qjl v:q<b>" (keys: b−1 codebook bits + 1 sign bit),
// "hadamard-int4[ k, fp32 v]" (4), and "zipcache q<h>/q<l>" (mixed: the mean of the two, as the
// per-row split is unknown). Anything else reads as 32.
float storage_bits(const std::string& s) {
  if (s == "fp32") return 32.0f;
  if (s == "fp16") return 16.0f;
  if (s.find("int4") != std::string::npos) return 4.0f;
  // The number after "q" at `at`, or 0.
  auto bits_at = [&](size_t at) {
    int b = 0;
    for (size_t i = at; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])) && b < 1000; ++i)
      b = b * 10 + (s[i] - '0');
    return b;
  };
  const size_t k = s.find("k:q");
  if (k != std::string::npos) {
    const int b = bits_at(k + 3);
    if (b > 0) return static_cast<float>(b + (s.compare(k + 3 + std::to_string(b).size(), 4, "+qjl") == 0 ? 1 : 0));
  }
  // The first "q<digits>" at the start of a word ("q4 k:..", "kivi q2", "zipcache q4/q2").
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != 'q' || (i > 0 && s[i - 1] != ' ')) continue;
    const int b = bits_at(i + 1);
    if (b <= 0) continue;
    const size_t end = i + 1 + std::to_string(b).size();
    if (end + 1 < s.size() && s[end] == '/' && s[end + 1] == 'q') {
      const int lo = bits_at(end + 2);
      if (lo > 0) return 0.5f * static_cast<float>(b + lo);
    }
    return static_cast<float>(b);
  }
  return 32.0f;
}

}  // namespace

ScoreHistogram visual_score_histogram(const VisualScores& s, int head, int bins) {
  ScoreHistogram out;
  const size_t H = s.exact.size();
  if (head >= static_cast<int>(H) || s.quantized.size() != H || s.calibrated.size() != H)
    throw InternalError("visual_score_histogram: head " + std::to_string(head) + " of " + std::to_string(H));
  const size_t h0 = head < 0 ? 0 : static_cast<size_t>(head), h1 = head < 0 ? H : h0 + 1;
  const std::vector<std::vector<float>>* kinds[3] = {&s.exact, &s.quantized, &s.calibrated};
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  // The range: every visual key's exact score (the held ones' among them), else (samples made
  // without it) the held ones', and the quantized and calibrated scores.
  const std::vector<std::vector<float>>& exact_range = s.every.size() == H ? s.every : s.exact;
  for (const auto* k : {&exact_range, &s.quantized, &s.calibrated})
    for (size_t h = h0; h < h1; ++h)
      for (float x : (*k)[h]) {
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
  if (!std::isfinite(lo) || bins < 1) return out;
  if (hi <= lo) hi = lo + 1.0f;
  out.lo = lo;
  out.hi = hi;
  std::vector<int64_t>* counts[3] = {&out.exact, &out.quantized, &out.calibrated};
  for (int i = 0; i < 3; ++i) {
    counts[i]->assign(bins, 0);
    for (size_t h = h0; h < h1; ++h)
      for (float x : (*kinds[i])[h]) {
        const int b = static_cast<int>((x - lo) / (hi - lo) * bins);
        (*counts[i])[std::clamp(b, 0, bins - 1)]++;
      }
  }
  return out;
}

ScoreRanges score_range_by_head(const VisualScores& s) {
  ScoreRanges r;
  for (const auto& v : s.quantized) {
    const auto [a, b] = std::minmax_element(v.begin(), v.end());
    r.gamma.push_back(v.empty() ? 0.0 : *a);
    r.delta.push_back(v.empty() ? 0.0 : *b);
  }
  return r;
}

VisualScores retransform_visual_scores(const VisualScores& s, int layer, const KVPolicy& policy) {
  VisualScores r;
  r.exact = s.exact;
  r.quantized = s.quantized;
  r.calibrated = s.quantized;
  r.every = s.every;
  if (!policy.has_score_transform()) return r;
  for (size_t h = 0; h < r.calibrated.size(); ++h) {
    std::vector<float>& v = r.calibrated[h];
    const std::vector<SegmentKind> kinds(v.size(), SegmentKind::Visual);
    policy.transform_scores(layer, static_cast<int>(h), v.data(), kinds.data(), static_cast<int>(v.size()));
  }
  return r;
}

QueryComparison compare_query(const AttentionEvent& e, const ExactAttention& x, const std::vector<SegmentKind>& kinds,
                              bool visual) {
  const int H = e.n_heads, G = H / e.n_kv_heads, n_k = e.n_k, D = e.head_dim;
  const int T = static_cast<int>(kinds.size());
  const bool rows = e.k && e.v;
  if (!rows && (!e.out || !e.raw_scores))
    throw InternalError("compare_query: layer " + std::to_string(e.layer) + " step " + std::to_string(e.step) +
                        " has neither rows nor raw scores and an output");
  if (x.probs.size() != static_cast<size_t>(H) * x.n || x.pos.size() != static_cast<size_t>(e.n_kv_heads) * x.n)
    throw InternalError("compare_query: the exact attention's shape differs from the event's");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  QueryComparison c;
  c.softmax_mse.assign(H, 0.0);
  c.softmax_kl.assign(H, 0.0);
  c.output_rel_error.assign(H, 0.0);
  if (visual)
    for (auto* k : {&c.visual.exact, &c.visual.quantized, &c.visual.calibrated, &c.visual.every}) k->resize(H);
  for (int h = 0; h < H; ++h) {
    const int kv = h / G;
    const float* q = e.q + static_cast<size_t>(h) * D;
    const int32_t* kp = e.key_pos + static_cast<size_t>(kv) * n_k;
    const SegmentKind* kk = e.key_kind + static_cast<size_t>(kv) * n_k;
    const float* mp = e.probs + static_cast<size_t>(h) * n_k;
    const float* ms = e.scores + static_cast<size_t>(h) * n_k;
    const float* pe = x.probs.data() + static_cast<size_t>(h) * x.n;
    const float* se = x.scores.data() + static_cast<size_t>(h) * x.n;
    const int32_t* ep = x.pos.data() + static_cast<size_t>(kv) * x.n;
    // The method's probabilities by position (0 for an evicted key), and which keys it holds.
    std::vector<float> pm_by_pos(static_cast<size_t>(e.query_pos[0]) + 1, 0.0f);
    std::vector<char> held(visual ? pm_by_pos.size() : 0, 0);
    for (int j = 0; j < n_k; ++j)
      if (kp[j] >= 0) {
        pm_by_pos.at(kp[j]) += mp[j];
        if (visual) held.at(kp[j]) = 1;
      }
    // The exact scores of the visual keys the method holds: the same keys as its own scores, so
    // that an eviction does not show as a shift of the distribution.
    if (visual)
      for (int j = 0; j < T; ++j)
        if (ep[j] >= 0 && kinds[ep[j]] == SegmentKind::Visual) {
          c.visual.every[h].push_back(se[j]);
          if (held.at(ep[j])) c.visual.exact[h].push_back(se[j]);
        }
    double mse = 0.0, kl = 0.0;
    int ne = 0;
    for (int j = 0; j < x.n; ++j) {
      if (ep[j] < 0) continue;
      ++ne;
      const double pm = pm_by_pos.at(ep[j]);
      mse += (pe[j] - pm) * (pe[j] - pm);
      if (pe[j] > 0) kl += pe[j] * std::log(pe[j] / std::max(pm, 1e-10));  // (one logarithm a key)
    }
    std::vector<double> om(D, 0.0);
    if (!rows)
      for (int c2 = 0; c2 < D; ++c2) om[c2] = e.out[static_cast<size_t>(h) * D + c2];
    for (int j = 0; j < n_k; ++j) {
      if (kp[j] < 0) continue;
      const float* mk = rows ? e.k + (static_cast<size_t>(kv) * n_k + j) * D : nullptr;
      const float* mv = rows ? e.v + (static_cast<size_t>(kv) * n_k + j) * D : nullptr;
      if (rows)
        for (int c2 = 0; c2 < D; ++c2) om[c2] += mp[j] * mv[c2];
      if (visual && kk[j] == SegmentKind::Visual) {
        float quantized = 0.0f;
        if (rows) {
          float dot = 0.0f;
          for (int c2 = 0; c2 < D; ++c2) dot += q[c2] * mk[c2];
          quantized = dot * scale;
        } else {
          quantized = e.raw_scores[static_cast<size_t>(h) * n_k + j];
        }
        c.visual.quantized[h].push_back(quantized);
        c.visual.calibrated[h].push_back(ms[j]);
      }
    }
    const double* oe = x.out.data() + static_cast<size_t>(h) * D;
    double num = 0.0, den = 0.0;
    for (int c2 = 0; c2 < D; ++c2) {
      num += (om[c2] - oe[c2]) * (om[c2] - oe[c2]);
      den += oe[c2] * oe[c2];
    }
    c.softmax_mse[h] = ne ? mse / ne : 0.0;
    c.softmax_kl[h] = kl;
    c.output_rel_error[h] = std::sqrt(num / std::max(den, 1e-30));
  }
  return c;
}

namespace {

// A recorded entry as the event it was recorded from.
AttentionEvent event_of(const DecodeRecorder::Entry& E) {
  AttentionEvent e;
  e.phase = Phase::Decode; e.layer = E.layer; e.step = E.step; e.n_heads = E.n_heads; e.n_kv_heads = E.n_kv_heads;
  e.n_q = 1; e.n_k = E.n_k; e.head_dim = E.head_dim;
  e.scores = E.scores.data(); e.probs = E.probs.data(); e.query_pos = &E.query_pos;
  e.key_pos = E.key_pos.data(); e.key_kind = E.key_kind.data(); e.q = E.q.data();
  e.k = E.k.empty() ? nullptr : E.k.data();
  e.v = E.v.empty() ? nullptr : E.v.data();
  return e;
}

}  // namespace

std::vector<LayerDiagnostics> compare_layers(const PrefillView& pv, const DecodeRecorder& method,
                                             const KVStore& compressed, int hist_bins, double p) {
  trace::Scope span("diagnostics.compare_layers");
  if (!method.keeps_rows() && !method.compares())
    throw InternalError("compare_layers: the method's recorder kept no keys and values and compared nothing");
  const KVStore& full = *pv.full;
  const int L = full.n_layers(), NKV = full.n_kv_heads();
  const int T = pv.prompt_len;
  const std::vector<SegmentKind>& kinds = *pv.kinds;
  int first_visual = -1, n_visual = 0;
  for (int t = 0; t < T; ++t)
    if (kinds[t] == SegmentKind::Visual) {
      if (first_visual < 0) first_visual = t;
      ++n_visual;
    }
  std::vector<LayerDiagnostics> out(L);
  // Layers are independent (each reads its own entries and rows, writes its own result): on
  // threads of their own.
  parallel_for(L, 8, [&](int l) {
    LayerDiagnostics& d = out[l];
    d.layer = l;
    d.bytes = compressed.bytes(l);
    VisualScores& histo = d.visual_score_samples;
    int n_terms = 0, n_sparse = 0;
    PromptRows prompt;  // the full store's rows of this layer, for entries that kept rows
    for (const auto& E : method.entries()) {
      if (E.layer != l) continue;
      const int H = E.n_heads, G = H / E.n_kv_heads, n_k = E.n_k;
      for (auto* k : {&histo.exact, &histo.quantized, &histo.calibrated, &histo.every})
        if (k->size() < static_cast<size_t>(H)) k->resize(H);
      QueryComparison own;
      if (!E.compared) {
        if (prompt.k.empty()) prompt = prompt_rows(full, l, T);
        const AttentionEvent e = event_of(E);
        own = compare_query(e,
                            exact_attention(E.q.data(), H, E.head_dim, 1.0f / std::sqrt(static_cast<float>(E.head_dim)),
                                            prompt,
                                            rows_from(E.k.data(), E.v.data(), E.key_pos.data(), E.n_kv_heads, n_k,
                                                      E.head_dim, T)),
                            kinds, E.step == 0);
      }
      const QueryComparison& c = E.compared ? E.comparison : own;
      for (int h = 0; h < H; ++h) {
        if (E.step == 0 && !c.visual.exact.empty()) {
          histo.exact.at(h).insert(histo.exact[h].end(), c.visual.exact[h].begin(), c.visual.exact[h].end());
          histo.quantized.at(h).insert(histo.quantized[h].end(), c.visual.quantized[h].begin(),
                                       c.visual.quantized[h].end());
          histo.calibrated.at(h).insert(histo.calibrated[h].end(), c.visual.calibrated[h].begin(),
                                        c.visual.calibrated[h].end());
          histo.every.at(h).insert(histo.every[h].end(), c.visual.every[h].begin(), c.visual.every[h].end());
        }
        d.softmax_mse += c.softmax_mse[h];
        d.softmax_kl += c.softmax_kl[h];
        d.output_rel_error += c.output_rel_error[h];
        ++n_terms;
        const int32_t* kp = E.key_pos.data() + static_cast<size_t>(h / G) * n_k;
        const float* mp = E.probs.data() + static_cast<size_t>(h) * n_k;
        std::vector<float> valid;
        for (int j = 0; j < n_k; ++j)
          if (kp[j] >= 0) valid.push_back(mp[j]);
        d.sparsity_decode += sparsity(valid.data(), 1, 1, static_cast<int>(valid.size()), p);
        ++n_sparse;
      }
    }
    if (n_terms) {
      d.softmax_mse /= n_terms;
      d.softmax_kl /= n_terms;
      d.output_rel_error /= n_terms;
    }
    if (n_sparse) d.sparsity_decode /= n_sparse;
    d.visual_scores = visual_score_histogram(histo, -1, hist_bins);
    // Token fate over the visual tokens.
    d.fate_kept.assign(n_visual, 0.0f);
    d.fate_bits.assign(n_visual, 0.0f);
    d.fate_merged.assign(n_visual, 0.0f);
    std::vector<int> kept_rows(n_visual, 0);
    for (const KVSegment& s : compressed.layer(l).segments)
      for (const HeadRows& r : s.heads)
        for (int i = 0; i < r.n(); ++i) {
          const int pos = r.pos[i];
          if (pos < 0 || pos >= T || kinds[pos] != SegmentKind::Visual) continue;
          const int vi = pos - first_visual;
          kept_rows[vi]++;
          // Rows appended after an annotation was written have none: read them as the storage
          // label says and as nothing merged.
          const size_t ui = static_cast<size_t>(i);
          d.fate_bits[vi] += ui < r.bits.size() ? (r.bits[ui] ? r.bits[ui] : 32) : storage_bits(s.storage);
          d.fate_merged[vi] += ui < r.merged.size() ? r.merged[ui] : 0.0f;
        }
    for (int i = 0; i < n_visual; ++i) {
      d.fate_kept[i] = static_cast<float>(kept_rows[i]) / NKV;
      if (kept_rows[i]) {
        d.fate_bits[i] /= kept_rows[i];
        d.fate_merged[i] /= kept_rows[i];
      }
    }
  });
  return out;
}

FirstDivergence first_divergence(const std::vector<int>& full_ids, const std::vector<float>& full_probs,
                                 const std::vector<int>& ids, const std::vector<float>& probs) {
  FirstDivergence f;
  const size_t n = std::max(full_ids.size(), ids.size());
  for (size_t i = 0; i < n; ++i) {
    const int a = i < full_ids.size() ? full_ids[i] : -1, b = i < ids.size() ? ids[i] : -1;
    if (a != b) {
      f.position = static_cast<int>(i);
      f.full_token = a;
      f.method_token = b;
      f.full_prob = i < full_probs.size() ? full_probs[i] : 0.0f;
      f.method_prob = i < probs.size() ? probs[i] : 0.0f;
      break;
    }
  }
  return f;
}

namespace {

// The query-row sets of cache_hit_rates's strategies (hit_rate_query_starts), each to the end.
std::vector<PrefillAttention::QueryRows> hit_rate_rows(const PrefillView& pv, int window_queries) {
  const int T = pv.prompt_len;
  std::vector<PrefillAttention::QueryRows> sets;
  for (int from : hit_rate_query_starts(pv, window_queries)) sets.push_back({AttentionReduction::range(from, T, T)});
  return sets;
}

}  // namespace

HitTruth hit_rate_truth(const PrefillView& pv, const DecodeRecorder& full, double budget,
                        const std::vector<int>& steps) {
  HitTruth t;
  const int T = pv.prompt_len, L = pv.full->n_layers(), KH = pv.full->n_kv_heads();
  t.k = budget_rows(budget, T);
  for (int s : steps)
    if (full.find(s, 0)) t.steps.push_back(s);
  const size_t S = t.steps.size();
  t.layer.assign(S, std::vector<std::vector<int>>(static_cast<size_t>(L)));
  t.head.assign(S, std::vector<std::vector<std::vector<int>>>(static_cast<size_t>(L)));
  // Every (step, layer) side by side on the team (core/team.h; each writes its own entries).
  team_each(static_cast<int64_t>(S) * L, product_threads(), [&](int64_t x) {
    const size_t si = static_cast<size_t>(x / L);
    const int l = static_cast<int>(x % L);
    const auto* E = full.find(t.steps[si], l);
    if (!E) throw InternalError("cache_hit_rates: no decode attention for step " + std::to_string(t.steps[si]));
    // A_{m+1} = softmax(q K_{:m}ᵀ/√d) over the prompt keys alone: each query head's
    // probabilities of the prompt keys renormalised to sum to 1 (the decode query also sees the
    // generated keys), then averaged over the layer's heads (layer level) or over the query
    // heads of each KV head (per KV head).
    const int GE = E->n_heads / E->n_kv_heads;
    std::vector<std::vector<double>> truth(E->n_kv_heads, std::vector<double>(T, 0.0));
    std::vector<double> truth_layer(T, 0.0);
    for (int h = 0; h < E->n_heads; ++h) {
      double mass = 0.0;
      for (int pass = 0; pass < 2; ++pass)
        for (int j = 0; j < E->n_k; ++j) {
          const int32_t pos = E->key_pos[static_cast<size_t>(h / GE) * E->n_k + j];
          if (pos < 0 || pos >= T) continue;
          const double p = E->probs[static_cast<size_t>(h) * E->n_k + j];
          if (pass == 0) {
            mass += p;
          } else if (mass > 0.0) {
            truth[h / GE][pos] += p / mass / GE;
            truth_layer[pos] += p / mass / E->n_heads;
          }
        }
    }
    t.layer[si][static_cast<size_t>(l)] = top_k(truth_layer, t.k);
    std::vector<std::vector<int>>& heads = t.head[si][static_cast<size_t>(l)];
    heads.resize(static_cast<size_t>(KH));
    for (int g = 0; g < KH; ++g) heads[static_cast<size_t>(g)] = top_k(truth.at(g), t.k);
  });
  return t;
}

HitRates cache_hit_rates(const PrefillView& pv, const DecodeRecorder& full, double budget,
                         const std::vector<int>& steps, int window_queries) {
  return cache_hit_rates(pv, hit_rate_truth(pv, full, budget, steps), window_queries);
}

HitRates cache_hit_rates(const PrefillView& pv, const HitTruth& truth, int window_queries) {
  HitRates hr;
  hr.strategies = {"accumulated", "normalized", "sliding_window", "post_vision", "recency"};
  const int T = pv.prompt_len, H = pv.n_heads, L = pv.full->n_layers(), KH = pv.full->n_kv_heads();
  const int G = KH > 0 ? H / KH : 1;
  const size_t S = hr.strategies.size();
  hr.k = truth.k;
  hr.steps = truth.steps;
  const auto zeros = std::vector<std::vector<double>>(hr.steps.size(), std::vector<double>(L, 0.0));
  hr.rates.assign(S, zeros);
  hr.rates_head.assign(S, zeros);
  // |x ∩ y| / k of two top-k sets (ascending).
  auto hit = [&](const std::vector<int>& x, const std::vector<int>& y) {
    std::vector<int> both;
    std::set_intersection(x.begin(), x.end(), y.begin(), y.end(), std::back_inserter(both));
    return static_cast<double>(both.size()) / hr.k;
  };
  const std::array<int, 3> from = hit_rate_query_starts(pv, window_queries);
  constexpr size_t kSets = 3;  // (accumulated, and from it normalized; sliding window; post vision)
  const std::array<std::pair<size_t, int>, kSets> sums_from = {{{0, from[0]}, {2, from[1]}, {3, from[2]}}};
  // Every layer's column sums over each strategy's queries in one pass (a capture on a device
  // recomputes each layer once for the three sets, and waits once).
  pv.attention->prepare_every_layer(hit_rate_rows(pv, window_queries));
  // sums[l][set]: layer l's column sums [H][T] over the queries of sums_from[set], reduced where
  // the attention is, layer by layer (the capture's backend takes one caller at a time); a
  // capture that keeps its reductions shares the arrays it keeps.
  std::vector<std::array<std::shared_ptr<const std::vector<double>>, kSets>> sums(static_cast<size_t>(L));
  {
    trace::Scope span("hit_rates.reduce");
    for (int l = 0; l < L; ++l)
      for (size_t set = 0; set < kSets; ++set)
        sums[static_cast<size_t>(l)][set] =
            pv.attention->column_sums(l, AttentionReduction::range(sums_from[set].second, T, T));
  }
  // score[strategy][j] of KV head g of layer l (the mean over its query heads), from each query
  // head's column sums over the strategy's queries, each head's in ascending order.
  auto head_score = [&](int l, int g, std::vector<std::vector<double>>& score) {
    score.assign(S, std::vector<double>(static_cast<size_t>(T), 0.0));
    for (size_t set = 0; set < kSets; ++set) {
      const size_t st = sums_from[set].first;
      const std::vector<double>& layer_sums = *sums[static_cast<size_t>(l)][set];
      for (int h = g * G; h < (g + 1) * G; ++h)
        for (int j = 0; j < T; ++j) score[st][j] += layer_sums[static_cast<size_t>(h) * T + j] / G;
    }
    for (int j = 0; j < T; ++j) {
      score[1][j] = score[0][j] / (T - j);
      score[4][j] = j;
    }
  };
  // The rankings and hits, KH + 1 units a layer side by side on the team (core/team.h; each
  // writes its own entries): unit g < KH ranks KV head g's strategies (the same at every step)
  // and meets them with its truth at each step; unit KH the layer level, whose strategies are the
  // mean over KV heads of the group means (the mean over query heads). The per-KV-head rate is
  // then the mean of the heads' hits, in head order.
  const size_t NS = hr.steps.size();
  std::vector<double> head_hits(static_cast<size_t>(L) * KH * S * NS, 0.0);  // [layer][g][strategy][step]
  {
    trace::Scope rank_span("hit_rates.rank");
    team_each(static_cast<int64_t>(L) * (KH + 1), product_threads(), [&](int64_t x) {
      const int l = static_cast<int>(x / (KH + 1)), u = static_cast<int>(x % (KH + 1));
      std::vector<std::vector<double>> score;
      if (u < KH) {
        head_score(l, u, score);
        for (size_t st = 0; st < S; ++st) {
          const std::vector<int> top = top_k(score[st], hr.k);
          for (size_t si = 0; si < NS; ++si)
            head_hits[((static_cast<size_t>(l) * KH + u) * S + st) * NS + si] =
                hit(top, truth.head[si][static_cast<size_t>(l)][static_cast<size_t>(u)]);
        }
        return;
      }
      std::vector<std::vector<double>> layer(S, std::vector<double>(static_cast<size_t>(T), 0.0));
      for (int g = 0; g < KH; ++g) {
        head_score(l, g, score);
        for (size_t st = 0; st < S; ++st)
          for (int j = 0; j < T; ++j) layer[st][j] += score[st][j] / KH;
      }
      for (size_t st = 0; st < S; ++st) {
        const std::vector<int> top = top_k(layer[st], hr.k);
        for (size_t si = 0; si < NS; ++si) hr.rates[st][si][l] = hit(top, truth.layer[si][static_cast<size_t>(l)]);
      }
    });
  }
  for (int l = 0; l < L; ++l)
    for (size_t st = 0; st < S; ++st)
      for (size_t si = 0; si < NS; ++si) {
        double sum = 0.0;
        for (int g = 0; g < KH; ++g) sum += head_hits[((static_cast<size_t>(l) * KH + g) * S + st) * NS + si];
        hr.rates_head[st][si][l] = sum / KH;
      }
  return hr;
}

std::array<int, 3> hit_rate_query_starts(const PrefillView& pv, int window_queries) {
  const int T = pv.prompt_len;
  int last_visual = -1;
  for (int t = 0; t < T; ++t)
    if ((*pv.kinds)[t] == SegmentKind::Visual) last_visual = t;
  const int post_from = (last_visual >= 0 && last_visual + 1 < T) ? last_visual + 1 : T - 1;
  return {0, std::max(0, T - window_queries), post_from};
}

void prepare_prefill_diagnostics(const PrefillView& pv, double p, int window_queries) {
  const int T = pv.prompt_len;
  // The sparsity's rows (every row, with the counts), then the hit rates' other sets.
  std::vector<PrefillAttention::QueryRows> sets{{AttentionReduction::range(0, T, T), p, false}};
  for (PrefillAttention::QueryRows& q : hit_rate_rows(pv, window_queries))
    if (q.queries != sets.front().queries) sets.push_back(std::move(q));
  pv.attention->prepare_every_layer(sets);
}

nlohmann::json diagnostic_definitions() {
  return {
      {"softmax_mse", "mean over the exact keys j of (P_full(j) - P_method(j))^2, P = decode attention "
                      "probabilities (P_method(j) = 0 for an evicted key); mean over query heads and steps"},
      {"softmax_kl", "KL(full || method) = sum_j P_full(j) * ln(P_full(j) / max(P_method(j), 1e-10)): the "
                     "full cache is the reference distribution; mean over query heads and steps"},
      {"attn_output_rel_error", "||o_method - o_full||_2 / ||o_full||_2 (norm ratio), o = sum_j P(j) v_j; "
                                "mean over query heads and steps"},
      {"sparsity_decode", "share of the method's decode attention entries below p * (row max), p = options.sparsity_p"},
      {"visual_score_histogram", "first decode step, pre-softmax scores q.k/sqrt(d) of the visual keys: exact "
                                 "(full keys), quantized (method keys), calibrated (after the method's score "
                                 "transform); bins of one shared [lo, hi]"},
      {"cache_hit_rate", "|top-k by strategy & top-k by truth| / k, k = floor(hit_budget * prompt length), at least "
                         "1, ties to the earlier token; truth = decode attention over the prompt keys, each head "
                         "renormalised to sum 1; strategies score keys by prefill attention: accumulated sum_i A_ij, "
                         "normalized sum_i A_ij / (T - j), sliding_window over the last hit_window queries, "
                         "post_vision over the queries after the last visual token, recency = position; rates: "
                         "strategy and truth the mean over every query head of the layer; rates_per_kv_head: the "
                         "mean over the query heads of one KV head, ranked per KV head, averaged over KV heads"},
  };
}

nlohmann::json to_json(const KVBytes& b) {
  return {{"codes", b.codes}, {"scales", b.scales}, {"zeros", b.zeros}, {"indices", b.indices},
          {"meta", b.meta}, {"total", b.total()}};
}

nlohmann::json to_json(const LayerDiagnostics& d) {
  nlohmann::json j;
  j["layer"] = d.layer;
  j["softmax_mse"] = d.softmax_mse;
  j["softmax_kl"] = d.softmax_kl;
  j["attn_output_rel_error"] = d.output_rel_error;
  j["sparsity_decode"] = d.sparsity_decode;
  j["visual_score_histogram"] = {{"lo", d.visual_scores.lo}, {"hi", d.visual_scores.hi},
                                 {"exact", d.visual_scores.exact}, {"quantized", d.visual_scores.quantized},
                                 {"calibrated", d.visual_scores.calibrated}};
  const ScoreRanges r = score_range_by_head(d.visual_score_samples);
  j["visual_score_range_by_head"] = {{"gamma", r.gamma}, {"delta", r.delta}};
  j["token_fate"] = {{"kept", d.fate_kept}, {"bits", d.fate_bits}, {"merged", d.fate_merged}};
  j["bytes"] = to_json(d.bytes);
  return j;
}

nlohmann::json to_json(const HitRates& h) {
  nlohmann::json j;
  j["k"] = h.k;
  j["steps"] = h.steps;
  for (size_t s = 0; s < h.strategies.size(); ++s) {
    j["rates"][h.strategies[s]] = h.rates[s];
    j["rates_per_kv_head"][h.strategies[s]] = h.rates_head[s];
  }
  j["definitions"] = {
      {"rates", "layer level (VL-Cache 3.2): top-k of the strategy score vs top-k of the decode attention, "
                "both the mean over every query head of the layer; |both| / k"},
      {"rates_per_kv_head", "per KV head: strategy score and decode attention both the mean over the query "
                            "heads of one KV head, top-k each per KV head, |both| / k averaged over KV heads"},
      {"k", "floor(hit_budget * prompt length), at least 1; ties go to the earlier token"}};
  return j;
}

}  // namespace kvlens
