#include "kernels/cpu/topk.h"

#include <algorithm>
#include <numeric>

namespace pdserve::kernels::cpu {

void TopK(const float* scores, int64_t n_candidates, int64_t k, int32_t* out, int32_t* scratch) {
  const int64_t picks = std::min(k, n_candidates);
  std::iota(scratch, scratch + n_candidates, 0);
  const auto better = [scores](int32_t a, int32_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  };
  std::partial_sort(scratch, scratch + picks, scratch + n_candidates, better);
  std::copy(scratch, scratch + picks, out);
  std::fill(out + picks, out + k, -1);
}

}  // namespace pdserve::kernels::cpu
