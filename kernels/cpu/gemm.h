// Dense matrix products on the CPU through OpenBLAS (cblas_sgemm), float32, row-major.
//
// OpenBLAS runs its own thread pool inside each call; do not call these from inside a
// ParallelFor body (nested parallelism oversubscribes the cores).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// y[rows, out] = x[rows, in] * w[out, in]^T — a bias-free torch.nn.Linear with PyTorch's weight
// layout. `x` rows are `x_stride` floats apart (>= in), `y` rows `y_stride` apart (>= out).
// rows == 0 is a no-op. `y` must not alias `x` or `w`.
void Linear(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* w, int64_t out,
            float* y, int64_t y_stride);

// Linear with dense strides (x_stride = in, y_stride = out).
inline void Linear(const float* x, int64_t rows, int64_t in, const float* w, int64_t out,
                   float* y) {
  Linear(x, rows, in, in, w, out, y, out);
}

// c[m, n] = a[m, k] * b[k, n], all dense row-major. m == 0 or n == 0 is a no-op; k == 0 zeroes c.
void MatMul(const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c);

}  // namespace pdserve::kernels::cpu
