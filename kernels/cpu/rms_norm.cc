#include "kernels/cpu/rms_norm.h"

#include <cmath>

namespace pdserve::kernels::cpu {

void RmsNorm(const float* x, const float* weight, int64_t rows, int64_t dim, int64_t stride,
             float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * stride;
    float* yr = y + r * stride;
    // Accumulate in double so long rows do not lose precision against the fp32 reference.
    double sum_sq = 0.0;
    for (int64_t i = 0; i < dim; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum_sq / static_cast<double>(dim)) + eps);
    if (weight != nullptr) {
      for (int64_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
    } else {
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv;
    }
  }
}

}  // namespace pdserve::kernels::cpu
