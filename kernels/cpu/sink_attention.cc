#include "kernels/cpu/sink_attention.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/softmax.h"

namespace pdserve::kernels::cpu {

void SinkAttention(const float* q, int64_t queries, int64_t heads, int64_t dim, const float* keys,
                   int64_t n, const uint8_t* visible, const float* sinks, float scale, float* out) {
  const int64_t rows = queries * heads;
  if (n == 0) {
    std::fill(out, out + rows * dim, 0.0f);
    return;
  }
  std::vector<float> probs(static_cast<size_t>(rows * n));
  Linear(q, rows, dim, keys, n, probs.data());
  ParallelFor(rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* p = probs.data() + r * n;
      const uint8_t* mask = visible + (r / heads) * n;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = mask[j] ? p[j] * scale : -std::numeric_limits<float>::infinity();
      }
      SoftmaxWithSink(p, n, sinks[r % heads]);
    }
  });
  MatMul(probs.data(), rows, n, keys, dim, out);
}

}  // namespace pdserve::kernels::cpu
