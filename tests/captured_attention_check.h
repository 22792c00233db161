// One check of the prefill's captured attention, on any backend: each layer's probabilities,
// recomputed on demand from the captured projection inputs (the prefill's q/k/v projection and
// RoPE run again), equal bit for bit the ones the prefill's attention handed its observers; the capture holds O(layers · tokens · head_dim) and
// at most two layers' probabilities stay on the host; its reductions (column sums over chosen
// query rows, entries below a share of their row's maximum), made where the capture is, equal
// the host reference's on those probabilities bit for bit.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/attention_reduce.h"
#include "core/data/image.h"
#include "core/errors.h"
#include "models/llama.h"
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
  // Each layer's q/k/v projection input in the matrices' dtype, and the q, k and v after RoPE in
  // fp32 of as many layers as 64 MiB holds (at least two): O(L·T·d), never a [T][T] array.
  const int64_t row = static_cast<int64_t>(f.n_heads + 2 * f.n_kv_heads) * f.head_dim;
  const int64_t kept = std::min<int64_t>(L, std::max<int64_t>(2, (int64_t{64} << 20) / (T * row * 4)));
  EXPECT_EQ(a.capture_bytes(), static_cast<int64_t>(L) * T * f.hidden * f.matrix_bytes + kept * T * row * 4)
      << what;
  {
    // Every layer asked in turn, then again (as each observed decode step compares with each
    // layer): with every layer kept, none is recomputed the second time; with fewer kept, the
    // most recent first, each is (asked in a cycle longer than the slots).
    const auto* c = dynamic_cast<const CapturedAttention*>(&a);
    ASSERT_TRUE(c) << what;
    const int64_t before = c->recomputes_run();
    for (int pass = 0; pass < 2; ++pass)
      for (int l = 0; l < L; ++l) c->layer_qkv(l);
    EXPECT_EQ(c->recomputes_run() - before, L + (kept >= L ? 0 : L)) << what;
  }
  const int64_t layer_bytes = static_cast<int64_t>(f.n_heads) * T * T * 4;
  // Reductions first, while no layer's probabilities are held: a device capture makes them itself.
  const std::vector<std::vector<int>> rows = {AttentionReduction::range(0, T, T), AttentionReduction::range(T - 8, T, T),
                                              {0, T / 2, T - 1}, {}};
  // Every layer prepared at once over two of the row sets (a device capture recomputes each layer
  // into one buffer once for both sets and queues their reductions, one wait for all): the checks
  // below read what it kept there, one reduction a layer and row set.
  const auto* captured = dynamic_cast<const CapturedAttention*>(&a);
  ASSERT_TRUE(captured) << what;
  std::vector<int> all(static_cast<size_t>(L));
  for (int l = 0; l < L; ++l) all[static_cast<size_t>(l)] = l;
  const int64_t runs_before = captured->reductions_run(), recomputed_before = captured->recomputes_run();
  a.prepare(all, std::vector<PrefillAttention::QueryRows>{{rows[0], 0.01, false}, {rows[1], 0.0, true}});
  a.prepare(all, rows[1], 0.0, true);  // (kept: nothing runs again)
  const bool device = m.backend().name() == "cuda";
  if (device && L > 1) {
    EXPECT_EQ(captured->reductions_run() - runs_before, 2 * L) << what << ": prepare ran each layer once per row set";
    EXPECT_EQ(captured->recomputes_run() - recomputed_before, L) << what << ": prepare recomputed a layer per row set";
  }
  for (int l = 0; l < L; ++l)
    for (size_t ri = 0; ri < rows.size(); ++ri)
      for (double p : {0.0, 0.01, 1.0}) {
        const int64_t runs = captured->reductions_run();
        const bool prepared = device && L > 1 && ((ri == 0 && p == 0.01) || (ri == 1 && p == 0.0));
        const size_t H = static_cast<size_t>(f.n_heads);
        std::vector<double> sums(H * T, -1.0), want_sums(sums.size(), -2.0);
        std::vector<int64_t> below(H, -1), want_below(H, -2);
        AttentionReduction r, ref;
        r.queries = ref.queries = rows[ri];
        r.p = ref.p = p;
        r.zeros_below = ref.zeros_below = ri % 2 == 1;
        r.column_sums = sums.data();
        r.below = below.data();
        ref.column_sums = want_sums.data();
        ref.below = want_below.data();
        a.reduce(l, r);
        reduce_attention(rec.by_layer.at(l).data(), f.n_heads, T, ref);
        EXPECT_TRUE(sums == want_sums) << what << ": layer " << l << " column sums, rows " << r.key();
        EXPECT_EQ(below, want_below) << what << ": layer " << l << " entries below, rows " << r.key();
        if (prepared) {
          EXPECT_EQ(captured->reductions_run(), runs) << what << ": layer " << l << " reduced again after prepare";
        }
      }
  if (m.backend().name() == "cuda") {
    EXPECT_EQ(a.cached_bytes(), 0) << what << ": the device's reductions held a layer's probabilities on the host";
  }
  {
    AttentionReduction bad;
    std::vector<double> sums(static_cast<size_t>(f.n_heads) * T);
    bad.queries = {T - 1, 0};
    bad.column_sums = sums.data();
    EXPECT_THROW(a.reduce(0, bad), InternalError) << what << ": rows out of order";
  }
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
