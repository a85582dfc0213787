#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;
constexpr int kMaxCandidates = 4096;  // entries the sort buffer holds
// Rows up to this many scores (128K tokens at compression 4, plus slack) are read from global
// memory once and kept in shared memory (as order keys) for the later passes.
constexpr int64_t kMaxCachedScores = 40960;
// A pass loads kBatch 16-byte vectors per thread before it looks at any, so that a pass over
// global memory keeps 64 KB per block in flight.
constexpr int kBatch = 4;
// Longest row: the entry indices a pass forms stay below 2^31.
constexpr int64_t kMaxStride = INT32_MAX - 4 * kBatch * kThreads;
constexpr uint32_t kFullMask = 0xFFFFFFFFu;
static_assert(kWarps == 32, "block-wide steps reduce one value per warp within one warp");
static_assert(kBins == 4 * kThreads, "FindBin reads four bins per thread");
static_assert(kMaxCandidates >= kMaxTopK, "rows of at most k entries are sorted whole");

// Order-preserving map float -> uint32 (larger float -> larger key), with -0.0 folded onto +0.0.
__device__ __forceinline__ uint32_t OrderKey(float f) {
  uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Sort key: descending order of this is descending score, then ascending index. Never 0 for a
// real entry (the low word is >= 2^31), so 0 pads the sort.
__device__ __forceinline__ uint64_t PickKey(uint32_t order_key, int index) {
  return (static_cast<uint64_t>(order_key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}

__device__ __forceinline__ int32_t PickIndex(uint64_t pick) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(pick));
}

// Shared scalars and per-warp partials of the block-wide steps.
struct Scratch {
  uint32_t warp[2][kWarps];
  uint32_t bin;
  uint32_t above;
  uint32_t in_bin;
  uint32_t count;
};

__device__ __forceinline__ uint32_t WarpInclusiveSum(uint32_t v) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const uint32_t below = __shfl_up_sync(kFullMask, v, offset);
    if (lane >= offset) v += below;
  }
  return v;
}

__device__ __forceinline__ uint32_t LanesBelow() { return (1u << (threadIdx.x & 31)) - 1u; }

// The order key of entry i: from the shared-memory copy when the row has one, else from global
// memory.
__device__ __forceinline__ uint32_t KeyAt(const float* row, const uint32_t* cache, int i) {
  return cache != nullptr ? cache[i] : OrderKey(row[i]);
}

// Calls f(key, index, valid) for the 4 * n4 entries of src[0, n4) (16-byte vectors of order keys,
// or of floats when kFloats), kBatch vectors per thread loaded before any is looked at.
template <bool kFloats, typename F>
__device__ __forceinline__ void ForEachVector(const uint4* src, int n4, F&& f) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int q0 = 0; q0 < n4; q0 += kBatch * kThreads) {
    uint4 u[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int q = q0 + j * kThreads + tid;
      u[j] = q < n4 ? src[q] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int q = q0 + j * kThreads + tid;
      if constexpr (kFloats) {
        u[j] = make_uint4(OrderKey(__uint_as_float(u[j].x)), OrderKey(__uint_as_float(u[j].y)),
                          OrderKey(__uint_as_float(u[j].z)), OrderKey(__uint_as_float(u[j].w)));
      }
      f(u[j].x, 4 * q, q < n4);
      f(u[j].y, 4 * q + 1, q < n4);
      f(u[j].z, 4 * q + 2, q < n4);
      f(u[j].w, 4 * q + 3, q < n4);
    }
  }
}

// Calls f(key, index, valid) for every entry of row[0, n), in no fixed order: from `cache` when
// not null, else from global memory (16 bytes per load when the row is 16-byte aligned). Every
// thread makes the same number of calls (`valid` is false past the row), so f may use warp
// collectives.
template <typename F>
__device__ __forceinline__ void ForEachKey(const float* row, const uint32_t* cache, int n, F&& f) {
  const int tid = static_cast<int>(threadIdx.x);
  if (cache != nullptr || (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int n4 = n / 4;
    if (cache != nullptr) {
      ForEachVector<false>(reinterpret_cast<const uint4*>(cache), n4, f);
    } else {
      ForEachVector<true>(reinterpret_cast<const uint4*>(row), n4, f);
    }
    if (4 * n4 < n) {  // the last n % 4 entries
      const int i = 4 * n4 + tid;
      f(i < n ? KeyAt(row, cache, i) : 0u, i, i < n);
    }
  } else {
    for (int i0 = 0; i0 < n; i0 += 4 * kBatch * kThreads) {
      float v[4 * kBatch];
#pragma unroll
      for (int j = 0; j < 4 * kBatch; ++j) {
        const int i = i0 + j * kThreads + tid;
        v[j] = i < n ? row[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < 4 * kBatch; ++j) {
        const int i = i0 + j * kThreads + tid;
        f(OrderKey(v[j]), i, i < n);
      }
    }
  }
}

// Counts an entry in hist[bin]. An increment by one compiles to ATOMS.POPC.INC, which (by its
// name; to confirm in a profile of tie-heavy rows) adds the lanes of a warp that share a word in
// one update, so ties and narrow score ranges need no vote-based aggregation here.
__device__ __forceinline__ void CountInBin(uint32_t* hist, bool counted, uint32_t bin) {
  if (counted) atomicAdd(&hist[bin], 1u);
}

// Appends PickKey(key, index) of the lanes with `take` to picks[count...] (one shared atomic per
// warp; order among appends is arbitrary, the sort fixes it). All lanes must call.
__device__ __forceinline__ void AppendPick(bool take, uint32_t key, int index, uint64_t* picks,
                                           uint32_t* count) {
  const uint32_t ballot = __ballot_sync(kFullMask, take);
  if (ballot == 0) return;
  const int leader = __ffs(ballot) - 1;
  uint32_t base = 0;
  if ((threadIdx.x & 31) == static_cast<uint32_t>(leader)) base = atomicAdd(count, __popc(ballot));
  const uint32_t slot = __shfl_sync(kFullMask, base, leader) + __popc(ballot & LanesBelow());
  if (take && slot < kMaxCandidates) picks[slot] = PickKey(key, index);
}

// In the histogram hist[kBins], the bin holding the `need`-th largest counted entry: the largest
// bin whose entries plus those of the bins above number at least `need`. Writes that bin, the
// entries above it and its own count to s (read them after the call). 1 <= need <= total count.
__device__ __forceinline__ void FindBin(const uint32_t* hist, uint32_t need, Scratch& s) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const uint4 c = reinterpret_cast<const uint4*>(hist)[threadIdx.x];  // bins 4 tid .. 4 tid + 3
  uint32_t inclusive = WarpInclusiveSum(c.x + c.y + c.z + c.w);
  if (lane == 31) s.warp[0][warp] = inclusive;
  __syncthreads();
  const uint32_t warp_total = s.warp[0][lane];
  const uint32_t warps_inclusive = WarpInclusiveSum(warp_total);
  const uint32_t total = __shfl_sync(kFullMask, warps_inclusive, 31);
  inclusive += __shfl_sync(kFullMask, warps_inclusive - warp_total, warp);
  uint32_t running = total - inclusive;  // entries in the bins of higher threads
  const uint32_t counts[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int q = 3; q >= 0; --q) {
    if (running < need && running + counts[q] >= need) {
      s.bin = 4 * threadIdx.x + q;
      s.above = running;
      s.in_bin = counts[q];
    }
    running += counts[q];
  }
  __syncthreads();
}

// Gathers into `cand` a set of entries that holds the `picks` best of row[0, n) (picks < n) and
// returns its size (<= kMaxCandidates). A radix select whose digits adapt to the data: each round
// counts the entries with keys in [lo, hi] in kBins bins of 2^shift keys ((hi - lo) >> shift <
// kBins; the first round, over all keys, is their top kBinBits bits, counted while the row is
// read) and keeps the bin where the picks end. As soon as every entry at or above that bin fits in
// the buffer, those are gathered, in any order (the sort orders them, ties by index); at one key
// per bin (after at most 3 rounds) with more ties than fit, the entries above the key and the
// lowest-index ties at it are. The row is read from global memory once when `cache` holds it.
__device__ int SelectCandidates(const float* row, uint32_t* cache, int n, int picks, uint64_t* cand,
                                uint32_t* hist, Scratch& s) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  uint32_t lo = 0;
  uint32_t hi = 0xFFFFFFFFu;
  int shift = 32 - kBinBits;
  reinterpret_cast<uint4*>(hist)[threadIdx.x] = make_uint4(0, 0, 0, 0);
  const auto count_top_bits = [&](uint32_t key, int i, bool valid) {
    if (valid && cache != nullptr) cache[i] = key;
    CountInBin(hist, valid, key >> shift);
  };
  if (cache != nullptr && (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    // The whole row in flight at once: copied as floats, then turned into keys in place.
    const int n4 = n / 4;
    for (int q = threadIdx.x; q < n4; q += kThreads) CopyAsync16(cache + 4 * q, row + 4 * q, true);
    CopyAsyncCommit();
    CopyAsyncWait<0>();
    __syncthreads();
    ForEachVector<true>(reinterpret_cast<const uint4*>(cache), n4, count_top_bits);
    const int i = 4 * n4 + static_cast<int>(threadIdx.x);
    if (4 * n4 < n) count_top_bits(i < n ? OrderKey(row[i]) : 0u, i, i < n);
  } else {
    __syncthreads();
    ForEachKey(row, nullptr, n, count_top_bits);
  }
  __syncthreads();
  const uint32_t* keys = cache;

  uint32_t need = static_cast<uint32_t>(picks);  // picks still to come from [lo, hi]
  uint32_t in_range = static_cast<uint32_t>(n);  // entries in [lo, hi]
  for (;;) {
    uint32_t bin = 0;
    uint32_t above = 0;
    uint32_t in_bin = in_range;
    if (hi != lo) {
      FindBin(hist, need, s);
      bin = s.bin;
      above = s.above;
      in_bin = s.in_bin;
    }
    need -= above;
    const uint32_t bin_lo = lo + (bin << shift);
    const uint32_t at_or_above = static_cast<uint32_t>(picks) - need + in_bin;
    if (at_or_above <= kMaxCandidates || shift == 0) {
      if (threadIdx.x == 0) s.count = 0;
      __syncthreads();
      if (at_or_above <= kMaxCandidates) {
        ForEachKey(row, keys, n, [&](uint32_t key, int i, bool valid) {
          AppendPick(valid && key >= bin_lo, key, i, cand, &s.count);
        });
        return static_cast<int>(at_or_above);
      }
      // bin_lo is the picks-th best key: everything above it, then its first `need` entries by
      // index (ranked chunk by chunk; the per-warp counts alternate buffers between chunks).
      uint32_t ties_before = 0;
      for (int i0 = 0, parity = 0; i0 < n; i0 += kThreads, parity ^= 1) {
        const int i = i0 + static_cast<int>(threadIdx.x);
        const uint32_t key = i < n ? KeyAt(row, keys, i) : 0u;
        const bool tie = i < n && key == bin_lo;
        const uint32_t tie_ballot = __ballot_sync(kFullMask, tie);
        if (lane == 0) s.warp[parity][warp] = __popc(tie_ballot);
        __syncthreads();
        const uint32_t warp_ties = s.warp[parity][lane];
        const uint32_t warps_inclusive = WarpInclusiveSum(warp_ties);
        const uint32_t rank = ties_before +
                              __shfl_sync(kFullMask, warps_inclusive - warp_ties, warp) +
                              __popc(tie_ballot & LanesBelow());
        ties_before += __shfl_sync(kFullMask, warps_inclusive, 31);
        AppendPick(i < n && (key > bin_lo || (tie && rank < need)), key, i, cand, &s.count);
      }
      return picks;
    }
    // The next round: the kept bin, counted in bins of 2^(shift - kBinBits) keys or less.
    hi = hi - bin_lo > (1u << shift) - 1u ? bin_lo + ((1u << shift) - 1u) : hi;
    lo = bin_lo;
    in_range = in_bin;
    const uint32_t range = hi - lo;
    shift = max(0, 32 - __clz(range) - kBinBits);
    if (range != 0) {
      reinterpret_cast<uint4*>(hist)[threadIdx.x] = make_uint4(0, 0, 0, 0);
      __syncthreads();
      ForEachKey(row, keys, n, [&](uint32_t key, int, bool valid) {
        CountInBin(hist, valid && key - lo <= range, (key - lo) >> shift);
      });
      __syncthreads();
    }
  }
}

// The compare-exchange steps of strides below 32 of the bitonic merges of spans first_span ..
// last_span (descending where bit `span` of the index is 0), on each warp's 32 consecutive
// entries in registers.
__device__ __forceinline__ void WarpBitonic(uint64_t* keys, int size, int first_span,
                                            int last_span) {
  for (int e = threadIdx.x; e < size; e += kThreads) {  // whole warps: size % 32 == 0
    uint64_t v = keys[e];
    for (int span = first_span; span <= last_span; span <<= 1) {
      const bool descending = (e & span) == 0;
      for (int stride = min(span / 2, 16); stride > 0; stride >>= 1) {
        const uint64_t other = __shfl_xor_sync(kFullMask, v, stride);
        const bool keep_larger = ((e & stride) == 0) == descending;
        v = (v > other) == keep_larger ? v : other;
      }
    }
    keys[e] = v;
  }
}

// Sorts keys[0, size) descending; size is a power of two in [32, kMaxCandidates].
__device__ void BitonicSortDescending(uint64_t* keys, int size) {
  WarpBitonic(keys, size, 2, min(size, 32));
  __syncthreads();
  for (int span = 64; span <= size; span <<= 1) {
    for (int stride = span / 2; stride >= 32; stride >>= 1) {
      for (int pair = threadIdx.x; pair < size / 2; pair += kThreads) {
        const int i = ((pair & ~(stride - 1)) << 1) | (pair & (stride - 1));
        const uint64_t a = keys[i];
        const uint64_t b = keys[i + stride];
        if ((i & span) == 0 ? a < b : a > b) {
          keys[i] = b;
          keys[i + stride] = a;
        }
      }
      __syncthreads();
    }
    WarpBitonic(keys, size, span, span);
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads)
    TopKKernel(const float* scores, int64_t stride, const int32_t* lengths, int k, bool cache_row,
               int32_t* out) {
  extern __shared__ __align__(16) uint64_t smem[];
  uint64_t* const cand = smem;                                                // [kMaxCandidates]
  uint32_t* const hist = reinterpret_cast<uint32_t*>(cand + kMaxCandidates);  // [kBins]
  uint32_t* const cache = cache_row ? hist + kBins : nullptr;                 // [stride]
  __shared__ Scratch s;
  const int64_t r = blockIdx.x;
  const float* row = scores + r * stride;
  const int n = static_cast<int>(min(max(static_cast<int64_t>(lengths[r]), int64_t{0}), stride));
  const int picks = min(k, n);
  int count = n;
  if (n <= max(picks, kThreads)) {  // short rows are sorted whole
    for (int i = threadIdx.x; i < n; i += kThreads) cand[i] = PickKey(OrderKey(row[i]), i);
  } else {
    count = SelectCandidates(row, cache, n, picks, cand, hist, s);
  }
  int size = 32;
  while (size < count) size <<= 1;
  __syncthreads();
  for (int i = count + static_cast<int>(threadIdx.x); i < size; i += kThreads) cand[i] = 0;
  __syncthreads();
  BitonicSortDescending(cand, size);
  int32_t* out_row = out + r * k;
  for (int j = threadIdx.x; j < k; j += kThreads) out_row[j] = j < picks ? PickIndex(cand[j]) : -1;
}

}  // namespace

cudaError_t top_k(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                  int64_t k, int32_t* out, cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("top_k", rows >= 0);
  PDSERVE_LAUNCH_REQUIRE("top_k", stride >= 0);
  PDSERVE_LAUNCH_REQUIRE("top_k", k >= 1);
  PDSERVE_LAUNCH_REQUIRE("top_k", k <= kMaxTopK);
  PDSERVE_LAUNCH_REQUIRE("top_k", stride <= kMaxStride);
  if (rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("top_k", scores != nullptr);
  PDSERVE_LAUNCH_REQUIRE("top_k", lengths != nullptr);
  PDSERVE_LAUNCH_REQUIRE("top_k", out != nullptr);
  const bool cache_row = stride <= kMaxCachedScores;
  const size_t smem = kMaxCandidates * sizeof(uint64_t) + kBins * sizeof(uint32_t) +
                      (cache_row ? static_cast<size_t>(stride) * sizeof(uint32_t) : 0);
  static const cudaError_t attribute_status = cudaFuncSetAttribute(
      TopKKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(kMaxCandidates * sizeof(uint64_t) + kBins * sizeof(uint32_t) +
                       kMaxCachedScores * sizeof(uint32_t)));
  if (attribute_status != cudaSuccess) return attribute_status;
  TopKKernel<<<static_cast<unsigned>(rows), kThreads, smem, stream>>>(
      scores, stride, lengths, static_cast<int>(k), cache_row, out);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
