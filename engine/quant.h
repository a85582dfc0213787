// Element formats of checkpoint tensors and their conversion to float32, including the
// block-scaled quantized forms DeepSeek ships (docs/checkpoints.md, "Quantized formats"):
//
// - FP8: weight in OCP FP8 E4M3 (E4M3FN: bias 7, no infinities, S.1111.111 is NaN), one scale
//   per block of kFp8BlockRows x kFp8BlockCols weights; value = e4m3(w) * scale[r / 128][c / 128].
//   Scales are float32 or UE8M0 (F8_E8M0: 2^(e - 127), 0xFF is NaN).
// - FP4: weight in OCP E2M1 (bias 1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two per
//   byte with the lower-indexed element in the low nibble, one scale per kFp4BlockCols
//   consecutive elements of a row; value = e2m1(w) * scale[r][c / 32].
//
// All functions are pure and thread-safe. Inputs are read with memcpy, so unaligned mmapped bytes
// are fine.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "engine/safetensors.h"

namespace pdserve::engine {

inline constexpr int64_t kFp8BlockRows = 128;
inline constexpr int64_t kFp8BlockCols = 128;
inline constexpr int64_t kFp4BlockCols = 32;

float Bf16ToFloat(uint16_t bits);
// `v` rounded to the nearest bf16 value (ties to even), returned as float; NaN stays NaN.
float RoundToBf16(float v);
// Rounds x[0 .. n) in place as RoundToBf16.
void RoundToBf16(float* x, int64_t n);
float F16ToFloat(uint16_t bits);
float E4M3ToFloat(uint8_t bits);
float E8M0ToFloat(uint8_t bits);
// `nibble` in the low 4 bits: sign in bit 3, exponent in bits 2..1, mantissa in bit 0.
float E2M1ToFloat(uint8_t nibble);

// Converts `dst.size()` elements of an unscaled type to float32: F32, F64, F16, BF16, F8_E4M3,
// F8_E8M0 and the integer types (exact for |v| < 2^24). InvalidArgument for F4 / F8_E5M2 / BOOL
// or when `src` holds a different number of elements.
absl::Status ConvertToFloat(DType dtype, std::span<const uint8_t> src, std::span<float> dst);

// FP8 block dequantization. `weight`: rows * cols E4M3 bytes, row-major. `scales`: float32,
// row-major [ceil(rows / 128), ceil(cols / 128)]. `out`: rows * cols floats.
void DequantizeFp8(const uint8_t* weight, int64_t rows, int64_t cols, const float* scales,
                   float* out);

// FP4 block dequantization. `packed`: rows * cols / 2 bytes (cols even), row-major, element 2k
// in the low nibble of byte k. `scales`: float32, row-major [rows, ceil(cols / 32)]. `out`:
// rows * cols floats.
void DequantizeFp4(const uint8_t* packed, int64_t rows, int64_t cols, const float* scales,
                   float* out);

}  // namespace pdserve::engine
