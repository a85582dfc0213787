#include <cstdint>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/page_copy.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) CopyPagesKernel(const PageCopy* copies) {
  const PageCopy c = copies[blockIdx.x];
  const auto* src = static_cast<const uint8_t*>(c.src);
  auto* dst = static_cast<uint8_t*>(c.dst);
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | c.length) & 15) == 0;
  if (aligned) {
    const auto* s = reinterpret_cast<const uint4*>(src);
    auto* d = reinterpret_cast<uint4*>(dst);
    const uint64_t n = c.length / 16;
    uint64_t i = threadIdx.x;
    // Four loads in flight per thread before the stores.
    for (; i + 3 * kThreads < n; i += 4 * kThreads) {
      const uint4 a = s[i];
      const uint4 b = s[i + kThreads];
      const uint4 e = s[i + 2 * kThreads];
      const uint4 f = s[i + 3 * kThreads];
      d[i] = a;
      d[i + kThreads] = b;
      d[i + 2 * kThreads] = e;
      d[i + 3 * kThreads] = f;
    }
    for (; i < n; i += kThreads) d[i] = s[i];
    return;
  }
  for (uint64_t i = threadIdx.x; i < c.length; i += kThreads) dst[i] = src[i];
}

}  // namespace

cudaError_t copy_pages(const PageCopy* copies, int64_t num_pages, cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("copy_pages", num_pages >= 0);
  PDSERVE_LAUNCH_REQUIRE("copy_pages", num_pages < (int64_t{1} << 31));
  if (num_pages == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("copy_pages", copies != nullptr);
  CopyPagesKernel<<<static_cast<unsigned>(num_pages), kThreads, 0, stream>>>(copies);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
