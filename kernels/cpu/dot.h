// Float32 dot product with independent partial sums, so the compiler can vectorize it without
// -ffast-math (a single running sum forces strict left-to-right order). Thread-safe.
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

inline float Dot(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) partial[l] += a[i + l] * b[i + l];
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += partial[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace pdserve::kernels::cpu
