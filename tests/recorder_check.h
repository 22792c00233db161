// Decode recorders in tests: the overlay's recorder that counts how its steps came, and one
// check on any backend: every event `rec` kept equals the event of the same step and layer that
// `all` (an observer of every step, with rows) kept, its rows included when `rec` keeps rows and
// absent otherwise.
#pragma once
#include <gtest/gtest.h>

#include <atomic>

#include "core/diagnostics/diagnostics.h"

namespace kvlens::testing {

// The overlay's recorder, counting how its recorded steps came: as span sums or as events.
class CountingRecorder final : public VisualAttentionRecorder {
 public:
  using VisualAttentionRecorder::VisualAttentionRecorder;
  void on_attention(const AttentionEvent& e) override {
    ++events;
    VisualAttentionRecorder::on_attention(e);
  }
  void on_span_attention(int step, int layer, int n_heads, const float* sums) override {
    ++spans;
    VisualAttentionRecorder::on_span_attention(step, layer, n_heads, sums);
  }
  std::atomic<int> events{0}, spans{0};
};

inline void expect_events_of(const DecodeRecorder& rec, const DecodeRecorder& all) {
  for (const auto& e : rec.entries()) {
    const auto* ref = all.find(e.step, e.layer);
    ASSERT_NE(ref, nullptr) << "step " << e.step << " layer " << e.layer;
    EXPECT_EQ(e.probs, ref->probs);
    EXPECT_EQ(e.scores, ref->scores);
    EXPECT_EQ(e.key_pos, ref->key_pos);
    EXPECT_EQ(e.q, ref->q);
    if (rec.keeps_rows()) {
      EXPECT_EQ(e.k, ref->k);
      EXPECT_EQ(e.v, ref->v);
    } else {
      EXPECT_TRUE(e.k.empty() && e.v.empty());
    }
  }
}

}  // namespace kvlens::testing
