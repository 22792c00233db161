// Attention observers: see each layer's per-head pre-softmax scores and probabilities in
// prefill and in every decode step. The model computes and hands these over only when an
// observer is attached, so an empty observer list costs nothing.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/exact_attention.h"
#include "core/kv_store.h"
#include "core/prefill_attention.h"

namespace kvlens {

enum class Phase { Prefill, Decode };

struct AttentionEvent {
  Phase phase = Phase::Prefill;
  int layer = 0;
  int step = 0;          // decode step (0 = first generated token's forward), 0 in prefill
  int n_heads = 0;       // query heads
  int n_kv_heads = 0;
  int n_q = 0;           // queries in this event (prompt length in prefill, 1 in decode)
  int n_k = 0;           // keys seen by each head (same for all heads)
  // [n_heads][n_q][n_k]; masked entries are -inf in scores and 0 in probs.
  const float* scores = nullptr;
  const float* probs = nullptr;
  const int32_t* query_pos = nullptr;            // [n_q]
  const int32_t* key_pos = nullptr;              // [n_kv_heads][n_k]
  const SegmentKind* key_kind = nullptr;         // [n_kv_heads][n_k]
  // Query vectors after RoPE, [n_q][n_heads][head_dim], and the keys [n_kv_heads][n_k][head_dim].
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;  // values, laid out as k
  int head_dim = 0;
  // What a device hands over to an observer that compares decode queries with the exact
  // attention (AttentionObserver::compares_to), in place of the rows (null: not given): the
  // scores before the score transform (laid out as scores), the method's attention output in
  // fp32 [n_heads][head_dim], and the query's exact attention (core/exact_attention.h).
  const float* raw_scores = nullptr;
  const float* out = nullptr;
  const ExactAttention* exact = nullptr;
};

class AttentionObserver {
 public:
  virtual ~AttentionObserver() = default;
  virtual void on_attention(const AttentionEvent& e) = 0;
  // The decode steps this observer reads: 0 .. decode_steps() − 1. A decode hands later steps
  // to no one and runs them as it would unobserved (on a device: plain steps, no host rows).
  virtual int decode_steps() const { return std::numeric_limits<int>::max(); }
  // Whether it reads decode step `step` (< decode_steps()). One that reads a few steps of that
  // range says which: the steps between run as unobserved ones do (on a device: plain steps,
  // their rows fetched to the host store together before the next observed step).
  virtual bool reads_step(int step) const { return step < decode_steps(); }
  // Whether it reads a decode event's keys and values (AttentionEvent::k, v). Without them an
  // event carries scores, probabilities, the query, and the keys' positions and kinds, and
  // k / v are null: gathering every layer's rows at every step is what costs a decode most.
  virtual bool reads_decode_kv() const { return true; }
  // The prefill attention whose capture this observer compares each decode query with (null:
  // none). A backend that computes the exact attention from that capture hands it over in the
  // event with raw_scores and out, and then gathers no rows for this observer.
  virtual const PrefillAttention* compares_to() const { return nullptr; }
  // Whether it reads of a decode event the probabilities, scores, positions and kinds alone (no
  // query, keys, values, raw scores, output or exact attention), and takes the events of its
  // decode steps in any order and after later steps have run. A device may then record the
  // step's queries and hand its events over once the caption is done (Backend::
  // records_decode_queries): the step runs as an unobserved one does.
  virtual bool reads_probabilities_only() const { return false; }
  // Whether on_attention (and on_span_attention) may be called for different layers and steps
  // from several threads at once, in any order. One that says so keeps what it records in an
  // order that does not depend on the order of the calls. Steps whose every observer says so
  // may have their layers' events handed over in parallel, several steps at once.
  virtual bool takes_concurrent_events() const { return false; }
  // The span of key positions (first .. first + n − 1; n = 0: none) whose probabilities, summed
  // by position for each query head (span_attention_sums), are all this observer reads of a
  // decode event; with reads_probabilities_only. A device may then hand it recorded steps as
  // those sums alone (on_span_attention), reduced where the cache is.
  struct Span {
    int first = 0, n = 0;
  };
  virtual Span reads_span() const { return {}; }
  // Recorded decode step `step`'s sums at `layer`: [n_heads][reads_span().n]. Called for several
  // steps or layers from several threads at once only when takes_concurrent_events says so.
  virtual void on_span_attention(int step, int layer, int n_heads, const float* sums) {}
};

// A decode event's probabilities summed by key position over first .. first + n − 1, per query
// head: out [n_heads][n] (query head h reads KV head h / (n_heads / n_kv_heads)'s positions).
inline void span_attention_sums(const float* probs, const int32_t* key_pos, int n_heads, int n_kv_heads, int n_k,
                                int first, int n, float* out) {
  std::fill(out, out + static_cast<size_t>(n_heads) * n, 0.0f);
  const int G = n_heads / n_kv_heads;
  for (int h = 0; h < n_heads; ++h) {
    const int32_t* kp = key_pos + static_cast<size_t>(h / G) * n_k;
    const float* p = probs + static_cast<size_t>(h) * n_k;
    float* o = out + static_cast<size_t>(h) * n;
    for (int j = 0; j < n_k; ++j) {
      const int64_t i = static_cast<int64_t>(kp[j]) - first;
      if (kp[j] >= 0 && i >= 0 && i < n) o[i] += p[j];
    }
  }
}

// The observers among `all` that read decode step `step`.
inline std::vector<AttentionObserver*> decode_observers(const std::vector<AttentionObserver*>& all, int step) {
  std::vector<AttentionObserver*> out;
  for (AttentionObserver* o : all)
    if (o->reads_step(step)) out.push_back(o);
  return out;
}

// The number of decode steps any of `all` reads (0 when none does).
inline int observed_decode_steps(const std::vector<AttentionObserver*>& all) {
  int n = 0;
  for (const AttentionObserver* o : all) n = std::max(n, o->decode_steps());
  return n;
}

}  // namespace kvlens
