#include "common/histogram_buckets.h"

#include <vector>

#include "gtest/gtest.h"

namespace pdserve::metrics {
namespace {

TEST(GeometricBucketsTest, PowersOfTwoIncludeTheLastBound) {
  EXPECT_EQ(GeometricBuckets(1, 2, 1024),
            (std::vector<double>{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024}));
  const std::vector<double> chunk = GeometricBuckets(16, 2, 16384);
  ASSERT_EQ(chunk.size(), 11u);
  EXPECT_EQ(chunk.front(), 16);
  EXPECT_EQ(chunk.back(), 16384);
}

TEST(GeometricBucketsTest, StopsAtTheLastBoundWhenTheFactorSkipsIt) {
  // 1e8 x 2.5^k: 6.1e10 is the last at or below 1e11.
  const std::vector<double> bandwidth = GeometricBuckets(1e8, 2.5, 1e11);
  ASSERT_EQ(bandwidth.size(), 8u);
  EXPECT_DOUBLE_EQ(bandwidth[1], 2.5e8);
  EXPECT_DOUBLE_EQ(bandwidth.back(), 1e8 * 2.5 * 2.5 * 2.5 * 2.5 * 2.5 * 2.5 * 2.5);
}

TEST(GeometricBucketsTest, ABoundReachedOnlyUpToRoundingIsKept) {
  // 0.1 x 3 is 0.30000000000000004 in binary floating point, just above 0.3.
  const std::vector<double> bounds = GeometricBuckets(0.1, 3, 0.3);
  ASSERT_EQ(bounds.size(), 2u);
  EXPECT_NEAR(bounds.back(), 0.3, 1e-12);
}

}  // namespace
}  // namespace pdserve::metrics
