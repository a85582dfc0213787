#include "engine/quant.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {
namespace {

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void ConvertLoop(const uint8_t* src, std::span<float> dst) {
  for (size_t i = 0; i < dst.size(); ++i) {
    dst[i] = static_cast<float>(Load<T>(src + i * sizeof(T)));
  }
}

template <typename Fn>
void ConvertBytes(const uint8_t* src, std::span<float> dst, Fn fn) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i] = fn(src[i]);
}

template <typename Fn>
void ConvertHalves(const uint8_t* src, std::span<float> dst, Fn fn) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i] = fn(Load<uint16_t>(src + 2 * i));
}

}  // namespace

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

float RoundToBf16(float v) {
  if (std::isnan(v)) return v;
  uint32_t u = std::bit_cast<uint32_t>(v);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return std::bit_cast<float>(u & 0xFFFF0000u);
}

void RoundToBf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = RoundToBf16(x[i]);
}

float F16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exp = (bits >> 10) & 0x1fu;
  const uint32_t mant = bits & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    // Subnormal (or zero): mant * 2^-24, exact in float.
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

float E4M3ToFloat(uint8_t bits) {
  const bool negative = bits & 0x80u;
  const int exp = (bits >> 3) & 0xf;
  const int mant = bits & 0x7;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  const float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -9)
                           : std::ldexp(static_cast<float>(8 + mant), exp - 10);
  return negative ? -v : v;
}

float E8M0ToFloat(uint8_t bits) {
  if (bits == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(bits) - 127);
}

float E2M1ToFloat(uint8_t nibble) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = kMagnitude[nibble & 0x7u];
  return (nibble & 0x8u) ? -v : v;
}

absl::Status ConvertToFloat(DType dtype, std::span<const uint8_t> src, std::span<float> dst) {
  const int bits = DTypeBits(dtype);
  if (bits % 8 != 0 || src.size() != dst.size() * static_cast<size_t>(bits / 8)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot convert ", src.size(), " bytes of ",
                                                   DTypeName(dtype), " to ", dst.size(),
                                                   " floats"));
  }
  const uint8_t* p = src.data();
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst.data(), p, src.size());
      return absl::OkStatus();
    case DType::kF64:
      ConvertLoop<double>(p, dst);
      return absl::OkStatus();
    case DType::kBF16:
      ConvertHalves(p, dst, Bf16ToFloat);
      return absl::OkStatus();
    case DType::kF16:
      ConvertHalves(p, dst, F16ToFloat);
      return absl::OkStatus();
    case DType::kF8E4M3:
      ConvertBytes(p, dst, E4M3ToFloat);
      return absl::OkStatus();
    case DType::kF8E8M0:
      ConvertBytes(p, dst, E8M0ToFloat);
      return absl::OkStatus();
    case DType::kU8:
      ConvertLoop<uint8_t>(p, dst);
      return absl::OkStatus();
    case DType::kI8:
      ConvertLoop<int8_t>(p, dst);
      return absl::OkStatus();
    case DType::kI16:
      ConvertLoop<int16_t>(p, dst);
      return absl::OkStatus();
    case DType::kU16:
      ConvertLoop<uint16_t>(p, dst);
      return absl::OkStatus();
    case DType::kI32:
      ConvertLoop<int32_t>(p, dst);
      return absl::OkStatus();
    case DType::kU32:
      ConvertLoop<uint32_t>(p, dst);
      return absl::OkStatus();
    case DType::kI64:
      ConvertLoop<int64_t>(p, dst);
      return absl::OkStatus();
    case DType::kU64:
      ConvertLoop<uint64_t>(p, dst);
      return absl::OkStatus();
    case DType::kBool:
    case DType::kF4:
    case DType::kF8E5M2:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no plain float conversion for ", DTypeName(dtype)));
}

void DequantizeFp8(const uint8_t* weight, int64_t rows, int64_t cols, const float* scales,
                   float* out) {
  float table[256];
  for (int b = 0; b < 256; ++b) table[b] = E4M3ToFloat(static_cast<uint8_t>(b));
  const int64_t scale_cols = (cols + kFp8BlockCols - 1) / kFp8BlockCols;
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scales + (r / kFp8BlockRows) * scale_cols;
    const uint8_t* w = weight + r * cols;
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = table[w[c]] * scale_row[c / kFp8BlockCols];
  }
}

void DequantizeFp4(const uint8_t* packed, int64_t rows, int64_t cols, const float* scales,
                   float* out) {
  const int64_t scale_cols = (cols + kFp4BlockCols - 1) / kFp4BlockCols;
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = scales + r * scale_cols;
    const uint8_t* w = packed + r * (cols / 2);
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; c += 2) {
      const uint8_t byte = w[c / 2];
      const float s = scale_row[c / kFp4BlockCols];
      o[c] = E2M1ToFloat(byte & 0xfu) * s;
      o[c + 1] = E2M1ToFloat(byte >> 4) * s;
    }
  }
}

}  // namespace pdserve::engine
