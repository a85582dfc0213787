#include "kernels/cpu/parallel.h"

#include <gtest/gtest.h>

#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(ParallelForTest, CoversEveryIndexExactlyOnce) {
  for (int64_t n : {1, 2, 3, 17, 1000}) {
    std::vector<int> hits(static_cast<size_t>(n), 0);
    ParallelFor(n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) ++hits[i];
    });
    for (int h : hits) EXPECT_EQ(h, 1);
  }
}

TEST(ParallelForTest, NestedCallRunsInline) {
  std::vector<int> hits(64, 0);
  ParallelFor(8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      ParallelFor(8, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) ++hits[i * 8 + j];
      });
    }
  });
  for (int h : hits) EXPECT_EQ(h, 1);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
