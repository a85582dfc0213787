#include "kernels/cpu/sink_attention.h"

#include <algorithm>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/softmax.h"

namespace pdserve::kernels::cpu {

void SinkAttention(const float* q, int64_t heads, int64_t dim, const float* const* keys, int64_t n,
                   const float* sinks, float scale, float* out, float* scratch) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * dim;
    for (int64_t j = 0; j < n; ++j) {
      scratch[j] = Dot(qh, keys[j], dim) * scale;
    }
    SoftmaxWithSink(scratch, n, sinks[h]);
    float* oh = out + h * dim;
    std::fill(oh, oh + dim, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float p = scratch[j];
      const float* k = keys[j];
      for (int64_t c = 0; c < dim; ++c) oh[c] += p * k[c];
    }
  }
}

}  // namespace pdserve::kernels::cpu
