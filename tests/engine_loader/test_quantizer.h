// A reference quantizer for tests, written from the format definitions (OCP FP8 E4M3FN, OCP
// E2M1) and DeepSeek's recipe (block amax / format max; UE8M0 scales rounded up to a power of
// two): it produces the stored codes and scales and the exact values dequantization must give.
#pragma once

#include <cstdint>
#include <vector>

namespace pdserve::engine::testing {

double E4M3Value(uint8_t code);
double E2M1Value(uint8_t nibble);

struct Quantized {
  std::vector<uint8_t> codes;   // FP8: one byte per element; FP4: packed, low nibble first
  std::vector<float> scales;    // row-major block scales
  std::vector<uint8_t> e8m0;    // the same scales as UE8M0 bytes (when ue8m0 was requested)
  std::vector<float> expected;  // code value * block scale, per element
};

// [rows, cols] -> E4M3 codes with [ceil(rows/128), ceil(cols/128)] scales.
Quantized QuantizeFp8(const std::vector<float>& w, int64_t rows, int64_t cols, bool ue8m0);
// [rows, cols] -> packed E2M1 with [rows, cols/32] UE8M0 scales; cols must be a multiple of 32.
Quantized QuantizeFp4(const std::vector<float>& w, int64_t rows, int64_t cols);

std::vector<float> RandomWeights(int64_t n, uint32_t seed, float stddev);

}  // namespace pdserve::engine::testing
