// Steps of TopKVariant::kSelectPrefetch (kernels/cuda/topk.cu TopKSelectKernel<true>, the only
// file that includes this one), on rows longer than kMaxCandidates: the sample's threshold found
// by rounds of 256 bins that one warp scans, while the block's part of the row is already on its
// way into registers; the part's entries at or above the threshold gathered into the block's own
// list (one shared atomic per warp and chunk); and the row's first block reading every block's
// list through distributed shared memory. The decisions (threshold, sampled or not, the placing)
// are those of kernels/cpu/topk_radix.h with sample_bin_bits = kSampleBinBits.
#pragma once

#include <cstdint>

#include "kernels/cpu/topk_radix.h"
#include "kernels/cuda/topk_steps.cuh"

namespace pdserve::kernels::cuda::topk_steps {

// The sample's histogram rounds: 2^kSampleBinBits bins each, at most 32 / kSampleBinBits rounds
// (each into its own zeroed buffer, so no round waits for the last one's readers).
constexpr int kSampleBinBits = 8;
constexpr int kSampleBins = 1 << kSampleBinBits;
constexpr int kSampleRounds = 32 / kSampleBinBits;
static_assert(kSampleBins == 8 * 32, "one warp scans the bins, eight per lane");
static_assert(kSampleRounds * kSampleBins == kThreads, "every thread zeroes one word");
static_assert(kSampleRounds * kSampleBins <= kBins, "the buffers fit one histogram");
// 16-byte vectors of the block's part loaded per thread before the threshold is known (12
// entries per thread: the whole part of a 32K-entry row split over 3 or more blocks); longer parts
// go in chunks of as many, each vector loaded again with the next chunk's once it is gathered (4
// would spill registers: 1024 threads have 64 each).
constexpr int kPrefetchVectors = 3;

// This thread's share of the row's sample (kSamplesPerThread keys, 0 past the sample) and the
// rank in the sample of the key the threshold sits at or below: ceil(1.5 picks / stride) + 24.
struct RowSample {
  uint32_t key[kSamplesPerThread];
  uint32_t valid;  // bit j: key[j] is a sample
  int samples;
  uint32_t need;
};
// SPREAD (kSelectQuantile): at most cpu::kQuantileSamples samples, one a thread, thread (warp w,
// lane l) holding sample w + 32 l (key[1] is 0), so that each warp's samples span the row (every
// 32nd sample: a row whose scores trend along it gives every warp the same quantile), and a
// warp's 32 loads touch as many 128-byte lines as the 64 of a warp without SPREAD; else thread
// tid holds samples tid + j kThreads.
template <bool SPREAD = false>
__device__ __forceinline__ RowSample LoadSample(const float* row, int n, int picks) {
  static_assert(cpu::kQuantileSamples == kThreads, "SPREAD: one sample a thread");
  constexpr int kPerThread = SPREAD ? 1 : kSamplesPerThread;
  const int tid = static_cast<int>(threadIdx.x);
  const int first = SPREAD ? tid / 32 + 32 * (tid % 32) : tid;
  const int stride = cpu::SampleStride(n, kSampleStride, kPerThread * kThreads);
  RowSample sample;
  sample.samples = (n + stride - 1) / stride;
  sample.need =
      static_cast<uint32_t>(min(sample.samples, (3 * picks + 2 * stride - 1) / (2 * stride) + 24));
  sample.valid = 0;
#pragma unroll
  for (int j = 0; j < kSamplesPerThread; ++j) {
    const int e = first + j * kThreads;
    const bool valid = j < kPerThread && e < sample.samples;
    sample.key[j] = valid ? OrderKey(row[static_cast<int64_t>(e) * stride]) : 0u;
    sample.valid |= valid ? 1u << j : 0u;
  }
  return sample;
}

// kSelectQuantile, one warp: the rank-th best of the warp's sample keys (LoadSample<true>),
// counted with repeats (0 past the sample; the CPU twin's group key), by rank rounds of a warp
// max that removes one holder's key each. Every lane gets it.
static_assert(kSamplesPerThread == 2, "WarpRankKey keeps a lane's two keys as a high and a low");
static_assert(kWarps == cpu::kQuantileGroups, "a warp's samples are one group of the twin");
__device__ __forceinline__ uint32_t WarpRankKey(const RowSample& sample, int rank) {
  const uint32_t lane = threadIdx.x % 32;
  uint32_t high = max(sample.key[0], sample.key[1]);
  uint32_t low = min(sample.key[0], sample.key[1]);
  uint32_t best = 0;
  for (int i = 0; i < rank; ++i) {
    best = __reduce_max_sync(kFullMask, high);
    const uint32_t holder = __ffs(__ballot_sync(kFullMask, high == best)) - 1;
    if (lane == holder) {
      high = low;
      low = 0;
    }
  }
  return best;
}

// kSelectQuantile: the cpu::kQuantileMedianRank-th best of the kWarps group keys at `group_keys`
// (shared memory, written before a barrier that precedes the call): lane j counts the keys above
// and at or above its key j. One warp calls; every lane gets it.
__device__ __forceinline__ uint32_t MedianOfWarps(const uint32_t* group_keys) {
  const uint32_t mine = group_keys[threadIdx.x % 32];
  int above = 0;
  int at_least = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const uint32_t other = __shfl_sync(kFullMask, mine, j);
    above += other > mine ? 1 : 0;
    at_least += other >= mine ? 1 : 0;
  }
  const bool median = above < cpu::kQuantileMedianRank && at_least >= cpu::kQuantileMedianRank;
  return __shfl_sync(kFullMask, mine, __ffs(__ballot_sync(kFullMask, median)) - 1);
}

// The threshold of the sample: the lower bound of the bin holding its need-th best key, by
// rounds of kSampleBins bins that stop once that bin holds at most 8 samples or one key (the CPU
// twin's SampleThreshold with sample_bin_bits = kSampleBinBits). Each round counts with every
// thread and is scanned by warp 0 alone: two barriers per round. hists: kSampleRounds x
// kSampleBins words, zeroed before a barrier that precedes the call. Every thread calls and gets
// the same key.
__device__ inline uint32_t SampleThresholdByWarp(const RowSample& sample, uint32_t* hists,
                                                 Scratch& s) {
  const int tid = static_cast<int>(threadIdx.x);
  uint32_t need = sample.need;
  cpu::RadixRange range = cpu::FirstRadixRange(kSampleBinBits);
  for (int round = 0;; ++round) {
    uint32_t* const hist = hists + round * kSampleBins;
    const uint32_t span = range.hi - range.lo;
#pragma unroll
    for (int j = 0; j < kSamplesPerThread; ++j) {
      const uint32_t key = sample.key[j];
      CountInBin(hist, ((sample.valid >> j) & 1u) != 0 && key - range.lo <= span,
                 (key - range.lo) >> range.shift);
    }
    __syncthreads();
    if (tid < 32) {  // bins 8 tid .. 8 tid + 7
      const uint4 a = reinterpret_cast<const uint4*>(hist)[2 * tid];
      const uint4 b = reinterpret_cast<const uint4*>(hist)[2 * tid + 1];
      const uint32_t c[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      uint32_t mine = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) mine += c[q];
      const uint32_t inclusive = WarpInclusiveSum(mine);
      uint32_t running = __shfl_sync(kFullMask, inclusive, 31) - inclusive;  // higher lanes' bins
#pragma unroll
      for (int q = 7; q >= 0; --q) {
        if (running < need && running + c[q] >= need) {
          s.bin = 8 * tid + q;
          s.above = running;
          s.in_bin = c[q];
        }
        running += c[q];
      }
    }
    __syncthreads();  // s of this round; the next round counts into another buffer
    need -= s.above;
    if (s.in_bin <= 8 || range.shift == 0) return cpu::BinLow(range, s.bin);
    range = cpu::NarrowToBin(range, s.bin, kSampleBinBits);
  }
}

// Loads this thread's vectors q0 + j kThreads + tid (j < kPrefetchVectors) of src[0, n4), zeros
// past it.
__device__ __forceinline__ void LoadVectors(uint4 (&u)[kPrefetchVectors], const uint4* src, int q0,
                                            int n4) {
#pragma unroll
  for (int j = 0; j < kPrefetchVectors; ++j) {
    const int q = q0 + j * kThreads + static_cast<int>(threadIdx.x);
    u[j] = q < n4 ? src[q] : make_uint4(0, 0, 0, 0);
  }
}

// The smaller and larger of two floats, NaN ignored (as fminf / fmaxf), denormals kept whatever
// the build's flags (min.f32 / max.f32 without .ftz): the taken scores' range must cover every
// taken key (BucketRankPlace bins from it). A comparison flushed to zero (a build with -ftz=true)
// only takes more scores (the flush keeps their order), which the placing sorts out; the range
// is what would misplace picks.
__device__ __forceinline__ float TakenMin(float a, float b) {
  float r;
  asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float TakenMax(float a, float b) {
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// This block's list of entries at or above a threshold: cand[0, *count) (the count goes on past
// kMaxCandidates, whose entries are dropped), entries cpu::ListEntryOfBits (the score's float
// bits, turned into PickKeys by LoadRowCandidates), and the smallest and largest score taken, per
// thread (NaN while none is: TakenMin and TakenMax return the other operand).
struct LocalList {
  uint64_t* cand;
  uint32_t* count;
  uint32_t threshold;  // an order key
  float at_least;      // cpu::BitsAtOrAbove(threshold): a score is taken when >= it
  int first;           // the part's first entry in the row
  float taken_min;
  float taken_max;
};
__device__ __forceinline__ LocalList MakeLocalList(uint64_t* cand, uint32_t* count,
                                                   uint32_t threshold, int first) {
  const float nan = __uint_as_float(0x7FC00000u);
  return LocalList{cand,  count, threshold, __uint_as_float(cpu::BitsAtOrAbove(threshold)),
                   first, nan,   nan};
}

// Appends the entries of LoadVectors(u, ..., q0, n4) (floats) at or above the threshold to the
// list: one warp-wide sum and one shared atomic per warp. RELOAD: each u[j], once appended, is
// loaded again with the next chunk's vector (LoadVectors(u, src, q1, n4)), so that its load is in
// flight while the rest of this chunk is appended, in the same registers (a second set of
// registers for the next chunk made the kernel spill: 64 a thread at 1024 threads). Every lane of
// the warp calls.
template <bool RELOAD = false>
__device__ __forceinline__ void AppendVectors(uint4 (&u)[kPrefetchVectors], int q0, int n4,
                                              LocalList& list, const uint4* src = nullptr,
                                              int q1 = 0) {
  const int tid = static_cast<int>(threadIdx.x);
  uint32_t taken = 0;
#pragma unroll
  for (int j = 0; j < kPrefetchVectors; ++j) {
    const bool valid = q0 + j * kThreads + tid < n4;
    const float x[4] = {__uint_as_float(u[j].x), __uint_as_float(u[j].y), __uint_as_float(u[j].z),
                        __uint_as_float(u[j].w)};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (valid && x[c] >= list.at_least) {
        ++taken;
        list.taken_min = TakenMin(list.taken_min, x[c]);
        list.taken_max = TakenMax(list.taken_max, x[c]);
      }
    }
  }
  const uint32_t inclusive = WarpInclusiveSum(taken);
  const uint32_t total = __shfl_sync(kFullMask, inclusive, 31);
  if (total == 0 && !RELOAD) return;  // warp-uniform
  uint32_t base = 0;
  if (total != 0 && (tid & 31) == 31) base = atomicAdd(list.count, total);
  uint32_t slot = __shfl_sync(kFullMask, base, 31) + inclusive - taken;
#pragma unroll
  for (int j = 0; j < kPrefetchVectors; ++j) {
    const int q = q0 + j * kThreads + tid;
    const uint32_t bits[4] = {u[j].x, u[j].y, u[j].z, u[j].w};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (q < n4 && __uint_as_float(bits[c]) >= list.at_least) {
        if (slot < kMaxCandidates) {
          list.cand[slot] = cpu::ListEntryOfBits(bits[c], list.first + 4 * q + c);
        }
        ++slot;
      }
    }
    if constexpr (RELOAD) {
      const int next = q1 + j * kThreads + tid;
      u[j] = next < n4 ? src[next] : make_uint4(0, 0, 0, 0);
    }
  }
}

// Gathers this block's part[0, part_n) at or above list.threshold into the list; `u` holds the
// part's first kPrefetchVectors kThreads vectors (LoadVectors from 0) when the part is 16-byte
// aligned, else nothing (aligned false). Then each warp's smallest and largest key taken go to
// s.key_min / s.key_max (set to ~0 and 0 before a barrier before the call). Every thread calls.
__device__ inline void GatherAbove(uint4 (&u)[kPrefetchVectors], const float* part, int part_n,
                                   bool aligned, LocalList& list, Scratch& s) {
  const auto append = [&](uint32_t key, int i, bool valid) {
    // The same float comparison as AppendVectors, so that every path takes the same entries.
    const uint32_t bits = cpu::BitsOfOrderKey(key);
    const bool take = valid && __uint_as_float(bits) >= list.at_least;
    if (take) {
      list.taken_min = TakenMin(list.taken_min, __uint_as_float(bits));
      list.taken_max = TakenMax(list.taken_max, __uint_as_float(bits));
    }
    AppendEntry(take, cpu::ListEntryOfBits(bits, list.first + i), list.cand, list.count);
  };
  if (aligned) {
    const int n4 = part_n / 4;
    const uint4* src = reinterpret_cast<const uint4*>(part);
    int q0 = 0;
    // Every chunk but the last reloads its vectors with the next chunk's as it appends them.
    for (; q0 + kPrefetchVectors * kThreads < n4; q0 += kPrefetchVectors * kThreads) {
      AppendVectors<true>(u, q0, n4, list, src, q0 + kPrefetchVectors * kThreads);
    }
    AppendVectors(u, q0, n4, list);
    if (4 * n4 < part_n) {  // the last part_n % 4 entries
      const int i = 4 * n4 + static_cast<int>(threadIdx.x);
      append(i < part_n ? OrderKey(part[i]) : 0u, i, i < part_n);
    }
  } else {
    ForEachKey(part, nullptr, part_n, append);
  }
  // NaN: nothing taken (the sentinels the block's key range starts from).
  const uint32_t key_min =
      __reduce_min_sync(kFullMask, isnan(list.taken_min) ? 0xFFFFFFFFu : OrderKey(list.taken_min));
  const uint32_t key_max =
      __reduce_max_sync(kFullMask, isnan(list.taken_max) ? 0u : OrderKey(list.taken_max));
  if ((threadIdx.x & 31) == 0) {
    atomicMin(&s.key_min, key_min);
    atomicMax(&s.key_max, key_max);
  }
}

// The row's lists after every block gathered (read after a cluster barrier, or after
// EndRowListsExchange's wait): lane b (< blocks) of every warp holds block b's count and key
// range; `before` the counts of the blocks before it, `total` the row's.
struct RowLists {
  uint32_t count;
  uint32_t before;
  uint32_t total;
  uint32_t key_min;  // the row's smallest and largest key taken (every lane)
  uint32_t key_max;
};
// The row's lists from lane b's (< blocks) count and key range of block b's list (0, ~0 and 0 in
// the other lanes).
__device__ __forceinline__ RowLists RowListsOfLanes(RowLists lists) {
  const uint32_t inclusive = WarpInclusiveSum(lists.count);
  lists.before = inclusive - lists.count;
  lists.total = __shfl_sync(kFullMask, inclusive, 31);
  lists.key_min = __reduce_min_sync(kFullMask, lists.key_min);
  lists.key_max = __reduce_max_sync(kFullMask, lists.key_max);
  return lists;
}
__device__ __forceinline__ RowLists ReadRowLists(Scratch& s, const RowBlocks& rb) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  RowLists lists{0, 0, 0, 0xFFFFFFFFu, 0};
  if (lane < rb.count) {
    const Scratch& other = lane == rb.rank ? s : *InBlock(&s, lane);
    lists.count = other.count;
    lists.key_min = other.key_min;
    lists.key_max = other.key_max;
  }
  return RowListsOfLanes(lists);
}

// TopKVariant::kSelectQuantilePush (opt-in, kernels/cuda/topk.cuh): the shared memory of the
// row's lists exchange below, in that kernel only: the other blocks' (count, key_min, key_max,
// 0) and the barrier whose phase their arrival completes.
struct RowListsPush {
  uint4 row_lists[kMaxTopKBlocks];
  uint64_t bar;
};

// kSelectQuantilePush: a row of several blocks exchanges the lists' counts and key ranges by
// pushing them, not by a release cluster barrier after the gathering and remote loads: thread
// b (< blocks, not this block's rank) stores this block's (count, key_min, key_max) into block b's
// row_lists (st.async, completing 16 bytes of block b's bar's transaction count); each block waits
// on its own bar (acquire at cluster scope), whose phase its own thread 0's arrival (expecting the
// other blocks' bytes) and, in the row's first block, one arrival from each other block complete.
// Only the first block reads the other blocks' lists (LoadRowCandidates), so only the pushes to it
// arrive, with release semantics at cluster scope, before their store: a block barrier before them
// orders the whole block's list before that release (cumulative), so the first block's wait also
// makes every list visible. The other blocks read only the pushed bytes. The barrier.cluster
// release this replaces made every thread of every block wait on a GPU-scope memory barrier
// (nvdisasm, docs/perf.md issue 30).
//
// BeginRowListsExchange, before the gathering, every thread: bar initialized by thread 0
// (fence.mbarrier_init: its release to the cluster), then an early relaxed cluster arrival that
// EndRowListsExchange's wait completes (no block stores into another before it has started and
// initialized its barrier). Relaxed: a release arrival waits for every load the thread has in
// flight (the part's), 0.9 us here at 128K (docs/perf.md issue 30).
__device__ __forceinline__ void BeginRowListsExchange(RowListsPush& push, const RowBlocks& rb) {
  if (threadIdx.x == 0) {
    const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&push.bar));
    // Arrivals: this block's thread 0; in the row's first block also one from each other block.
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar),
                 "r"(rb.rank == 0 ? rb.count : 1)
                 : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
// After the gathering, every thread: the row's lists as ReadRowLists reads them.
__device__ __forceinline__ RowLists EndRowListsExchange(RowListsPush& push, const Scratch& s,
                                                        const RowBlocks& rb) {
  const int tid = static_cast<int>(threadIdx.x);
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&push.bar));
  ClusterWait();    // every block of the row has started and initialized its barrier
  __syncthreads();  // this block's list, count and key range are complete
  if (tid < rb.count && tid != rb.rank) {
    const uint32_t slot = static_cast<uint32_t>(__cvta_generic_to_shared(&push.row_lists[rb.rank]));
    uint32_t remote_slot = 0;
    uint32_t remote_bar = 0;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                 : "=r"(remote_slot)
                 : "r"(slot), "r"(tid));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_bar) : "r"(bar), "r"(tid));
    if (tid == 0) {  // the row's first block reads this block's list: released first
      asm volatile(
          "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar)
          : "memory");
    }
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
        "[%5];\n" ::"r"(remote_slot),
        "r"(s.count), "r"(s.key_min), "r"(s.key_max), "r"(0u), "r"(remote_bar)
        : "memory");
  }
  if (tid == 0) {
    asm volatile(
        "mbarrier.arrive.expect_tx.release.cluster.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
        "r"(16u * static_cast<uint32_t>(rb.count - 1))
        : "memory");
  }
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar)
      : "memory");
  const int lane = tid & 31;
  RowLists lists{0, 0, 0, 0xFFFFFFFFu, 0};
  if (lane < rb.count) {
    const uint4 other =
        lane == rb.rank ? make_uint4(s.count, s.key_min, s.key_max, 0) : push.row_lists[lane];
    lists.count = other.x;
    lists.key_min = other.y;
    lists.key_max = other.z;
  }
  return RowListsOfLanes(lists);
}

// In the row's first block: candidate e (< lists.total <= kMaxCandidates) of the row's lists in
// block order into mine[j] for e = tid + j kThreads as its PickKey (0 past the total); cand is
// this block's list.
template <int PER_THREAD>
__device__ __forceinline__ void LoadRowCandidates(const uint64_t* cand, const RowLists& lists,
                                                  const RowBlocks& rb,
                                                  uint64_t (&mine)[PER_THREAD]) {
  const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) mine[j] = 0;
  for (int b = 0; b < rb.count; ++b) {
    const uint32_t start = __shfl_sync(kFullMask, lists.before, b);
    const uint32_t len = __shfl_sync(kFullMask, lists.count, b);
    const uint64_t* list = b == rb.rank ? cand : InBlock(cand, b);
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const uint32_t e = static_cast<uint32_t>(tid + j * kThreads);
      if (e - start < len) mine[j] = list[e - start];
    }
  }
  // After every list's loads are out (converted inside the loop, each block's remote loads waited
  // for the ones before: 0.4-0.6 us later at 3-4 blocks a row, docs/perf.md issue 30).
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    if (static_cast<uint32_t>(tid + j * kThreads) < lists.total) {
      mine[j] = cpu::PickOfListEntry(mine[j]);
    }
  }
}

}  // namespace pdserve::kernels::cuda::topk_steps
