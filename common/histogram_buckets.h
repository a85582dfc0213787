// Histogram bucket bounds shared by every process that exports a histogram (docs/metrics.md
// lists each histogram's buckets). The latency buckets in seconds are metrics::
// LatencyBucketsSeconds (common/metrics.h); the rest are geometric series.
#pragma once

#include <vector>

namespace pdserve::metrics {

// Bounds first, first * factor, ... up to last (inclusive, within a relative 1e-9 so that
// rounding in the products does not drop it): docs/metrics.md's power-of-2 and x2.5 buckets.
// REQUIRES: 0 < first <= last, factor > 1.
inline std::vector<double> GeometricBuckets(double first, double factor, double last) {
  std::vector<double> bounds;
  for (double b = first; b <= last * (1 + 1e-9); b *= factor) bounds.push_back(b);
  return bounds;
}

}  // namespace pdserve::metrics
