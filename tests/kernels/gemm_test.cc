#include "kernels/cpu/gemm.h"

#include <gtest/gtest.h>

#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(LinearTest, MultipliesByTransposedWeight) {
  const std::vector<float> x = {1, 2, 3, 4, 5, 6};   // [2, 3]
  const std::vector<float> w = {1, 0, -1, 2, 1, 0};  // [2, 3]
  std::vector<float> y(4, -7.0f);
  Linear(x.data(), 2, 3, w.data(), 2, y.data());
  EXPECT_EQ(y, (std::vector<float>{-2, 4, -2, 13}));
}

TEST(LinearTest, HonoursRowStrides) {
  const std::vector<float> x = {1, 2, 99, 3, 4, 99};  // [2, 2] with stride 3
  const std::vector<float> w = {1, 1};                // [1, 2]
  std::vector<float> y = {0, -1, 0, -1};              // [2, 1] with stride 2
  Linear(x.data(), 2, 2, 3, w.data(), 1, y.data(), 2);
  EXPECT_EQ(y, (std::vector<float>{3, -1, 7, -1}));
}

TEST(MatMulTest, MultipliesRowMajorMatrices) {
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};  // [2, 3]
  const std::vector<float> b = {1, 0, 0, 1, 1, 1};  // [3, 2]
  std::vector<float> c(4, -7.0f);
  MatMul(a.data(), 2, 3, b.data(), 2, c.data());
  EXPECT_EQ(c, (std::vector<float>{4, 5, 10, 11}));
}

}  // namespace
}  // namespace pdserve::kernels::cpu
