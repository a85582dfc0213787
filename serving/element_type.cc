#include "serving/element_type.h"

namespace pdserve::serving {

const char* ElementTypeName(ElementType type) {
  return type == ElementType::kBfloat16 ? "bf16" : "fp32";
}

void StoreElements(const float* from, int64_t n, ElementType type, std::byte* to) {
  if (type == ElementType::kFloat32) {
    std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t bits = FloatToBf16(from[i]);
    std::memcpy(to + 2 * i, &bits, sizeof(bits));
  }
}

void LoadElements(const std::byte* from, ElementType type, int64_t n, float* to) {
  if (type == ElementType::kFloat32) {
    std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, from + 2 * i, sizeof(bits));
    to[i] = Bf16ToFloat(bits);
  }
}

void ConvertElements(std::span<const std::byte> from, ElementType from_type,
                     std::span<std::byte> to, ElementType to_type) {
  const auto n = static_cast<int64_t>(from.size()) / ElementBytes(from_type);
  if (from_type == to_type) {
    std::memcpy(to.data(), from.data(), from.size());
  } else if (from_type == ElementType::kBfloat16) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t bits;
      std::memcpy(&bits, from.data() + 2 * i, sizeof(bits));
      const float value = Bf16ToFloat(bits);
      std::memcpy(to.data() + 4 * i, &value, sizeof(value));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float value;
      std::memcpy(&value, from.data() + 4 * i, sizeof(value));
      const uint16_t bits = FloatToBf16(value);
      std::memcpy(to.data() + 2 * i, &bits, sizeof(bits));
    }
  }
}

}  // namespace pdserve::serving
