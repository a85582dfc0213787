// Bit-for-bit comparison of engine states, shared by the runtime tests.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <utility>

#include "engine/state.h"

namespace pdserve::runtime::testing {

inline bool SameBits(const engine::Tensor& a, const engine::Tensor& b) {
  return a.shape == b.shape &&
         std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0;
}

// Every tensor of every layer equal bit for bit (gtest failures name the layer).
inline void ExpectSameState(const engine::ModelState& a, const engine::ModelState& b) {
  ASSERT_EQ(a.position, b.position);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    SCOPED_TRACE(l);
    const engine::LayerState& x = a.layers[l];
    const engine::LayerState& y = b.layers[l];
    EXPECT_TRUE(SameBits(x.window_kv, y.window_kv));
    for (auto [p, q] : {std::pair{&x.compressor, &y.compressor}, {&x.indexer, &y.indexer}}) {
      EXPECT_TRUE(SameBits(p->buffer_kv, q->buffer_kv));
      EXPECT_TRUE(SameBits(p->buffer_gate, q->buffer_gate));
      EXPECT_TRUE(SameBits(p->overlap_kv, q->overlap_kv));
      EXPECT_TRUE(SameBits(p->overlap_gate, q->overlap_gate));
      EXPECT_TRUE(SameBits(p->entries, q->entries));
    }
  }
}

}  // namespace pdserve::runtime::testing
