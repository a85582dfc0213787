// Fp4ToFp8Blocks (engine/stored_experts.h): FP4 experts become FP8 with 128 x 128 block scales at
// load. Checked against DequantizeFp4 (engine/quant.h), the CPU engine's values: exact where the
// format says so, zero below e4m3's range, NaN where the group scale is NaN.
#include "engine/stored_experts.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "engine/quant.h"
#include "gtest/gtest.h"

namespace pdserve::engine {
namespace {

struct Fp4Matrix {
  std::vector<uint8_t> packed;
  std::vector<float> scales;  // [rows, cols / 32]
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> Dequantized() const {
    std::vector<float> out(static_cast<size_t>(rows * cols));
    DequantizeFp4(packed.data(), rows, cols, scales.data(), out.data());
    return out;
  }
};

// Random nibbles (all 16 codes, -0 included); group scales 2^e with e drawn from [lo, hi].
Fp4Matrix RandomFp4(int64_t rows, int64_t cols, int lo, int hi, uint32_t seed) {
  std::mt19937 rng(seed);
  Fp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  m.packed.resize(static_cast<size_t>(rows * cols / 2));
  for (uint8_t& b : m.packed) b = static_cast<uint8_t>(rng() & 0xFF);
  std::uniform_int_distribution<int> exponent(lo, hi);
  m.scales.resize(static_cast<size_t>(rows * cols / 32));
  for (float& s : m.scales) s = std::ldexp(1.0f, exponent(rng));
  return m;
}

std::vector<float> Dequantized(const Fp8Blocks& q) {
  std::vector<float> out(static_cast<size_t>(q.rows * q.cols));
  DequantizeFp8(q.weight.data(), q.rows, q.cols, q.scales.data(), out.data());
  return out;
}

// Group scales within 2^14 of their block's largest: every value has an exact e4m3 code. Rows
// not a multiple of 128 leave a partial last block row; scales span 2^-130 .. 2^20 across blocks.
TEST(Fp4ToFp8BlocksTest, ExactWhenGroupScalesAreWithinTheBlocksRange) {
  for (const auto& [rows, cols, lo, hi] : std::vector<std::tuple<int64_t, int64_t, int, int>>{
           {200, 256, -14, 0}, {128, 384, 6, 20}, {1, 128, -130, -116}, {300, 128, -8, -8}}) {
    const Fp4Matrix m = RandomFp4(rows, cols, lo, hi, static_cast<uint32_t>(rows * cols));
    const Fp8Blocks q = Fp4ToFp8Blocks(m.packed.data(), m.scales.data(), rows, cols);
    ASSERT_EQ(q.rows, rows);
    ASSERT_EQ(q.cols, cols);
    ASSERT_EQ(q.weight.size(), static_cast<size_t>(rows * cols));
    ASSERT_EQ(q.scales.size(), static_cast<size_t>((rows + 127) / 128 * (cols / 128)));
    const std::vector<float> want = m.Dequantized();
    const std::vector<float> got = Dequantized(q);
    int64_t nonzero = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << rows << "x" << cols << " [" << i / cols << ", " << i % cols
                                 << "] scales 2^" << lo << "..2^" << hi;
      nonzero += want[i] != 0.0f;
    }
    EXPECT_GT(nonzero, static_cast<int64_t>(want.size()) / 2);
  }
}

// A group 2^-20 below its block's largest scale: 6 * 2^-20 in units of the block scale (2^-6 of
// the largest) is 6 * 2^-14, under half of e4m3's smallest subnormal (2^-9): zero. The rest of the
// block stays exact.
TEST(Fp4ToFp8BlocksTest, GroupsFarBelowTheBlockMaximumFlushToZero) {
  Fp4Matrix m = RandomFp4(128, 128, 0, 0, 3);
  m.scales[5] = std::ldexp(1.0f, -20);  // row 1, group 1
  const Fp8Blocks q = Fp4ToFp8Blocks(m.packed.data(), m.scales.data(), 128, 128);
  EXPECT_EQ(q.scales[0], std::ldexp(1.0f, -6));
  const std::vector<float> want = m.Dequantized();
  const std::vector<float> got = Dequantized(q);
  for (int64_t c = 0; c < 128; ++c) {
    const size_t i = static_cast<size_t>(128 + c);
    if (c >= 32 && c < 64) {
      EXPECT_EQ(got[i], 0.0f) << c;
    } else {
      EXPECT_EQ(got[i], want[i]) << c;
    }
  }
}

// A NaN group scale (ue8m0 0xFF) makes its 32 values NaN and does not poison the block scale; a
// block whose scales are all zero gets scale 0 and zero values.
TEST(Fp4ToFp8BlocksTest, NanScalesStayInTheirGroupAndZeroBlocksAreZero) {
  Fp4Matrix m = RandomFp4(128, 256, -3, 3, 4);
  m.scales[0] = std::nanf("");
  for (int64_t r = 0; r < 128; ++r) {
    for (int64_t g = 4; g < 8; ++g) m.scales[static_cast<size_t>(r * 8 + g)] = 0.0f;
  }
  const Fp8Blocks q = Fp4ToFp8Blocks(m.packed.data(), m.scales.data(), 128, 256);
  EXPECT_TRUE(std::isfinite(q.scales[0]));
  EXPECT_GT(q.scales[0], 0.0f);
  EXPECT_EQ(q.scales[1], 0.0f);
  const std::vector<float> want = m.Dequantized();
  const std::vector<float> got = Dequantized(q);
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) / 256, c = static_cast<int64_t>(i) % 256;
    if (r == 0 && c < 32) {
      EXPECT_TRUE(std::isnan(got[i])) << c;
    } else if (c >= 128) {
      ASSERT_EQ(got[i], 0.0f) << r << ", " << c;
    } else {
      ASSERT_EQ(got[i], want[i]) << r << ", " << c;
    }
  }
}

}  // namespace
}  // namespace pdserve::engine
