// One check shared by the tests of layout-only stores (KVSegment::layout_only): a layer that holds
// the layout alone against the same layer with its rows.
#pragma once
#include <gtest/gtest.h>

#include "core/kv_store.h"

namespace kvlens::testing {

// `layout` has the segments of `rows` (kinds, storage labels, bytes, each head's positions), every
// one layout_only and without rows.
inline void expect_layout_of(const LayerKV& layout, const LayerKV& rows) {
  ASSERT_EQ(layout.segments.size(), rows.segments.size());
  for (size_t i = 0; i < rows.segments.size(); ++i) {
    const KVSegment &a = layout.segments[i], &b = rows.segments[i];
    SCOPED_TRACE("segment " + std::to_string(i));
    EXPECT_TRUE(a.layout_only);
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.storage, b.storage);
    EXPECT_EQ(a.bytes.total(), b.bytes.total());
    ASSERT_EQ(a.heads.size(), b.heads.size());
    for (size_t h = 0; h < a.heads.size(); ++h) {
      EXPECT_EQ(a.heads[h].pos, b.heads[h].pos) << "head " << h;
      EXPECT_TRUE(a.heads[h].k.empty() && a.heads[h].v.empty()) << "head " << h;
    }
  }
}

}  // namespace kvlens::testing
