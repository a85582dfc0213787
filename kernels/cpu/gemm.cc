#include "kernels/cpu/gemm.h"

#include <cblas.h>

#include <algorithm>

namespace pdserve::kernels::cpu {
namespace {

// Below this many rows, matrix-vector products beat sgemm, which packs the whole weight matrix on
// every call (decode steps are one row).
constexpr int64_t kGemvRows = 4;

}  // namespace

void Linear(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* w, int64_t out,
            float* y, int64_t y_stride) {
  if (rows == 0 || out == 0) return;
  if (in == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < out; ++o) y[r * y_stride + o] = 0.0f;
    }
    return;
  }
  if (rows < kGemvRows) {
    for (int64_t r = 0; r < rows; ++r) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(out), static_cast<blasint>(in),
                  1.0f, w, static_cast<blasint>(in), x + r * x_stride, 1, 0.0f, y + r * y_stride,
                  1);
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows),
              static_cast<blasint>(out), static_cast<blasint>(in), 1.0f, x,
              static_cast<blasint>(x_stride), w, static_cast<blasint>(in), 0.0f, y,
              static_cast<blasint>(y_stride));
}

void MatMul(const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(c, c + m * n, 0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(k), b,
              static_cast<blasint>(n), 0.0f, c, static_cast<blasint>(n));
}

}  // namespace pdserve::kernels::cpu
