#include "kernels/cpu/topk.h"

#include <gtest/gtest.h>

#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(TopKTest, DescendingWithTiesTowardLowerIndex) {
  const std::vector<float> s = {1.0f, 3.0f, 2.0f, 3.0f, 0.0f};
  std::vector<int32_t> out(3), scratch(5);
  TopK(s.data(), 5, 3, out.data(), scratch.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 3, 2}));
}

TEST(TopKTest, SlotsBeyondCandidatesAreInvalid) {
  const std::vector<float> s = {0.5f, 9.0f, 7.0f};  // only the first 2 are candidates
  std::vector<int32_t> out(4), scratch(3);
  TopK(s.data(), 2, 4, out.data(), scratch.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 0, -1, -1}));
}

TEST(TopKTest, NoCandidatesAllInvalid) {
  std::vector<int32_t> out(2), scratch(1);
  TopK(nullptr, 0, 2, out.data(), scratch.data());
  EXPECT_EQ(out, (std::vector<int32_t>{-1, -1}));
}

}  // namespace
}  // namespace pdserve::kernels::cpu
