// kernels/cpu/fp8_gemm.h against hand-computed values: the e4m3 / e2m1 / ue8m0 codes, DeepSeek's
// act_quant rounding and scale, and one-element GEMMs whose results are exact.
#include "kernels/cpu/fp8_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(Fp8CodesTest, E4m3ValuesAndRoundTrip) {
  EXPECT_EQ(E4m3Value(0x38), 1.0f);
  EXPECT_EQ(E4m3Value(0xB8), -1.0f);
  EXPECT_EQ(E4m3Value(0x7E), 448.0f);
  EXPECT_EQ(E4m3Value(0x01), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::isnan(E4m3Value(0x7F)));
  EXPECT_TRUE(std::isnan(E4m3Value(0xFF)));
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(E4m3FromFloat(E4m3Value(static_cast<uint8_t>(code))), code) << code;
  }
}

TEST(Fp8CodesTest, E4m3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(E4m3FromFloat(1.0625f), 0x38);  // halfway 1 / 1.125 -> even code
  EXPECT_EQ(E4m3FromFloat(1.1875f), 0x3A);  // halfway 1.125 / 1.25 -> even code
  EXPECT_EQ(E4m3FromFloat(1.07f), 0x39);
  EXPECT_EQ(E4m3FromFloat(1000.0f), 0x7E);
  EXPECT_EQ(E4m3FromFloat(-INFINITY), 0xFE);
  EXPECT_EQ(E4m3FromFloat(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
  EXPECT_EQ(E4m3FromFloat(NAN), 0x7F);
}

TEST(Fp8CodesTest, E2m1AndUe8m0) {
  EXPECT_EQ(E2m1Value(0x1), 0.5f);
  EXPECT_EQ(E2m1Value(0x7), 6.0f);
  EXPECT_EQ(E2m1Value(0xF), -6.0f);
  EXPECT_EQ(E2m1Value(0x8), -0.0f);
  EXPECT_EQ(Ue8m0Value(127), 1.0f);
  EXPECT_EQ(Ue8m0Value(147), std::ldexp(1.0f, 20));
  EXPECT_TRUE(std::isnan(Ue8m0Value(0xFF)));
}

TEST(Fp8ActQuantTest, ScaleIsAmaxOver448OrItsPowerOfTwo) {
  std::vector<float> x(256, 0.0f);
  x[3] = 448.0f;    // block 0: amax 448 -> s = 1
  x[200] = -100.0f;  // block 1: amax 100 -> s = 100 / 448, or 2^-2 with ue8m0
  x[201] = 30.0f;
  std::vector<uint8_t> q(256);
  std::vector<float> s(2);
  QuantizeActivations(x.data(), 1, 256, 256, false, q.data(), s.data());
  EXPECT_EQ(s[0], 1.0f);
  EXPECT_EQ(q[3], 0x7E);
  EXPECT_EQ(s[1], 100.0f / 448.0f);
  EXPECT_EQ(q[200], E4m3FromFloat(-100.0f / (100.0f / 448.0f)));
  QuantizeActivations(x.data(), 1, 256, 256, true, q.data(), s.data());
  EXPECT_EQ(s[1], 0.25f);
  // -400 = -1.5625 * 2^8: halfway between 1.5 and 1.625, to the even mantissa: -384 (0xFC).
  EXPECT_EQ(q[200], 0xFC);
  EXPECT_EQ(q[201], E4m3FromFloat(120.0f));
}

TEST(Fp8GemmReferenceTest, OneOutputExact) {
  // x = 448 everywhere (s = 1, xq = 448), w = 1.0 (0x38), block scale 2: out = 128 * 448 * 2.
  const std::vector<float> x(128, 448.0f);
  const std::vector<uint8_t> w(128, 0x38);
  const std::vector<float> scale = {2.0f};
  float out = 0.0f;
  Fp8GemmReference(x.data(), 1, 128, 128, w.data(), scale.data(), 1, false, &out);
  EXPECT_EQ(out, 128.0f * 448.0f * 2.0f);
}

TEST(Fp8GemmReferenceTest, Fp4ExpertsSkipInvalidPicks) {
  // Two experts of one row; expert 1's bytes 0x22 (both nibbles 1.0) with scale 2^1; the pick
  // weight halves it. Pick 1 names expert -1 and leaves its row alone.
  const std::vector<float> x(128, 448.0f);
  std::vector<uint8_t> w(128, 0x00);
  for (int i = 64; i < 128; ++i) w[i] = 0x22;
  const std::vector<uint8_t> scales = {127, 127, 127, 127, 128, 128, 128, 128};
  const std::vector<int32_t> experts = {1, -1};
  const std::vector<float> weights = {0.5f, 1.0f};
  ExpertWeightsRef ref{true, w.data(), nullptr, scales.data(), 2, 1, 128};
  std::vector<float> out = {-7.0f, -7.0f};
  MoeGemmReference(x.data(), 128, false, experts.data(), weights.data(), 1, 2, ref, false,
                   out.data());
  EXPECT_EQ(out[0], 128.0f * 448.0f * 2.0f * 0.5f);
  EXPECT_EQ(out[1], -7.0f);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
