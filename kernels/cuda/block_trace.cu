#include <atomic>

#include "kernels/cuda/block_trace.h"

namespace pdserve::kernels::cuda {
namespace {

std::atomic<uint64_t*> trace_slots{nullptr};
std::atomic<int64_t> trace_capacity{0};

}  // namespace

void set_block_trace(uint64_t* slots, int64_t capacity) {
  trace_slots.store(slots);
  trace_capacity.store(slots != nullptr && capacity > 0 ? capacity : 0);
}

BlockTrace block_trace() { return BlockTrace{trace_slots.load(), trace_capacity.load()}; }

}  // namespace pdserve::kernels::cuda
