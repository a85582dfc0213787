// Device side of block_trace.h: BlockTraceScope at a kernel's entry records its block's start,
// multiprocessor and (by its destructor, on every return path) end; MarkDependency the time
// griddepcontrol.wait returned, Mark the consumer's marks (BlockTraceMark).
#pragma once

#include <cstdint>

#include "kernels/cuda/block_trace.h"

namespace pdserve::kernels::cuda::trace {

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t SmId() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// This block's 4 slots, or nullptr (no trace, or past its capacity).
__device__ __forceinline__ uint64_t* BlockSlots(const BlockTrace& t) {
  if (t.slots == nullptr) return nullptr;
  const int64_t block =
      (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + int64_t{blockIdx.x};
  return block < t.capacity ? t.slots + kBlockTraceSlots * block : nullptr;
}

// Holds a reference to the kernel's BlockTrace argument (parameter space), not the slots'
// address, so that no register stays taken over the kernel's life.
class BlockTraceScope {
 public:
  __device__ __forceinline__ explicit BlockTraceScope(const BlockTrace& t) : trace_(t) {
    uint64_t* const slots = BlockSlots(trace_);
    if (slots != nullptr && threadIdx.x == 0) {
      slots[0] = GlobalTimer();
      slots[3] = SmId();
    }
  }
  __device__ __forceinline__ ~BlockTraceScope() {
    uint64_t* const slots = BlockSlots(trace_);
    if (slots != nullptr && threadIdx.x % 32 == 0) {
      atomicMax(reinterpret_cast<unsigned long long*>(slots + 2),
                static_cast<unsigned long long>(GlobalTimer()));
    }
  }
  // Call in one thread after griddepcontrol.wait.
  __device__ __forceinline__ void MarkDependency() const { Mark(1); }
  // Records the time in slot `slot` (one thread of the block calls it).
  __device__ __forceinline__ void Mark(int slot) const {
    uint64_t* const slots = BlockSlots(trace_);
    if (slots != nullptr) slots[slot] = GlobalTimer();
  }
  BlockTraceScope(const BlockTraceScope&) = delete;
  BlockTraceScope& operator=(const BlockTraceScope&) = delete;

 private:
  const BlockTrace& trace_;
};

}  // namespace pdserve::kernels::cuda::trace
