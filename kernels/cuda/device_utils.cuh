// Device helpers shared by the CUDA kernels: asynchronous 16-byte copies with zero fill, the
// bf16 m16n8k16 tensor-core product, bf16 packing and fp32 <-> storage-type conversion.
//
// Fragment layouts follow the PTX ISA ("Matrix fragments for mma.m16n8k16 with floating point
// type"): with g = lane / 4 and t = lane % 4, the f32 accumulator holds (row g, cols 2t, 2t+1) in
// c[0..1] and (row g + 8, same cols) in c[2..3]; the row-major A operand holds (row g, cols
// 2t..2t+1) in a[0], (row g + 8) in a[1], and the same rows at cols + 8 in a[2], a[3]; the
// column-major B operand holds (rows 2t..2t+1, col g) in b[0] and rows + 8 in b[1]. Requires sm_80
// or newer.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

// Copies 16 bytes global -> shared asynchronously; when `valid` is false the destination is filled
// with zeros and `src` is not read (so unused page slots, which may hold NaN, never reach a
// kernel).
__device__ __forceinline__ void CopyAsync16(void* smem_dst, const void* src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// d += a * b for one 16x8x16 bf16 tile with f32 accumulation.
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Loads the B operand of two adjacent 16x8 tiles (cols n0..n0+15) from a row-major [k][n] bf16
// array in shared memory: b0 for cols n0..n0+7, b1 for n0+8..n0+15. `row_ptr` is this lane's row
// address: row k0 + (lane & 15), col n0 + (lane >> 4) * 8.
__device__ __forceinline__ void LoadBTransposed(const __nv_bfloat16* row_ptr, uint32_t (&b0)[2],
                                                uint32_t (&b1)[2]) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(b0[0]), "=r"(b0[1]), "=r"(b1[0]), "=r"(b1[1])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t LoadPair(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Storage type <-> fp32 for kernels that take fp32 or bf16 tensors and compute in fp32; the store
// rounds to nearest even once.
__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

}  // namespace pdserve::kernels::cuda
