#include <cstdint>

#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Rows up to this many scores (128K tokens at compression 4, plus slack) are read from global
// memory once and kept in shared memory for the five passes.
constexpr int64_t kMaxCachedScores = 40960;

// Order-preserving map float -> uint32 (larger float -> larger key), with -0.0 folded onto +0.0.
__device__ __forceinline__ uint32_t OrderKey(float f) {
  uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Sort key: descending order of this is descending score, then ascending index. Never 0 for a
// real entry (the low word is >= 2^31), so 0 pads the sort.
__device__ __forceinline__ uint64_t PickKey(uint32_t order_key, int32_t index) {
  return (static_cast<uint64_t>(order_key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}

// The order key of entry i: from the shared-memory copy when the row fits there, else from
// global memory.
__device__ __forceinline__ uint32_t KeyAt(const float* row, const uint32_t* cache, int i) {
  return cache != nullptr ? cache[i] : OrderKey(row[i]);
}

// Finds the value v of the `picks`-th largest key among row[0..n) and how many keys equal to v
// belong to the top `picks`.
__device__ void RadixSelect(const float* row, const uint32_t* cache, int n, int picks,
                            uint32_t* hist, uint32_t* shared, uint32_t* threshold,
                            int* ties_needed) {
  uint32_t prefix = 0;
  uint32_t mask = 0;
  int remaining = picks;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    // Scores of one request often share their leading digits: lanes with the same digit add
    // once through their leader instead of contending on one shared-memory word.
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + threadIdx.x;
      const uint32_t key = i < n ? KeyAt(row, cache, i) : 0;
      const bool counted = i < n && (key & mask) == prefix;
      const uint32_t digit = (key >> shift) & 0xFF;
      const uint32_t peers = __match_any_sync(0xFFFFFFFFu, counted ? digit : 0x100u);
      if (counted && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t above = 0;
      int digit = 0;
      for (int d = 255; d >= 0; --d) {
        if (above + hist[d] >= static_cast<uint32_t>(remaining)) {
          digit = d;
          break;
        }
        above += hist[d];
      }
      shared[0] = static_cast<uint32_t>(digit);
      shared[1] = static_cast<uint32_t>(remaining) - above;
    }
    __syncthreads();
    prefix |= shared[0] << shift;
    mask |= 0xFFu << shift;
    remaining = static_cast<int>(shared[1]);
    __syncthreads();
  }
  *threshold = prefix;
  *ties_needed = remaining;
}

// Keeps keys above `threshold` and the first `ties_needed` keys equal to it, in index order.
__device__ void Compact(const float* row, const uint32_t* cache, int n, uint32_t threshold,
                        int ties_needed, uint64_t* picked, uint32_t* warp_counts, uint32_t* count) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int ties_before = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + threadIdx.x;
    const uint32_t key = i < n ? KeyAt(row, cache, i) : 0;
    const bool above = i < n && key > threshold;
    const bool tie = i < n && key == threshold;
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, tie);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int rank = ties_before + __popc(ballot & ((1u << lane) - 1u));
    int chunk_ties = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) rank += static_cast<int>(warp_counts[w]);
      chunk_ties += static_cast<int>(warp_counts[w]);
    }
    if (above || (tie && rank < ties_needed)) picked[atomicAdd(count, 1u)] = PickKey(key, i);
    ties_before += chunk_ties;
    __syncthreads();
  }
}

__device__ void BitonicSortDescending(uint64_t* keys, int size) {
  for (int span = 2; span <= size; span <<= 1) {
    for (int stride = span >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const uint64_t a = keys[i];
          const uint64_t b = keys[j];
          const bool descending = (i & span) == 0;
          if (descending ? a < b : a > b) {
            keys[i] = b;
            keys[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    TopKKernel(const float* scores, int64_t stride, const int32_t* lengths, int k, int sort_size,
               bool cache_row, int32_t* out) {
  extern __shared__ uint64_t picked[];
  // Order keys of the row follow the sort buffer when the row fits in shared memory.
  uint32_t* cache = cache_row ? reinterpret_cast<uint32_t*>(picked + sort_size) : nullptr;
  __shared__ uint32_t hist[256];
  __shared__ uint32_t warp_counts[kWarps];
  __shared__ uint32_t shared[2];
  __shared__ uint32_t count;
  const int64_t r = blockIdx.x;
  const float* row = scores + r * stride;
  const int n = static_cast<int>(min(max(static_cast<int64_t>(lengths[r]), int64_t{0}), stride));
  const int picks = min(k, n);
  if (threadIdx.x == 0) count = 0;
  for (int i = threadIdx.x; i < sort_size; i += blockDim.x) picked[i] = 0;
  __syncthreads();
  if (picks < n) {
    if (cache != nullptr) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) cache[i] = OrderKey(row[i]);
      __syncthreads();
    }
    uint32_t threshold = 0;
    int ties_needed = 0;
    RadixSelect(row, cache, n, picks, hist, shared, &threshold, &ties_needed);
    Compact(row, cache, n, threshold, ties_needed, picked, warp_counts, &count);
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) picked[i] = PickKey(OrderKey(row[i]), i);
  }
  __syncthreads();
  int size = 1;
  while (size < picks) size <<= 1;
  BitonicSortDescending(picked, size);
  int32_t* out_row = out + r * k;
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    out_row[j] =
        j < picks ? static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(picked[j])) : -1;
  }
}

}  // namespace

cudaError_t top_k(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                  int64_t k, int32_t* out, cudaStream_t stream) {
  if (rows < 0 || stride < 0 || k < 1 || k > kMaxTopK || stride > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (scores == nullptr || lengths == nullptr || out == nullptr) return cudaErrorInvalidValue;
  int sort_size = 1;
  while (sort_size < k) sort_size <<= 1;
  const bool cache_row = stride <= kMaxCachedScores;
  const size_t smem = static_cast<size_t>(sort_size) * sizeof(uint64_t) +
                      (cache_row ? static_cast<size_t>(stride) * sizeof(uint32_t) : 0);
  static const cudaError_t attribute_status = cudaFuncSetAttribute(
      TopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(kMaxTopK * sizeof(uint64_t) + kMaxCachedScores * sizeof(uint32_t)));
  if (attribute_status != cudaSuccess) return attribute_status;
  TopKKernel<<<static_cast<unsigned>(rows), kThreads, smem, stream>>>(
      scores, stride, lengths, static_cast<int>(k), sort_size, cache_row, out);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
