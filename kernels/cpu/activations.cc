#include "kernels/cpu/activations.h"

#include <algorithm>

namespace pdserve::kernels::cpu {

void ClampedSwiGlu(const float* gate, const float* up, int64_t n, float limit, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = std::min(gate[i], limit);
    const float u = std::clamp(up[i], -limit, limit);
    out[i] = Silu(g) * u;
  }
}

}  // namespace pdserve::kernels::cpu
