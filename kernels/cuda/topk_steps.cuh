// Block- and cluster-wide steps of the radix top-k kernels of kernels/cuda/topk.cu (the only
// file that includes this one): order keys, the shared-memory histogram rounds of the radix
// select over a row split across a thread-block cluster, candidate gathering and the bitonic sort
// of candidates. The method is described in kernels/cuda/topk.cuh; the CPU twin of the select is
// kernels/cpu/topk_radix.h. Every helper assumes blocks of kThreads threads.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "kernels/cpu/topk_radix.h"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda::topk_steps {

namespace cg = cooperative_groups;

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBinBits = 12;
constexpr int kBins = 1 << kBinBits;
constexpr int kMaxCandidates = 4096;  // entries the sort buffer holds
// Row parts up to this many scores (a whole row of 128K tokens at compression 4, plus slack) are
// read from global memory once and kept in shared memory (as order keys) for the later passes.
constexpr int64_t kMaxCachedScores = 40960;
// Shared memory besides the cached part: the candidates and two histograms (alternate rounds use
// alternate buffers, so a block recounts while the cluster's other blocks may still read the last
// round's counts; the merge reuses them for the other blocks' lists).
constexpr size_t kFixedSmemBytes = kMaxCandidates * sizeof(uint64_t) + 2 * kBins * sizeof(uint32_t);
static_assert(2 * kBins * sizeof(uint32_t) == kMaxCandidates * sizeof(uint64_t),
              "the merge copies up to kMaxCandidates picks into the histogram buffers");
// A pass over global memory loads kBatch 16-byte vectors per thread before it looks at any (32 KB
// per block in flight); each is a copy of the pass's code, so the count stays small (the
// kernels' code must fit the instruction cache).
constexpr int kBatch = 2;
// Longest row: the entry indices a pass forms stay below 2^31.
constexpr int64_t kMaxStride = INT32_MAX - 4 * kBatch * kThreads;
constexpr int kMaxTopKBlocks = 8;  // portable cluster size
constexpr uint32_t kFullMask = 0xFFFFFFFFu;
// The select kernels' sample of a long row: every kSampleStride-th entry, or sparser so that each
// thread holds at most kSamplesPerThread.
constexpr int kSampleStride = 16;
constexpr int kSamplesPerThread = 2;
static_assert(kWarps == 32, "block-wide steps reduce one value per warp within one warp");
static_assert(kBins == 4 * kThreads, "FindBin reads four bins per thread");
static_assert(kMaxCandidates >= kMaxTopK, "rows of at most k entries are sorted whole");

using cpu::PickIndex;
using cpu::PickKey;

// Order-preserving map float -> uint32 (larger float -> larger key), with -0.0 folded onto +0.0.
__device__ __forceinline__ uint32_t OrderKey(float f) {
  return cpu::OrderKeyOfBits(__float_as_uint(f));
}

// Shared scalars and per-warp partials of the block-wide steps.
struct Scratch {
  uint32_t warp[2][kWarps];
  uint32_t bin;
  uint32_t above;
  uint32_t in_bin;
  uint32_t count;
  uint32_t ties;                       // this block's entries at the tie key (read by the cluster)
  uint32_t list_len;                   // this block's sorted picks (read by the cluster)
  uint32_t other_len[kMaxTopKBlocks];  // the cluster's list lengths, copied
  uint32_t other_off[kMaxTopKBlocks];  // where each block's list starts in the merge buffer
  // What SelectCandidates gathered: every entry with a key above sel_hi, and the entries with
  // keys in [sel_lo, sel_hi], of which the sel_need best are picks (sel_lo == sel_hi after the
  // tie path, which gathers the picks exactly).
  uint32_t sel_lo;
  uint32_t sel_hi;
  uint32_t sel_need;
  // TopKVariant::kSelectPrefetch: the smallest and largest key in this block's list (read by the
  // row's first block).
  uint32_t key_min;
  uint32_t key_max;
  // TopKVariant::kSelectQuantile: each warp's rank key of the sample (WarpRankKey).
  uint32_t group_keys[kWarps];
  uint32_t group_threshold;  // their median
  // kSelectQuantile, rows of at most kMaxCandidates: each warp's sum of its scores and of their
  // squares (WholeRowPlace's start for the bins).
  float moments[2][kWarps];
  // BucketRankPlace: the last count's first key and bin width (log2).
  uint32_t bin_lo;
  uint32_t bin_shift;
};

// The blocks of one row form a thread-block cluster; with one block per row the cluster steps are
// plain block barriers.
struct RowBlocks {
  int count;  // blocks per row (cluster size)
  int rank;   // this block's rank in its row
};

__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Every thread of every block of the row; a block barrier when the row has one block.
__device__ __forceinline__ void RowSync(const RowBlocks& rb) {
  if (rb.count > 1) {
    ClusterArrive();
    ClusterWait();
  } else {
    __syncthreads();
  }
}

// `p` (this block's shared memory) in block `rank` of the cluster.
template <typename T>
__device__ __forceinline__ T* InBlock(T* p, int rank) {
  return cg::this_cluster().map_shared_rank(p, static_cast<unsigned>(rank));
}

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
// or of floats when kFloats), BATCH vectors per thread loaded before any is looked at (kBatch
// from global memory; 1 from shared memory, whose latency needs no batch, so the inlined f is
// not repeated: the kernel's code stays small enough for the instruction cache). Every lane of a
// warp makes the same calls.
template <bool kFloats, int BATCH = kBatch, typename F>
__device__ __forceinline__ void ForEachVector(const uint4* src, int n4, F&& f) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int q0 = 0; q0 < n4; q0 += BATCH * kThreads) {
    uint4 u[BATCH];
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      const int q = q0 + j * kThreads + tid;
      u[j] = q < n4 ? src[q] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < BATCH; ++j) {
      // Whole warps past the part skip their calls (a warp-uniform test, so f's collectives see
      // every lane of a warp that calls): parts of a few thousand entries would otherwise run
      // BATCH times the work they have.
      if (q0 + j * kThreads + (tid & ~31) >= n4) break;
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
// not null, else from global memory (16 bytes per load when the row is 16-byte aligned). The lanes
// of a warp make the same calls (`valid` is false past the row), so f may use warp collectives
// (not block barriers: warps past the row make fewer calls).
template <typename F>
__device__ __forceinline__ void ForEachKey(const float* row, const uint32_t* cache, int n, F&& f) {
  const int tid = static_cast<int>(threadIdx.x);
  if (cache != nullptr || (reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int n4 = n / 4;
    if (cache != nullptr) {
      ForEachVector<false, 1>(reinterpret_cast<const uint4*>(cache), n4, f);
    } else {
      ForEachVector<true>(reinterpret_cast<const uint4*>(row), n4, f);
    }
    if (4 * n4 < n) {  // the last n % 4 entries
      const int i = 4 * n4 + tid;
      f(i < n ? KeyAt(row, cache, i) : 0u, i, i < n);
    }
  } else {  // 4 kBatch floats per thread in flight, as the aligned path's vectors
    for (int i0 = 0; i0 < n; i0 += 4 * kBatch * kThreads) {
      float v[4 * kBatch];
#pragma unroll
      for (int j = 0; j < 4 * kBatch; ++j) {
        const int i = i0 + j * kThreads + tid;
        v[j] = i < n ? row[i] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < 4 * kBatch; ++j) {
        if (i0 + j * kThreads + (tid & ~31) >= n) break;  // whole warps past the row
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

// Appends `entry` (AppendPick: PickKey(key, index)) of the lanes with `take` to list[count...]
// (one shared atomic per warp; order among appends is arbitrary, the sort fixes it; slots past
// kMaxCandidates are dropped). All lanes must call.
__device__ __forceinline__ void AppendEntry(bool take, uint64_t entry, uint64_t* list,
                                            uint32_t* count) {
  const uint32_t ballot = __ballot_sync(kFullMask, take);
  if (ballot == 0) return;
  const int leader = __ffs(ballot) - 1;
  uint32_t base = 0;
  if ((threadIdx.x & 31) == static_cast<uint32_t>(leader)) base = atomicAdd(count, __popc(ballot));
  const uint32_t slot = __shfl_sync(kFullMask, base, leader) + __popc(ballot & LanesBelow());
  if (take && slot < kMaxCandidates) list[slot] = entry;
}
__device__ __forceinline__ void AppendPick(bool take, uint32_t key, int index, uint64_t* picks,
                                           uint32_t* count) {
  AppendEntry(take, PickKey(key, index), picks, count);
}

// The bin holding the `need`-th largest counted entry of a histogram of kBins bins, of which this
// thread holds bins 4 tid .. 4 tid + 3 in `c`: the largest bin whose entries plus those of the
// bins above number at least `need`. Writes that bin, the entries above it and its own count to s
// (read them after the call). 1 <= need <= total count.
__device__ __forceinline__ void FindBin(const uint4 c, uint32_t need, Scratch& s) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
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

// This thread's four bins of the row's histogram: the sum of `hist` over the row's blocks. Call
// after a RowSync that follows every block's counting.
__device__ __forceinline__ uint4 RowHistogram(const uint32_t* hist, const RowBlocks& rb) {
  uint4 c = reinterpret_cast<const uint4*>(hist)[threadIdx.x];
  for (int b = 0; b < rb.count; ++b) {
    if (b == rb.rank) continue;
    const uint4 o = reinterpret_cast<const uint4*>(InBlock(hist, b))[threadIdx.x];
    c = make_uint4(c.x + o.x, c.y + o.y, c.z + o.z, c.w + o.w);
  }
  return c;
}

// Block-wide sum of one value per thread (all threads call; the result is in every thread).
__device__ __forceinline__ uint32_t BlockSum(uint32_t v, Scratch& s) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  v = __reduce_add_sync(kFullMask, v);
  __syncthreads();  // s.warp[1] may still be read by an earlier step
  if (lane == 0) s.warp[1][warp] = v;
  __syncthreads();
  return __reduce_add_sync(kFullMask, s.warp[1][lane]);
}

// Where SelectCandidates gathers: `entries` with `*count` of them (this block's own list and
// s.count, or block 0's through distributed shared memory, so the row's candidates land in one
// list); `reset`: zero *count before gathering (false where the caller did, before the first
// RowSync).
struct CandidateList {
  uint64_t* entries;
  uint32_t* count;
  bool reset;
};

// Gathers into `list` this block's share of a set of entries that holds the `picks` best of the
// row (picks < n), its size added to *list.count (the row's candidates <= kMaxCandidates; read
// after a barrier). The
// row's n entries are split into consecutive parts, one per block of the row; this block's part
// is part[0, part_n), entry `first` of the row. A radix select whose digits adapt to the data:
// each round counts the entries with keys in [lo, hi] in kBins bins of 2^shift keys ((hi - lo) >>
// shift < kBins; the first round, over all keys, is their top kBinBits bits, counted while the
// part is read) and keeps the bin where the picks end; the counts are the sums over the row's
// blocks, so every block takes the same decisions. As soon as every entry at or above that bin
// fits in the buffer, those are gathered, in any order (the sort orders them, ties by index); at
// one key per bin (after at most 3 rounds) with more ties than fit, the entries above the key and
// the row's lowest-index ties at it are (a block's ties rank after those of the blocks before it).
// The part is read from global memory once when `cache` holds it. `stop_after` (benchmarks; 0
// otherwise) ends it early: 5 after the first count, 6 after the first bin is found; the
// kernel then leaves.
__device__ inline void SelectCandidates(const float* part, int part_n, int first, uint32_t* cache,
                                        int n, int picks, CandidateList list,
                                        uint32_t* hist_buffers, Scratch& s, const RowBlocks& rb,
                                        int stop_after = 0) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  cpu::RadixRange range = cpu::FirstRadixRange(kBinBits);
  int buffer = 0;
  uint32_t* hist = hist_buffers;
  reinterpret_cast<uint4*>(hist)[threadIdx.x] = make_uint4(0, 0, 0, 0);
  const auto count_top_bits = [&](uint32_t key, int i, bool valid) {
    if (valid && cache != nullptr) cache[i] = key;
    CountInBin(hist, valid, key >> range.shift);
  };
  if (cache != nullptr && (reinterpret_cast<uintptr_t>(part) & 15) == 0) {
    // The whole part in flight at once: copied as floats, then turned into keys in place.
    const int n4 = part_n / 4;
    for (int q = threadIdx.x; q < n4; q += kThreads) CopyAsync16(cache + 4 * q, part + 4 * q, true);
    CopyAsyncCommit();
    CopyAsyncWait<0>();
    __syncthreads();
    ForEachVector<true, 1>(reinterpret_cast<const uint4*>(cache), n4, count_top_bits);
    const int i = 4 * n4 + static_cast<int>(threadIdx.x);
    if (4 * n4 < part_n) count_top_bits(i < part_n ? OrderKey(part[i]) : 0u, i, i < part_n);
  } else {
    __syncthreads();
    ForEachKey(part, nullptr, part_n, count_top_bits);
  }
  if (stop_after == 5) return;  // benchmarks: the first count alone (nothing gathered)
  const uint32_t* keys = cache;

  uint32_t need = static_cast<uint32_t>(picks);  // picks still to come from [lo, hi]
  uint32_t in_range = static_cast<uint32_t>(n);  // entries of the row in [lo, hi]
  for (;;) {
    uint32_t bin = 0;
    uint32_t above = 0;
    uint32_t in_bin = in_range;
    if (range.hi != range.lo) {
      RowSync(rb);  // every block's counts of this round are complete (and this block's keys)
      FindBin(RowHistogram(hist, rb), need, s);
      bin = s.bin;
      above = s.above;
      in_bin = s.in_bin;
      if (stop_after == 6) {  // benchmarks: the first round's bin found (nothing gathered)
        RowSync(rb);          // no block leaves while another reads its counts
        return;
      }
    } else {
      __syncthreads();
    }
    need -= above;
    const uint32_t bin_lo = cpu::BinLow(range, bin);
    const uint32_t at_or_above = static_cast<uint32_t>(picks) - need + in_bin;
    if (at_or_above <= kMaxCandidates || range.shift == 0) {
      if (threadIdx.x == 0) {
        if (list.reset) *list.count = 0;
        const bool ties = at_or_above > kMaxCandidates;
        s.sel_lo = bin_lo;
        s.sel_hi = ties || range.shift == 0 ? bin_lo : cpu::NarrowToBin(range, bin, kBinBits).hi;
        s.sel_need = need;
      }
      __syncthreads();
      if (at_or_above <= kMaxCandidates) {
        ForEachKey(part, keys, part_n, [&](uint32_t key, int i, bool valid) {
          AppendPick(valid && key >= bin_lo, key, first + i, list.entries, list.count);
        });
        return;
      }
      // bin_lo is the picks-th best key: everything above it, then the row's first `need` entries
      // at it by index (ranked chunk by chunk; the per-warp counts alternate buffers between
      // chunks), after the ties of the blocks before this one.
      uint32_t ties_before = 0;
      if (rb.count > 1) {
        uint32_t mine = 0;
        for (int i = threadIdx.x; i < part_n; i += kThreads) mine += KeyAt(part, keys, i) == bin_lo;
        mine = BlockSum(mine, s);
        if (threadIdx.x == 0) s.ties = mine;
        RowSync(rb);
        for (int b = 0; b < rb.rank; ++b) ties_before += *InBlock(&s.ties, b);
      }
      for (int i0 = 0, parity = 0; i0 < part_n; i0 += kThreads, parity ^= 1) {
        const int i = i0 + static_cast<int>(threadIdx.x);
        const uint32_t key = i < part_n ? KeyAt(part, keys, i) : 0u;
        const bool tie = i < part_n && key == bin_lo;
        const uint32_t tie_ballot = __ballot_sync(kFullMask, tie);
        if (lane == 0) s.warp[parity][warp] = __popc(tie_ballot);
        __syncthreads();
        const uint32_t warp_ties = s.warp[parity][lane];
        const uint32_t warps_inclusive = WarpInclusiveSum(warp_ties);
        const uint32_t rank = ties_before +
                              __shfl_sync(kFullMask, warps_inclusive - warp_ties, warp) +
                              __popc(tie_ballot & LanesBelow());
        ties_before += __shfl_sync(kFullMask, warps_inclusive, 31);
        AppendPick(i < part_n && (key > bin_lo || (tie && rank < need)), key, first + i,
                   list.entries, list.count);
      }
      return;
    }
    // The next round: the kept bin, counted in bins of 2^(shift - kBinBits) keys or less, into the
    // other buffer (the one the row's blocks read two rounds ago, before the RowSync above).
    range = cpu::NarrowToBin(range, bin, kBinBits);
    in_range = in_bin;
    if (range.hi != range.lo) {
      buffer ^= 1;
      hist = hist_buffers + buffer * kBins;
      reinterpret_cast<uint4*>(hist)[threadIdx.x] = make_uint4(0, 0, 0, 0);
      __syncthreads();
      const uint32_t span = range.hi - range.lo;
      ForEachKey(part, keys, part_n, [&](uint32_t key, int, bool valid) {
        CountInBin(hist, valid && key - range.lo <= span, (key - range.lo) >> range.shift);
      });
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
__device__ inline void BitonicSortDescending(uint64_t* keys, int size) {
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

}  // namespace pdserve::kernels::cuda::topk_steps
