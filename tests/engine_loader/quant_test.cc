// Element conversions and block dequantization. The FP8 / FP4 tests quantize random weights with
// the test quantizer (test_quantizer.h: DeepSeek's recipe, values from the format definitions)
// and check that the engine's dequantization returns exactly code value * block scale.
#include "engine/quant.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine_loader/test_quantizer.h"

namespace pdserve::engine {
namespace {

using testing::E4M3Value;
using testing::Quantized;

TEST(QuantTest, ScalarConversionsMatchFormatDefinitions) {
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToFloat(0xfbff), -65504.0f);
  EXPECT_TRUE(std::isinf(F16ToFloat(0x7c00)));
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4M3ToFloat(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(E4M3ToFloat(0x7f)));
  EXPECT_EQ(E8M0ToFloat(127), 1.0f);
  EXPECT_EQ(E8M0ToFloat(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(E8M0ToFloat(255)));
  EXPECT_EQ(E2M1ToFloat(0x7), 6.0f);
  EXPECT_EQ(E2M1ToFloat(0x1), 0.5f);
  EXPECT_EQ(E2M1ToFloat(0xd), -3.0f);
}

TEST(QuantTest, EveryE4M3CodeMatchesDefinition) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(E4M3ToFloat(static_cast<uint8_t>(c)), static_cast<float>(E4M3Value(c))) << c;
  }
}

class Fp8RoundTrip : public ::testing::TestWithParam<bool> {};

TEST_P(Fp8RoundTrip, DequantizeReturnsCodeTimesBlockScale) {
  const int64_t rows = 200, cols = 300;  // partial edge blocks in both dimensions
  const std::vector<float> w = testing::RandomWeights(rows * cols, 7, 0.05f);
  const Quantized q = testing::QuantizeFp8(w, rows, cols, /*ue8m0=*/GetParam());
  std::vector<float> out(static_cast<size_t>(rows * cols), -1.0f);
  DequantizeFp8(q.codes.data(), rows, cols, q.scales.data(), out.data());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], q.expected[i]) << "element " << i;
    // The round trip itself is sane: within half an E4M3 step (2^-4 relative) plus underflow.
    ASSERT_NEAR(out[i], w[i], std::abs(w[i]) / 16 + q.scales[0] * 0.01) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Float32AndUe8m0Scales, Fp8RoundTrip, ::testing::Bool());

TEST(QuantTest, Fp4RoundTripWithUe8m0BlockScales) {
  const int64_t rows = 6, cols = 96;  // three 32-wide blocks per row
  const std::vector<float> w = testing::RandomWeights(rows * cols, 11, 0.05f);
  const Quantized q = testing::QuantizeFp4(w, rows, cols);
  std::vector<float> out(static_cast<size_t>(rows * cols), -1.0f);
  DequantizeFp4(q.codes.data(), rows, cols, q.scales.data(), out.data());
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_EQ(out[i], q.expected[i]) << "element " << i;
    // Half of the widest E2M1 step (4 -> 6) relative to the block scale.
    ASSERT_NEAR(out[i], w[i], q.scales[i / 32] * 1.0) << "element " << i;
  }
}

TEST(QuantTest, ConvertRejectsByteCountMismatch) {
  const std::vector<uint8_t> bytes(6, 0);
  std::vector<float> out(2);
  EXPECT_FALSE(ConvertToFloat(DType::kF32, bytes, out).ok());
}

TEST(QuantTest, ConvertIntegersExactly) {
  const int64_t v[2] = {3, -5};
  std::vector<float> out(2);
  ASSERT_TRUE(
      ConvertToFloat(DType::kI64, {reinterpret_cast<const uint8_t*>(v), sizeof(v)}, out).ok());
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ(out[1], -5.0f);
}

}  // namespace
}  // namespace pdserve::engine
