// The element type a state page stores its values in, and the conversions between the two the
// engines use: float32 (the CPU engine's state) and bfloat16 (the CUDA engine's window rows,
// compressed entries and indexer keys). docs/serving.md, "Page format", says which page kind
// holds which; docs/protocol.md, "Page header", how a page names its type on the wire.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pdserve::serving {

// Numbered as on the wire (the page header's element field, the ticket descriptor's element);
// 0 is float32, so a field left zero by an older peer means what it always meant.
enum class ElementType : uint16_t {
  kFloat32 = 0,
  kBfloat16 = 1,
};

inline constexpr int64_t ElementBytes(ElementType type) {
  return type == ElementType::kBfloat16 ? 2 : 4;
}
const char* ElementTypeName(ElementType type);  // "fp32", "bf16"
// Whether `value` (a wire field) names a known element type.
inline constexpr bool IsElementType(uint64_t value) { return value <= 1; }

// float32 -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN): the rounding of CUDA's
// __float2bfloat16_rn, so a host-rounded value equals the device's.
inline uint16_t FloatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16ToFloat(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Writes n values of `from` (float32) into `to` as `type` (bf16: rounded to nearest even).
void StoreElements(const float* from, int64_t n, ElementType type, std::byte* to);
// Reads n values of `type` at `from` into float32 `to` (bf16 widens exactly).
void LoadElements(const std::byte* from, ElementType type, int64_t n, float* to);

// Converts a whole page: `from` holds values of `from_type`, `to` receives the same count of
// values as `to_type` (bf16 -> fp32 exact, fp32 -> bf16 round to nearest even, equal types a
// copy). REQUIRES: from.size() / ElementBytes(from_type) == to.size() / ElementBytes(to_type)
// and both sizes multiples of their element size; the spans do not overlap.
void ConvertElements(std::span<const std::byte> from, ElementType from_type,
                     std::span<std::byte> to, ElementType to_type);

}  // namespace pdserve::serving
