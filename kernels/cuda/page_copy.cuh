// Device-to-device copy of a batch of pages in one launch: the receiver's gather of state pages
// from a peer's arena (kvtransfer/cuda_ipc) into its own page table, where one cudaMemcpyAsync per
// page would cost a few microseconds of host time each (thousands of pages per prompt at 128K
// tokens). CPU twin: std::memcpy per page.
//
// One thread block per page; 16-byte loads and stores when source, destination and length are
// 16-aligned, else byte by byte. Pages must not overlap each other's destinations or their own
// source. Sources may be a peer's IPC mapping on the same GPU. CUDA-graph safe.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

struct PageCopy {
  const void* src;
  void* dst;
  uint64_t length;  // bytes
};

// For i < num_pages: dst[i][0, length) = src[i][0, length). `copies` in device memory;
// num_pages >= 0 (0 launches nothing), < 2^31; copies non-null when num_pages > 0. Returns
// cudaErrorInvalidValue on bad arguments (the refusal names the check), else the launch status.
// Asynchronous on `stream`.
cudaError_t copy_pages(const PageCopy* copies, int64_t num_pages, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
