#include "kernels/cpu/rope.h"

namespace pdserve::kernels::cpu {

void ApplyInterleavedRope(float* x, int64_t rows, int64_t row_stride, int64_t heads,
                          int64_t head_dim, int64_t rope_dim, const float* cos, const float* sin,
                          bool inverse) {
  const int64_t half = rope_dim / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * row_stride + h * head_dim + (head_dim - rope_dim);
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[2 * i];
        const float b = v[2 * i + 1];
        const float si = sign * s[i];
        v[2 * i] = a * c[i] - b * si;
        v[2 * i + 1] = b * c[i] + a * si;
      }
    }
  }
}

}  // namespace pdserve::kernels::cpu
