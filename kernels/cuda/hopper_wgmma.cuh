// Hopper (sm_90a) building blocks shared by the warpgroup-MMA kernels (sparse_decode_attention.cu,
// fp8_gemm_wgmma.cu): wgmma shared-memory descriptors and ordering, mbarriers, the tensor
// memory accelerator's (TMA) bulk tensor copies, and programmatic dependent launch. Internal to
// kernels/cuda; each function is one PTX instruction (PTX ISA sections named at each).
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

// TmaLoad2d into every block of the cluster whose bit is set in `cta_mask` (bit = block rank):
// the box lands at `dst` in each of them and completes its bytes on the barrier at `bar` there
// (the same shared-memory offsets in every block; PTX ISA "cp.async.bulk.tensor", .multicast).
__device__ __forceinline__ void TmaLoad2dMulticast(uint32_t dst, const void* tensor_map,
                                                   int32_t inner, int32_t outer, uint32_t bar,
                                                   uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(inner), "r"(outer), "r"(bar), "h"(cta_mask)
      : "memory");
}

// The two halves of a cluster barrier (PTX ISA "barrier.cluster"): every non-exited thread of the
// cluster arrives (release: its earlier writes, shared memory included, become visible), then
// waits for all the others (acquire). Each thread alternates arrive and wait.
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}

// Brings a tensor map's 128 bytes into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void PrefetchTensorMap(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map))
               : "memory");
}

// Programmatic dependent launch (PTX ISA "griddepcontrol"): in a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, GridDependencyWait blocks until the kernels
// it depends on have finished and their writes are visible (a no-op in a plain launch);
// GridDependencyTrigger lets a dependent launch of the next kernel begin.
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
__device__ __forceinline__ void GridDependencyTrigger() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// d[64 x 32] = A[64 x 16] * B[16 x 32] (+ d when `accumulate`; fp32), A and B bf16 K-major in
// shared memory, given by descriptors.
__device__ __forceinline__ void WgmmaM64N32K16Bf16(float (&d)[16], uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d[64 x 256] += A[64 x 16] * B[16 x 256] (fp32 accumulate), A bf16 in registers (the accumulator
// layout of WgmmaM64N32K16Bf16 packed to bf16 pairs), B bf16 MN-major in shared memory.
__device__ __forceinline__ void WgmmaM64N256K16Bf16RegA(float (&d)[128], const uint32_t (&a)[4],
                                                        uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
      "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, "
      "%27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, "
      "%63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "
      "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, "
      "%99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, "
      "%114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, "
      "%129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace
}  // namespace pdserve::kernels::cuda::hopper
