// One page's copy by one thread block (the body of copy_pages, kernels/cuda/page_copy.cuh), for
// the kernels that copy pages: copy_pages itself and copy_pages_xxh3 (kernels/cuda/xxh3.cuh),
// which then checksums the landed bytes in the same block. Device code only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/page_copy.cuh"

namespace pdserve::kernels::cuda {

// dst[0, length) = src[0, length) by the THREADS threads of this block: 16-byte loads and stores
// when source, destination and length are 16-aligned, four in flight per thread, else bytes.
// The caller synchronizes the block before any thread reads what another wrote.
template <int THREADS>
__device__ __forceinline__ void CopyPageBlock(const PageCopy& c) {
  const auto* src = static_cast<const uint8_t*>(c.src);
  auto* dst = static_cast<uint8_t*>(c.dst);
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | c.length) & 15) == 0;
  if (aligned) {
    const auto* s = reinterpret_cast<const uint4*>(src);
    auto* d = reinterpret_cast<uint4*>(dst);
    const uint64_t n = c.length / 16;
    uint64_t i = threadIdx.x;
    for (; i + 3 * THREADS < n; i += 4 * THREADS) {
      const uint4 a = s[i];
      const uint4 b = s[i + THREADS];
      const uint4 e = s[i + 2 * THREADS];
      const uint4 f = s[i + 3 * THREADS];
      d[i] = a;
      d[i + THREADS] = b;
      d[i + 2 * THREADS] = e;
      d[i + 3 * THREADS] = f;
    }
    for (; i < n; i += THREADS) d[i] = s[i];
    return;
  }
  for (uint64_t i = threadIdx.x; i < c.length; i += THREADS) dst[i] = src[i];
}

}  // namespace pdserve::kernels::cuda
