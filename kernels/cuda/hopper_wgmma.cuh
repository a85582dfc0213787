// Hopper (sm_90a) building blocks shared by the warpgroup-MMA kernels (sparse_decode_attention.cu,
// fp8_gemm_wgmma.cu): wgmma shared-memory descriptors and ordering, mbarriers, and the tensor
// memory accelerator's (TMA) bulk tensor copies. Internal to kernels/cuda; each function is one
// PTX instruction (PTX ISA sections named at each).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cuda::hopper {
// Unnamed: each including .cu file gets its own copy.
namespace {

// wgmma shared-memory matrix descriptor with the 128-byte swizzle: start address, leading and
// stride byte offsets (each >> 4), layout type 1 (PTX ISA "Matrix Descriptor Format").
__device__ __forceinline__ uint64_t SmemDescriptor(uint32_t address, uint32_t leading_bytes,
                                                   uint32_t stride_bytes) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Keeps the compiler from moving accesses of an accumulator across wgmma issue / wait.
template <int N>
__device__ __forceinline__ void FenceRegisters(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Generic-proxy writes to shared memory (cp.async) before async-proxy reads (wgmma).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void MbarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Arrive with release semantics: this thread's earlier shared-memory writes are visible to a
// thread whose wait sees the phase complete.
__device__ __forceinline__ void MbarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase of parity `parity` has completed (acquire).
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Waits for the wgmma groups issued before the last `PENDING` (groups complete in order).
template <int PENDING>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Makes mbarrier.init visible to other threads and to the bulk-copy engine before any of them
// uses the barrier (PTX ISA "membar / fence": fence.mbarrier_init; a CTA is its own cluster).
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive on `bar` and raise its expected transaction count by `bytes` (PTX ISA
// "mbarrier.expect_tx" / "mbarrier.arrive"): the phase completes when every arrival has come and
// the bulk copies that signal it (TmaLoad2d) have delivered that many bytes.
__device__ __forceinline__ void MbarrierArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Copies the box at (inner, outer) (elements; the innermost coordinate first) of the 2-D tensor
// `tensor_map` (a __grid_constant__ CUtensorMap kernel parameter) to shared memory at `dst`, laid
// out and swizzled as the map says; completes `bytes` (the full box, rows past the tensor's end
// included: they are filled with zeros) on `bar` (PTX ISA "cp.async.bulk.tensor").
__device__ __forceinline__ void TmaLoad2d(uint32_t dst, const void* tensor_map, int32_t inner,
                                          int32_t outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}

// Brings a tensor map's 128 bytes into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void PrefetchTensorMap(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map))
               : "memory");
}

// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace
}  // namespace pdserve::kernels::cuda::hopper
