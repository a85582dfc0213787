#include "kernels/cpu/sinkhorn.h"

#include <gtest/gtest.h>

#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(SinkhornTest, ConvergesToDoublyStochastic) {
  std::vector<float> m = {2.0f, -1.0f, 0.5f, 0.0f, 1.0f, 3.0f, -2.0f, 0.3f, 1.1f};
  SinkhornProject(m.data(), 3, 50, 1e-6f);
  for (int i = 0; i < 3; ++i) {
    float row = 0, col = 0;
    for (int j = 0; j < 3; ++j) {
      row += m[i * 3 + j];
      col += m[j * 3 + i];
    }
    EXPECT_NEAR(row, 1.0f, 1e-4);
    EXPECT_NEAR(col, 1.0f, 1e-4);
  }
}

TEST(SinkhornTest, OneIterationIsSoftmaxThenColumnNormalization) {
  std::vector<float> m = {0.0f, 0.0f, 0.0f, 0.0f};  // softmax rows: all 0.5
  SinkhornProject(m.data(), 2, 1, 0.0f);
  for (float v : m) EXPECT_FLOAT_EQ(v, 0.5f);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
