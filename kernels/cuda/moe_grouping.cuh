// The grouping of a routed batch's picks by expert, shared by moe_gemm.cu (the mma.sync path) and
// moe_gemm_wgmma.cu (the warpgroup-MMA path). Internal to kernels/cuda; moe_gemm.cuh documents
// the math and validates the arguments.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/block_scaled_mma.cuh"

namespace pdserve::kernels::cuda::moe_grouping {
// Unnamed: each including .cu file gets its own copy of the kernels.
namespace {

namespace bs = block_scaled;

inline constexpr int64_t kMaxExperts = 1024;  // one thread per expert in the grouping block
inline constexpr int kGroupThreads = 1024;

// Exclusive prefix sum of v over the block's 1024 threads (one value each); returns the thread's
// prefix and writes the total to *total. `scratch` holds 1024 ints.
__device__ int32_t BlockExclusiveScan(int32_t v, int32_t* scratch, int32_t* total) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (int offset = 1; offset < kGroupThreads; offset <<= 1) {
    const int32_t add = threadIdx.x >= offset ? scratch[threadIdx.x - offset] : 0;
    __syncthreads();
    scratch[threadIdx.x] += add;
    __syncthreads();
  }
  const int32_t inclusive = scratch[threadIdx.x];
  *total = scratch[kGroupThreads - 1];
  __syncthreads();
  return inclusive - v;
}

// Groups the picks by expert (one block of 1024 threads): entry_pick lists the valid picks
// expert by expert (in no fixed order inside an expert: each pick's result does not depend on
// its position); items cut each expert's entries into runs of at most `chunk`. n_entries (when
// not null) receives the number of valid picks.
__global__ void __launch_bounds__(kGroupThreads)
    GroupPicksKernel(const int32_t* experts, int32_t picks, int32_t n_experts, int32_t chunk,
                     int32_t* entry_pick, bs::WorkItem* items, int32_t* n_items,
                     int32_t* n_entries) {
  __shared__ int32_t count[kMaxExperts];
  __shared__ int32_t fill[kMaxExperts];
  __shared__ int32_t scratch[kGroupThreads];
  bs::GridDependencyTrigger();  // the act-quant kernel (or the GEMM) may launch and wait on this
  bs::GridDependencyWait();     // launched early: the routing and the last call's items
  const int e = threadIdx.x;
  if (e < n_experts) {
    count[e] = 0;
    fill[e] = 0;
  }
  __syncthreads();
  for (int32_t p = threadIdx.x; p < picks; p += kGroupThreads) {
    const int32_t x = experts[p];
    if (x >= 0 && x < n_experts) atomicAdd(&count[x], 1);
  }
  __syncthreads();
  const int32_t mine = e < n_experts ? count[e] : 0;
  const int32_t my_items = (mine + chunk - 1) / chunk;
  int32_t total_entries = 0;
  int32_t total_items = 0;
  const int32_t entry_offset = BlockExclusiveScan(mine, scratch, &total_entries);
  const int32_t item_offset = BlockExclusiveScan(my_items, scratch, &total_items);
  for (int32_t i = 0; i < my_items; ++i) {
    items[item_offset + i] =
        bs::WorkItem{e, entry_offset + i * chunk, min(chunk, mine - i * chunk)};
  }
  if (threadIdx.x == 0) {
    *n_items = total_items;
    if (n_entries != nullptr) *n_entries = total_entries;
  }
  if (e < n_experts) count[e] = entry_offset;  // reused as each expert's first entry
  __syncthreads();
  for (int32_t p = threadIdx.x; p < picks; p += kGroupThreads) {
    const int32_t x = experts[p];
    if (x >= 0 && x < n_experts) entry_pick[count[x] + atomicAdd(&fill[x], 1)] = p;
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda::moe_grouping
