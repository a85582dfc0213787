#include "kernels/cpu/gated_pool.h"

#include <cmath>
#include <limits>

namespace pdserve::kernels::cpu {

void GatedPool(const float* const* kv, const float* const* gate, int64_t rows, int64_t dim,
               float* out) {
  for (int64_t c = 0; c < dim; ++c) {
    float max_gate = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < rows; ++r) max_gate = std::fmax(max_gate, gate[r][c]);
    if (max_gate == -std::numeric_limits<float>::infinity()) {
      out[c] = 0.0f;
      continue;
    }
    float denom = 0.0f;
    float acc = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float w = std::exp(gate[r][c] - max_gate);
      denom += w;
      acc += w * kv[r][c];
    }
    out[c] = acc / denom;
  }
}

}  // namespace pdserve::kernels::cpu
