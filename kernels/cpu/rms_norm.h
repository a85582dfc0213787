// RMSNorm over the last dimension, float32.
//
// Math (transformers 5.17 modeling_deepseek_v4.py, DeepseekV4RMSNorm / UnweightedRMSNorm):
//   y = x * rsqrt(mean(x^2) + eps) [* weight]
// Thread-safe (no shared state).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// Normalizes `rows` vectors of `dim` floats. `weight` is [dim] or nullptr for the unweighted form.
// `y` may alias `x` (in place). Rows are `stride` floats apart in both x and y (stride >= dim).
void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, int64_t stride,
             float eps, float* y);

inline void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, float eps,
                    float* y) {
  RmsNorm(x, weight, rows, dim, dim, eps, y);
}

}  // namespace pdserve::kernels::cpu
