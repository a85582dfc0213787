#include <cstdint>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/page_copy.cuh"
#include "kernels/cuda/page_copy_block.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) CopyPagesKernel(const PageCopy* copies) {
  CopyPageBlock<kThreads>(copies[blockIdx.x]);
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
