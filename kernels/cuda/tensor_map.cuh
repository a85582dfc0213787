// The driver's cuTensorMapEncodeTiled for the TMA kernels of kernels/cuda (fp8_gemm_wgmma.cu,
// moe_gemm_wgmma.cu, sparse_decode_attention.cu), reached through the runtime so nothing links
// libcuda. Host code, internal to kernels/cuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

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

// A 2-D tensor [rows, k] (e4m3, or bf16 when `bf16`; row stride `stride` elements) in boxes of
// box_rows x 128 bytes with the 128-byte swizzle, rows past the end read as zeros.
inline bool EncodeGemmMap(CUtensorMap* map, const void* p, int64_t rows, int64_t k, int64_t stride,
                          int box_rows, bool bf16) {
  const auto encode = TensorMapEncodeFunction();
  if (encode == nullptr) return false;
  const int64_t element_bytes = bf16 ? 2 : 1;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride * element_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                const_cast<void*>(p), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace pdserve::kernels::cuda
