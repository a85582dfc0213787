#include "kernels/cpu/gemm.h"

#include <cblas.h>

namespace pdserve::kernels::cpu {

void Linear(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* w, int64_t out,
            float* y, int64_t y_stride) {
  if (rows == 0 || out == 0) return;
  if (in == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < out; ++o) y[r * y_stride + o] = 0.0f;
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows),
              static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, x,
              static_cast<blasint>(x_stride), w, static_cast<blasint>(in), 0.0f, y,
              static_cast<blasint>(y_stride));
}

}  // namespace pdserve::kernels::cpu
