#include "kernels/cpu/parallel.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>
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

// The pool is process-wide, so the count is checked in a fresh process (a threadsafe death test
// re-executes the binary), where it cannot have started yet.
TEST(ParallelForTest, SetNumThreadsBeforeFirstUseSizesThePool) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const bool set = SetNumThreads(3);
        const bool first = NumThreads() == 3;
        const bool same_again = SetNumThreads(3);
        const bool changed_late = SetNumThreads(2);
        std::vector<int> hits(10, 0);
        ParallelFor(10, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) ++hits[i];
        });
        bool covered = true;
        for (int h : hits) covered = covered && h == 1;
        std::exit(set && first && same_again && !changed_late && NumThreads() == 3 && covered ? 0
                                                                                              : 1);
      },
      ::testing::ExitedWithCode(0), "");
  EXPECT_FALSE(SetNumThreads(0));
}

}  // namespace
}  // namespace pdserve::kernels::cpu
