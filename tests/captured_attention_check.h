// One check of the prefill's captured attention, on any backend: each layer's probabilities,
// recomputed on demand from the captured queries, keys and values, equal bit for bit the ones the
// prefill's attention handed its observers; the capture holds O(layers · tokens · head_dim) and
// at most two layers' probabilities stay on the host.
#pragma once
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/data/image.h"
#include "models/model.h"

namespace kvlens::testing {

class PrefillProbsRecorder final : public AttentionObserver {
 public:
  void on_attention(const AttentionEvent& e) override {
    if (e.phase != Phase::Prefill) return;
    by_layer[e.layer].assign(e.probs, e.probs + static_cast<size_t>(e.n_heads) * e.n_q * e.n_k);
  }
  std::map<int, std::vector<float>> by_layer;
};

inline void check_captured_attention(const Model& m, const RGBImage& img, const std::string& what) {
  PrefillProbsRecorder rec;
  const PrefillState st = m.prefill(img, kDefaultPrompt, kDefaultTemplate, true, {&rec});
  ASSERT_TRUE(st.capture.attention) << what;
  const PrefillAttention& a = *st.capture.attention;
  const ModelInfo& f = m.info();
  const int L = f.n_layers, T = static_cast<int>(st.ids.size());
  ASSERT_EQ(a.n_layers(), L) << what;
  ASSERT_EQ(a.n_heads(), f.n_heads) << what;
  ASSERT_EQ(a.prompt_len(), T) << what;
  ASSERT_EQ(static_cast<int>(rec.by_layer.size()), L) << what;
  // Each layer's q, k and v after RoPE, fp32: O(L·T·d), never a [T][T] array.
  const int64_t row = static_cast<int64_t>(f.n_heads + 2 * f.n_kv_heads) * f.head_dim;
  EXPECT_EQ(a.capture_bytes(), static_cast<int64_t>(L) * T * row * 4) << what;
  const int64_t layer_bytes = static_cast<int64_t>(f.n_heads) * T * T * 4;
  // Every layer, then the first again after the others pushed it out of the cache.
  for (int l : {0, 1, 2, 3, 0}) {
    if (l >= L) continue;
    const auto p = a.probs(l);
    ASSERT_TRUE(p) << what;
    EXPECT_TRUE(*p == rec.by_layer.at(l)) << what << ": layer " << l << " differs from the prefill's";
    EXPECT_LE(a.cached_bytes(), 2 * layer_bytes) << what << ": more than two layers held";
  }
  for (int l = 4; l < L; ++l) EXPECT_TRUE(*a.probs(l) == rec.by_layer.at(l)) << what << ": layer " << l;
  EXPECT_LE(a.cached_bytes(), 2 * layer_bytes) << what;
  // The contexts a method reads see the same probabilities.
  const std::vector<PrefillContext> cs = m.prefill_contexts(st);
  ASSERT_EQ(static_cast<int>(cs.size()), L);
  EXPECT_TRUE(*cs.back().probs() == rec.by_layer.at(L - 1)) << what;
}

}  // namespace kvlens::testing
