// The decode's observed steps handed over after they ran: steps put off to compare with the
// capture together (hand_over_stashed) and steps whose queries were recorded on the device
// (hand_over_recorded).
#include <algorithm>

#include "core/errors.h"
#include "core/parallel.h"
#include "models/llama.h"
#include "core/trace.h"

namespace kvlens {

namespace {

// Whether every one of `observers` takes events of several layers and steps at once.
bool take_concurrent_events(const std::vector<AttentionObserver*>& observers) {
  return std::all_of(observers.begin(), observers.end(),
                     [](const AttentionObserver* o) { return o->takes_concurrent_events(); });
}

}  // namespace

DecodeTaps LlamaDecoder::size_taps(const KVStore& host, int l, bool raw_out, LayerTaps& t) const {
  const int NH = cfg.num_attention_heads;
  t.n_max = 0;
  for (int h = 0; h < cfg.num_key_value_heads; ++h) t.n_max = std::max(t.n_max, host.n_rows(l, h));
  t.scores.resize(static_cast<size_t>(NH) * t.n_max);
  t.probs.resize(t.scores.size());
  DecodeTaps d;
  d.scores = t.scores.data();
  d.probs = t.probs.data();
  d.n_max = t.n_max;
  if (raw_out) {
    t.raw.resize(t.scores.size());
    t.out.resize(static_cast<size_t>(NH) * cfg.head_dim);
    d.raw_scores = t.raw.data();
    d.out = t.out.data();
  }
  return d;
}

void LlamaDecoder::take_positions(const KVStore& host, int l, LayerTaps& t) const {
  const int NKV = cfg.num_key_value_heads;
  t.key_pos.assign(static_cast<size_t>(NKV) * t.n_max, -1);
  t.key_kind.assign(t.key_pos.size(), SegmentKind::Generated);
  std::vector<int32_t> P;
  std::vector<SegmentKind> S;
  for (int h = 0; h < NKV; ++h) {
    host.positions(l, h, P, S);
    std::copy(P.begin(), P.end(), t.key_pos.begin() + static_cast<size_t>(h) * t.n_max);
    std::copy(S.begin(), S.end(), t.key_kind.begin() + static_cast<size_t>(h) * t.n_max);
  }
}

AttentionEvent LlamaDecoder::layer_event(const RecordedAttention& t, int l, int step, const int32_t* pos,
                                         const float* q) const {
  AttentionEvent e;
  e.phase = Phase::Decode; e.layer = l; e.step = step; e.n_heads = cfg.num_attention_heads;
  e.n_kv_heads = cfg.num_key_value_heads; e.n_q = 1; e.n_k = t.n_max; e.scores = t.scores.data();
  e.probs = t.probs.data(); e.query_pos = pos; e.key_pos = t.key_pos.data(); e.key_kind = t.key_kind.data();
  e.q = q; e.head_dim = cfg.head_dim;
  return e;
}

AttentionEvent LlamaDecoder::layer_event(const LayerTaps& t, int l, int step, const int32_t* pos, const float* q) const {
  AttentionEvent e = layer_event(static_cast<const RecordedAttention&>(t), l, step, pos, q);
  if (!t.raw.empty()) e.raw_scores = t.raw.data();
  if (!t.out.empty()) e.out = t.out.data();
  return e;
}

void LlamaDecoder::each_layer(const std::vector<AttentionObserver*>& observers, const std::function<void(int)>& f) const {
  const int L = cfg.num_hidden_layers;
  if (L == 0) return;
  f(0);
  // The rest on threads of their own (core/parallel.h) where every observer takes concurrent
  // events: this is the host's side of a device step, not a CPU model's loops (which run on one
  // thread by default). Else in order, on this thread.
  const bool together = L > 2 && take_concurrent_events(observers);
  parallel_for(L - 1, together ? kStepEventThreads : 1, [&](int i) { f(i + 1); });
}

void LlamaDecoder::hand_over_stashed(LlamaWorkspace& w) const {
  const int S = static_cast<int>(w.stash.size());
  if (S == 0) return;
  trace::Scope span("decode.hand_over_stashed", S);
  const int L = cfg.num_hidden_layers;
  const AttnLayout lay = layout(1);
  const CapturedAttention& capture = *w.stash.front().capture;
  // The exact attention of every stashed step, kExactLayersAtOnce layers a call (those layers'
  // prompt q/k/v recomputed once and held meanwhile): the calls' queries copied together.
  std::vector<std::vector<ExactAttention>> exact(static_cast<size_t>(L));
  const int G = std::min(kExactLayersAtOnce, L);
  if (w.exact_q.rows() < static_cast<int64_t>(G) * S)
    w.exact_q = be->alloc("step.exact_queries", {static_cast<int64_t>(G) * LlamaWorkspace::kStashSlots, lay.row_stride},
                          Dt::F32);
  for (int l0 = 0; l0 < L; l0 += G) {
    const int n = std::min(G, L - l0);
    std::vector<Buffer> held;
    for (int l = l0; l < l0 + n; ++l) held.push_back(capture.layer_qkv(l));
    std::vector<const Buffer*> prompts;
    std::vector<ExtraRows> extras;
    for (int l = l0; l < l0 + n; ++l) {
      // The layer's S stashed queries (slots 0 .. S − 1) are jobs (l − l0)·S .. (l − l0)·S + S − 1.
      be->copy_block(w.stash_q, static_cast<int64_t>(l) * LlamaWorkspace::kStashSlots, 0, w.exact_q,
                     static_cast<int64_t>(l - l0) * S, 0, S, lay.row_stride);
      for (int s = 0; s < S; ++s) {
        prompts.push_back(&held[static_cast<size_t>(l - l0)]);
        extras.push_back(std::move(w.stash[static_cast<size_t>(s)].layers[static_cast<size_t>(l)].extra));
      }
    }
    std::vector<ExactAttention> part;
    trace::Scope exact_span("decode.exact_of_stashed", n);
    if (!be->exact_decode_attention_layers(w.exact_q.row_view(0, n * S), lay, prompts, capture.layout(), extras, part))
      throw InternalError("decode: the " + be->name() + " backend put observed steps off and computes no exact attention");
    for (int l = l0; l < l0 + n; ++l)
      for (int s = 0; s < S; ++s) exact[static_cast<size_t>(l)].push_back(std::move(part[static_cast<size_t>((l - l0) * S + s)]));
  }
  // Every stashed step's layers at once where every observer takes concurrent events (each
  // event's comparison is the host's work alone), else in (step, layer) order on this thread.
  const bool together = std::all_of(w.stash.begin(), w.stash.end(),
                                    [](const StashedStep& st) { return take_concurrent_events(st.observers); });
  trace::Scope events("decode.stashed_events", S);
  parallel_for(S * L, together ? kEventThreads : 1, [&](int i) {
    const int s = i / L, l = i % L;
    const StashedStep& st = w.stash[static_cast<size_t>(s)];
    AttentionEvent e = layer_event(st.layers[static_cast<size_t>(l)], l, st.step, &st.pos,
                                   st.q.data() + static_cast<size_t>(l) * lay.row_stride);
    e.exact = &exact[static_cast<size_t>(l)][static_cast<size_t>(s)];
    for (AttentionObserver* o : st.observers) o->on_attention(e);
  });
  w.stash.clear();
}

void LlamaDecoder::hand_over_recorded(SeqKV& kv, const std::vector<int>& steps, const std::vector<int32_t>& positions,
                                      KVPolicy* policy, const std::vector<AttentionObserver*>& observers,
                                      LlamaWorkspace& w) const {
  const int n = static_cast<int>(steps.size());
  if (n == 0) return;
  trace::Scope traced("decode.hand_over_recorded", n);
  if (n > w.record_slots || positions.size() != steps.size())
    throw InternalError("decode: more recorded steps than slots, or steps and positions differ");
  const int NH = cfg.num_attention_heads, D = cfg.head_dim;
  // The recorded rows hold q alone: a layout whose rows are n_heads · head_dim wide, q first.
  AttnLayout ql = layout(n);
  ql.q_col = 0;
  ql.row_stride = static_cast<int64_t>(NH) * D;
  const ScoreTransform transform = policy ? policy->score_transform() : ScoreTransform{};
  const bool together = take_concurrent_events(observers);
  // A chunk of steps a call, so that their scores (on the backend) and events (here) stay near
  // 256 MB however long the caption: each query's scores, transformed scores and probabilities
  // over at most positions.back() + 1 keys (the span's sums: batches of at most 256 MB, below).
  const int64_t per_query = static_cast<int64_t>(NH) * (positions.back() + 1) * 12;
  const int chunk = static_cast<int>(std::clamp<int64_t>(kHandOverBytes / std::max<int64_t>(per_query, 1), 1, n));
  // Observers that read one span's sums alone (the patch overlay) take them reduced where the
  // cache is, when every observer of these steps reads the same span and the backend can.
  AttentionObserver::Span span;
  bool by_span = true;
  for (AttentionObserver* o : observers) {
    if (std::none_of(steps.begin(), steps.end(), [&](int s) { return o->reads_step(s); })) continue;
    const AttentionObserver::Span x = o->reads_span();
    if (span.n == 0) span = x;
    by_span = by_span && x.n > 0 && x.first == span.first && x.n == span.n;
  }
  by_span = by_span && span.n > 0;
  // The span's sums of every layer and chunk of steps queued on the backend and landing together,
  // one wait for each batch of at most 256 MB of sums; each batch is handed over, then freed.
  if (by_span) {
    struct Part {
      int l = 0, c0 = 0;
      std::vector<int32_t> at;
      std::vector<float> sums;  // (written when the queued sums land: parts are not moved after)
    };
    std::vector<Part> parts;
    for (int l = 0; l < cfg.num_hidden_layers; ++l)
      for (int c0 = 0; c0 < n; c0 += chunk)
        parts.push_back(Part{l, c0, std::vector<int32_t>(positions.begin() + c0, positions.begin() + std::min(n, c0 + chunk)), {}});
    const size_t per = static_cast<size_t>(NH) * span.n;
    auto hand_over = [&](size_t first, size_t end) {
      std::vector<std::pair<Part*, int>> items;
      for (size_t x = first; x < end; ++x)
        for (int i = 0; i < static_cast<int>(parts[x].at.size()); ++i) items.emplace_back(&parts[x], i);
      auto one = [&](int k) {
        const auto& [p, i] = items[static_cast<size_t>(k)];
        const int step = steps[static_cast<size_t>(p->c0 + i)];
        for (AttentionObserver* o : observers)
          if (o->reads_step(step)) o->on_span_attention(step, p->l, NH, p->sums.data() + static_cast<size_t>(i) * per);
      };
      parallel_for(static_cast<int>(items.size()), together ? kEventThreads : 1, one);
      for (size_t x = first; x < end; ++x) std::vector<float>().swap(parts[x].sums);
    };
    // Batch by batch: queued and landed while another thread's ops wait (queue_then_finish holds
    // the backend), then handed over without the backend held.
    for (size_t first = 0; by_span && first < parts.size();) {
      size_t end = first;
      be->queue_then_finish([&] {
        trace::Scope queue_span("decode.recorded_queue");
        int64_t queued = 0;
        for (; end < parts.size(); ++end) {
          Part& p = parts[end];
          const int64_t bytes = static_cast<int64_t>(p.at.size()) * NH * span.n * 4;
          if (queued > 0 && queued + bytes > kHandOverBytes) break;
          queued += bytes;
          const Buffer q_rows = w.recorded_q.row_view(static_cast<int64_t>(p.l) * w.record_slots + p.c0,
                                                      static_cast<int64_t>(p.at.size()));
          by_span = be->recorded_span_attention(kv, p.l, q_rows, ql, p.at, &transform, span.first, span.n, p.sums);
          if (!by_span) return;  // (the first call says so: nothing queued)
        }
      });
      if (by_span) hand_over(first, end);
      first = end;
    }
    if (by_span) return;
  }
  std::vector<RecordedAttention> rec;
  for (int l = 0; l < cfg.num_hidden_layers; ++l)
    for (int c0 = 0; c0 < n; c0 += chunk) {
      const int m = std::min(chunk, n - c0);
      const std::vector<int32_t> at(positions.begin() + c0, positions.begin() + c0 + m);
      const Buffer q_rows = w.recorded_q.row_view(static_cast<int64_t>(l) * w.record_slots + c0, m);
      be->recorded_attention(kv, l, q_rows, ql, at, &transform, rec);
      parallel_for(m, together ? kEventThreads : 1, [&](int i) {
        const AttentionEvent e =
            layer_event(rec[static_cast<size_t>(i)], l, steps[static_cast<size_t>(c0 + i)], &at[static_cast<size_t>(i)], nullptr);
        for (AttentionObserver* o : observers)
          if (o->reads_step(e.step)) o->on_attention(e);
      });
    }
}

}  // namespace kvlens
