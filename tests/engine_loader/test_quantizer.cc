#include "tests/engine_loader/test_quantizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace pdserve::engine::testing {
namespace {

// Smallest power of two >= x, and its UE8M0 byte (2^(byte - 127)).
double PowerOfTwoAtLeast(double x, uint8_t* e8m0) {
  const int e = static_cast<int>(std::ceil(std::log2(x)));
  if (e8m0 != nullptr) *e8m0 = static_cast<uint8_t>(e + 127);
  return std::ldexp(1.0, e);
}

template <typename ValueFn>
uint8_t Nearest(double x, int codes, ValueFn value) {
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < codes; ++c) {
    if (codes == 256 && (c & 0x7f) == 0x7f) continue;  // the two E4M3 NaN codes
    const double err = std::abs(value(static_cast<uint8_t>(c)) - x);
    if (err < best_err) {
      best_err = err;
      best = static_cast<uint8_t>(c);
    }
  }
  return best;
}

}  // namespace

double E4M3Value(uint8_t code) {
  const int sign = code >> 7, exp = (code >> 3) & 15, mant = code & 7;
  const double mag =
      exp == 0 ? mant / 8.0 * std::ldexp(1.0, -6) : (1.0 + mant / 8.0) * std::ldexp(1.0, exp - 7);
  return sign ? -mag : mag;
}

double E2M1Value(uint8_t nibble) {
  const int sign = (nibble >> 3) & 1, exp = (nibble >> 1) & 3, mant = nibble & 1;
  const double mag = exp == 0 ? mant * 0.5 : (1.0 + mant / 2.0) * std::ldexp(1.0, exp - 1);
  return sign ? -mag : mag;
}

Quantized QuantizeFp8(const std::vector<float>& w, int64_t rows, int64_t cols, bool ue8m0) {
  const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
  Quantized q;
  for (int64_t i = 0; i < br; ++i) {
    for (int64_t j = 0; j < bc; ++j) {
      double amax = 1e-4;
      for (int64_t r = i * 128; r < std::min(rows, (i + 1) * 128); ++r) {
        for (int64_t c = j * 128; c < std::min(cols, (j + 1) * 128); ++c) {
          amax = std::max(amax, std::abs(static_cast<double>(w[r * cols + c])));
        }
      }
      uint8_t byte = 0;
      q.scales.push_back(
          static_cast<float>(ue8m0 ? PowerOfTwoAtLeast(amax / 448.0, &byte) : amax / 448.0));
      q.e8m0.push_back(byte);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = q.scales[(r / 128) * bc + c / 128];
      const uint8_t code = Nearest(w[r * cols + c] / s, 256, E4M3Value);
      q.codes.push_back(code);
      q.expected.push_back(static_cast<float>(E4M3Value(code)) * s);
    }
  }
  return q;
}

Quantized QuantizeFp4(const std::vector<float>& w, int64_t rows, int64_t cols) {
  Quantized q;
  q.codes.assign(static_cast<size_t>(rows * cols / 2), 0);
  const int64_t blocks = cols / 32;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      double amax = 6 * std::ldexp(1.0, -126);
      for (int64_t c = b * 32; c < (b + 1) * 32; ++c) {
        amax = std::max(amax, std::abs(static_cast<double>(w[r * cols + c])));
      }
      uint8_t byte = 0;
      q.scales.push_back(static_cast<float>(PowerOfTwoAtLeast(amax / 6.0, &byte)));
      q.e8m0.push_back(byte);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = q.scales[r * blocks + c / 32];
      const uint8_t nibble = Nearest(w[r * cols + c] / s, 16, E2M1Value);
      q.codes[(r * cols + c) / 2] |= static_cast<uint8_t>(c % 2 == 0 ? nibble : nibble << 4);
      q.expected.push_back(static_cast<float>(E2M1Value(nibble)) * s);
    }
  }
  return q;
}

std::vector<float> RandomWeights(int64_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& v : w) v = dist(rng);
  return w;
}

}  // namespace pdserve::engine::testing
