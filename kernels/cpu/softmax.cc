#include "kernels/cpu/softmax.h"

#include <cmath>
#include <limits>

namespace pdserve::kernels::cpu {
namespace {

// Normalizes x[0..n) by exp(x - max) / (sum + extra), where `extra` is exp(sink - max) or 0.
void StableSoftmax(float* x, int64_t n, float max_value, bool has_sink, float sink) {
  if (max_value == -std::numeric_limits<float>::infinity()) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
    return;
  }
  double sum = has_sink ? std::exp(static_cast<double>(sink - max_value)) : 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - max_value);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace

void Softmax(float* x, int64_t n) {
  float max_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) max_value = std::fmax(max_value, x[i]);
  StableSoftmax(x, n, max_value, /*has_sink=*/false, 0.0f);
}

void SoftmaxWithSink(float* x, int64_t n, float sink) {
  float max_value = sink;
  for (int64_t i = 0; i < n; ++i) max_value = std::fmax(max_value, x[i]);
  StableSoftmax(x, n, max_value, /*has_sink=*/true, sink);
}

}  // namespace pdserve::kernels::cpu
