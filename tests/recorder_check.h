// One check of decode recorders on any backend: every event `rec` kept equals the event of the
// same step and layer that `all` (an observer of every step, with rows) kept, its rows included
// when `rec` keeps rows and absent otherwise.
#pragma once
#include <gtest/gtest.h>

#include "core/diagnostics/diagnostics.h"

namespace kvlens::testing {

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
