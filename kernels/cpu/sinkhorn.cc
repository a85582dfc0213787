#include "kernels/cpu/sinkhorn.h"

#include "kernels/cpu/softmax.h"

namespace pdserve::kernels::cpu {
namespace {

void NormalizeRows(float* m, int64_t n, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    float sum = 0.0f;
    for (int64_t c = 0; c < n; ++c) sum += m[r * n + c];
    for (int64_t c = 0; c < n; ++c) m[r * n + c] /= (sum + eps);
  }
}

void NormalizeColumns(float* m, int64_t n, float eps) {
  for (int64_t c = 0; c < n; ++c) {
    float sum = 0.0f;
    for (int64_t r = 0; r < n; ++r) sum += m[r * n + c];
    for (int64_t r = 0; r < n; ++r) m[r * n + c] /= (sum + eps);
  }
}

}  // namespace

void SinkhornProject(float* m, int64_t n, int64_t iters, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    Softmax(m + r * n, n);
    for (int64_t c = 0; c < n; ++c) m[r * n + c] += eps;
  }
  NormalizeColumns(m, n, eps);
  for (int64_t i = 1; i < iters; ++i) {
    NormalizeRows(m, n, eps);
    NormalizeColumns(m, n, eps);
  }
}

}  // namespace pdserve::kernels::cpu
