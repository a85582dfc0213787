// Position-by-position comparison of logits against a reference, as the engine issue specifies:
// per position max|diff| / max|ref| and identical argmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pdserve::engine::testing {

struct LogitDiff {
  double worst_relative = 0.0;  // max over positions of max|diff| / max|ref|
  int64_t worst_position = -1;
  int64_t argmax_mismatches = 0;
};

// got, ref: [positions, vocab] row-major.
inline LogitDiff CompareLogits(const float* got, const float* ref, int64_t positions,
                               int64_t vocab) {
  LogitDiff d;
  for (int64_t p = 0; p < positions; ++p) {
    const float* g = got + p * vocab;
    const float* r = ref + p * vocab;
    double max_diff = 0.0;
    double max_ref = 0.0;
    for (int64_t v = 0; v < vocab; ++v) {
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(g[v]) - r[v]));
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(r[v])));
    }
    const double rel = max_ref > 0 ? max_diff / max_ref : max_diff;
    if (!(rel <= d.worst_relative)) {
      d.worst_relative = rel;
      d.worst_position = p;
    }
    if (std::max_element(g, g + vocab) - g != std::max_element(r, r + vocab) - r) {
      ++d.argmax_mismatches;
    }
  }
  return d;
}

}  // namespace pdserve::engine::testing
