// Issue 27's floor (a) for the GPU state-transfer benchmarks: the rate of cudaMemcpy device ->
// pinned host -> device of the same bytes (what the staged path's copies alone would take).
// Needs a CUDA device; synchronous; not thread-safe with other work on the device (it times it).
#pragma once

#include <chrono>
#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/ep/flash_shapes.h"
#include "common/status.h"
#include "engine/gpu/device_memory.h"

namespace pdserve::bench {

// GB/s (1e9 B/s) of cudaMemcpy device -> pinned host -> device of `bytes` (median of 9 after two
// warm-ups). Internal for a CUDA error.
inline absl::StatusOr<double> CopyFloor(size_t bytes) {
  engine::gpu::DeviceArray<unsigned char> from;
  engine::gpu::DeviceArray<unsigned char> to;
  engine::gpu::PinnedArray<unsigned char> host;
  PDSERVE_RETURN_IF_ERROR(from.Allocate(bytes));
  PDSERVE_RETURN_IF_ERROR(to.Allocate(bytes));
  PDSERVE_RETURN_IF_ERROR(host.Allocate(bytes));
  PDSERVE_RETURN_IF_ERROR(from.Fill(0x5A));
  std::vector<double> seconds;
  for (int i = 0; i < 11; ++i) {
    const Clock::time_point start = Clock::now();
    PDSERVE_CUDA_RETURN(cudaMemcpy(host.get(), from.get(), bytes, cudaMemcpyDeviceToHost));
    PDSERVE_CUDA_RETURN(cudaMemcpy(to.get(), host.get(), bytes, cudaMemcpyHostToDevice));
    if (i > 1) seconds.push_back(Seconds(start));
  }
  return static_cast<double>(bytes) / Median(seconds) / 1e9;
}

}  // namespace pdserve::bench
