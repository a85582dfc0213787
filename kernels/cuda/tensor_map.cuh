// The driver's cuTensorMapEncodeTiled for the TMA kernels of kernels/cuda (fp8_gemm_wgmma.cu,
// sparse_decode_attention.cu), reached through the runtime so nothing links libcuda. Host code,
// internal to kernels/cuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace pdserve::kernels::cuda {

// cuTensorMapEncodeTiled, looked up once (thread-safe: a function-local static); nullptr when the
// driver does not have it (the lookup's error is cleared).
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncodeFunction() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult result{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &result) != cudaSuccess ||
        result != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

}  // namespace pdserve::kernels::cuda
