#include <cooperative_groups.h>

#include <array>
#include <cstdint>

#include "kernels/cpu/topk_radix.h"
#include "kernels/cuda/block_trace.cuh"
#include "kernels/cuda/grid_dependency.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/topk.cuh"
#include "kernels/cuda/topk_prefetch.cuh"
#include "kernels/cuda/topk_steps.cuh"

namespace pdserve::kernels::cuda {
namespace {

using namespace topk_steps;  // NOLINT(build/namespaces): this file's own helpers

// The number of entries greater than `key` in list[0, len), sorted descending without repeats.
__device__ __forceinline__ uint32_t CountGreater(const uint64_t* list, uint32_t len, uint64_t key) {
  uint32_t lo = 0;
  uint32_t hi = len;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (list[mid] > key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Writes the row's picks from the blocks' sorted candidate lists: an entry's place is its place
// in its own list plus the entries greater than it in the others (pick keys are unique: they hold
// the index). Each block copies the first min(len, picks) entries of the other lists into
// `merge` (kMaxCandidates entries: the lists together hold at most that many), then places its
// own. No block leaves before every block has copied from it.
__device__ void MergeRowPicks(const uint64_t* cand, uint32_t count, int picks, uint64_t* merge,
                              Scratch& s, const RowBlocks& rb, int32_t* out_row) {
  if (threadIdx.x == 0) s.list_len = min(count, static_cast<uint32_t>(picks));
  RowSync(rb);  // every block's list is sorted and its length set
  if (threadIdx.x == 0) {
    uint32_t offset = 0;
    for (int b = 0; b < rb.count; ++b) {
      const uint32_t len = b == rb.rank ? 0u : *InBlock(&s.list_len, b);
      s.other_len[b] = len;
      s.other_off[b] = offset;
      offset += len;
    }
  }
  __syncthreads();
  for (int b = 0; b < rb.count; ++b) {
    const uint64_t* other = InBlock(cand, b);
    for (uint32_t i = threadIdx.x; i < s.other_len[b]; i += kThreads) {
      merge[s.other_off[b] + i] = other[i];
    }
  }
  ClusterArrive();  // done reading the other blocks' shared memory
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < s.list_len; i += kThreads) {
    const uint64_t key = cand[i];
    uint32_t place = i;
    for (int b = 0; b < rb.count; ++b)
      place += CountGreater(merge + s.other_off[b], s.other_len[b], key);
    if (place < static_cast<uint32_t>(picks)) out_row[place] = PickIndex(key);
  }
  ClusterWait();
}

// This block's row: the cluster's blocks, the row's scores, length n (clamped to [0, stride]),
// picks = min(k, n) and output; the row's first block fills the output past picks with -1.
struct RowTask {
  RowBlocks rb;
  const float* row;
  int n;
  int picks;
  int32_t* out_row;
};
__device__ __forceinline__ RowTask BeginRow(const float* scores, int64_t stride,
                                            const int32_t* lengths, int k, int32_t* out) {
  const RowBlocks rb{static_cast<int>(cg::this_cluster().num_blocks()),
                     static_cast<int>(cg::this_cluster().block_rank())};
  const int64_t r = blockIdx.x / rb.count;
  const int n = static_cast<int>(min(max(static_cast<int64_t>(lengths[r]), int64_t{0}), stride));
  const int picks = min(k, n);
  int32_t* out_row = out + r * k;
  if (rb.rank == 0) {
    for (int j = picks + static_cast<int>(threadIdx.x); j < k; j += kThreads) out_row[j] = -1;
  }
  return {rb, scores + r * stride, n, picks, out_row};
}

// One row per cluster of `gridDim.x / rows` blocks; the row's n entries are split into equal
// consecutive parts (multiples of 4 entries, so 16-byte loads stay aligned), one per block.
// Shared memory: candidates [kMaxCandidates] u64, two histograms [kBins] u32, and when
// `cache_part` the part's order keys [part capacity] u32.
__global__ void __launch_bounds__(kThreads)
    TopKKernel(const float* scores, int64_t stride, const int32_t* lengths, int k, bool cache_part,
               int32_t* out) {
  extern __shared__ __align__(16) uint64_t smem[];
  uint64_t* const cand = smem;                                                // [kMaxCandidates]
  uint32_t* const hist = reinterpret_cast<uint32_t*>(cand + kMaxCandidates);  // [2][kBins]
  uint32_t* const cache = cache_part ? hist + 2 * kBins : nullptr;
  __shared__ Scratch s;
  // Launched with programmatic stream serialization: wait here for the kernel before (the scores)
  // to finish; without it this returns at once.
  GridDependencyWait();
  const auto [rb, row, n, picks, out_row] = BeginRow(scores, stride, lengths, k, out);
  if (picks == 0) return;  // the whole row's blocks, before any cluster step
  const cpu::RowPart row_part = cpu::PartOfRow(n, rb.count, rb.rank);
  const int first = row_part.first;
  const int part_n = row_part.count;
  const float* part = row + first;
  if (n <= max(picks, kThreads)) {  // short rows are sorted whole
    for (int i = threadIdx.x; i < part_n; i += kThreads) {
      cand[i] = PickKey(OrderKey(part[i]), first + i);
    }
    if (threadIdx.x == 0) s.count = static_cast<uint32_t>(part_n);
  } else {
    SelectCandidates(part, part_n, first, cache, n, picks, CandidateList{cand, &s.count, true},
                     hist, s, rb);
  }
  __syncthreads();
  const int count = static_cast<int>(min(s.count, static_cast<uint32_t>(kMaxCandidates)));
  int size = 32;
  while (size < count) size <<= 1;
  for (int i = count + static_cast<int>(threadIdx.x); i < size; i += kThreads) cand[i] = 0;
  __syncthreads();
  BitonicSortDescending(cand, size);
  if (rb.count == 1) {
    for (int j = threadIdx.x; j < picks; j += kThreads) out_row[j] = PickIndex(cand[j]);
    return;
  }
  MergeRowPicks(cand, static_cast<uint32_t>(count), picks, reinterpret_cast<uint64_t*>(hist), s, rb,
                out_row);
}

// TopKVariant::kSelectSort, block 0 of the row: cand[0, count) holds every entry of the row with
// a key above `hi` and those with keys in [lo, hi], of which the `need` best complete the row's
// `picks` (count <= kMaxCandidates). Narrows [lo, hi] by rounds of kBins bins over the
// candidates alone (at most three: each takes kBinBits bits off the span) until at most the
// smallest power of two >= picks remain or one key is left; returns how many remain in cand.
// Extra candidates (ties at one key, or a bin not narrowed further) only cost sort time: the
// sort orders ties by index, so the picks are the same.
__device__ uint32_t NarrowCandidates(uint64_t* cand, uint32_t count, uint32_t lo, uint32_t hi,
                                     uint32_t need, int picks, uint32_t* hist, Scratch& s) {
  constexpr int kPerThread = kMaxCandidates / kThreads;
  const int tid = static_cast<int>(threadIdx.x);
  uint32_t cap = 32;
  while (cap < static_cast<uint32_t>(picks)) cap <<= 1;
  while (count > cap && lo != hi) {
    const uint32_t span = hi - lo;
    const int shift = max(32 - __clz(static_cast<int>(span)) - kBinBits, 0);
    uint64_t mine[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t e = static_cast<uint32_t>(tid + j * kThreads);
      mine[j] = e < count ? cand[e] : 0;
    }
    reinterpret_cast<uint4*>(hist)[tid] = make_uint4(0, 0, 0, 0);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t key = static_cast<uint32_t>(mine[j] >> 32);
      const uint32_t e = static_cast<uint32_t>(tid + j * kThreads);
      CountInBin(hist, e < count && key >= lo && key <= hi, (key - lo) >> shift);
    }
    __syncthreads();
    FindBin(reinterpret_cast<const uint4*>(hist)[tid], need, s);
    need -= s.above;
    const uint32_t new_lo = lo + (s.bin << shift);
    const uint32_t width = (1u << shift) - 1u;
    hi = hi - new_lo > width ? new_lo + width : hi;
    lo = new_lo;
    if (tid == 0) s.count = 0;  // read last at the end of the round before, before FindBin
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const uint32_t e = static_cast<uint32_t>(tid + j * kThreads);
      AppendEntry(e < count && static_cast<uint32_t>(mine[j] >> 32) >= lo, mine[j], cand, &s.count);
    }
    __syncthreads();
    count = s.count;
  }
  return count;
}

// Sorts the block's entries descending, one per thread (v: thread i's entry i; size a power of
// two in [32, kThreads], threads past it hold 0): the bitonic network of BitonicSortDescending
// with the entries in registers, strides below 32 by warp shuffles, longer ones through
// `exchange` ([2][kThreads], alternate buffers: one barrier per step). Returns thread i's entry
// of the sorted order. Every thread of the block calls.
__device__ uint64_t RegisterBitonicSortDescending(uint64_t v, int size, uint64_t* exchange) {
  const int tid = static_cast<int>(threadIdx.x);
  int parity = 0;
  for (int span = 2; span <= size; span <<= 1) {
    const bool descending = (tid & span) == 0;
    for (int stride = span / 2; stride > 0; stride >>= 1) {
      uint64_t other;
      if (stride >= 32) {
        exchange[parity * kThreads + tid] = v;
        __syncthreads();
        other = exchange[parity * kThreads + (tid ^ stride)];
        parity ^= 1;
      } else {
        other = __shfl_xor_sync(kFullMask, v, stride);
      }
      const bool keep_larger = ((tid & stride) == 0) == descending;
      v = (v > other) == keep_larger ? v : other;
    }
  }
  return v;
}

static_assert(2 * kBins * sizeof(uint32_t) >= 2 * kThreads * sizeof(uint64_t),
              "the histogram buffers hold the sort's exchange buffers");

// Sorts cand[0, count) (count <= kMaxCandidates) and writes the first `picks` indices. `exchange`:
// 2 kThreads entries of scratch.
__device__ void SortWrite(uint64_t* cand, uint32_t count, int picks, uint64_t* exchange,
                          int32_t* out_row) {
  const int tid = static_cast<int>(threadIdx.x);
  uint32_t size = 32;
  while (size < count) size <<= 1;
  for (uint32_t i = count + threadIdx.x; i < size; i += kThreads) cand[i] = 0;
  __syncthreads();
  if (size <= kThreads) {
    const uint64_t v = RegisterBitonicSortDescending(tid < static_cast<int>(size) ? cand[tid] : 0,
                                                     static_cast<int>(size), exchange);
    if (tid < picks) out_row[tid] = PickIndex(v);
    return;
  }
  BitonicSortDescending(cand, static_cast<int>(size));
  for (int j = tid; j < picks; j += kThreads) out_row[j] = PickIndex(cand[j]);
}

// The most candidates of one bin that BucketRankWrite places by comparing them with each other;
// picks in a fuller bin take NarrowCandidates and the bitonic sort instead.
constexpr uint32_t kMaxBinEntries = 32;

constexpr int kRankPerThread = kMaxCandidates / kThreads;

// What BucketRankPlace needs besides the candidates: their smallest and largest key, whether
// hist's first kBins words (the counts) are zero already, and whether to arrive at the row's
// cluster barrier once every thread's candidates are in registers (TopKVariant::kSelectPrefetch:
// the row's other blocks wait there before they exit, since block 0 read their lists).
struct RankInputs {
  uint32_t key_min;
  uint32_t key_max;
  bool counts_zeroed;
  bool cluster_arrive;
  // BucketRankPlace<true> only: where the first count's bins start, key_min or a higher key the
  // picks likely lie at or above (WholeRowPlace's BinStart); checked by that count, which is made
  // again from key_min where fewer than picks are at or above it.
  uint32_t lo_start;
};

// TopKVariant::kSelectSort and kSelectPrefetch, block 0 of the row: writes the `picks` best of
// the `count` candidates (<= kMaxCandidates; candidate e is mine[j] of thread e % kThreads, j = e
// / kThreads, 0 past count) in order without a sorting network. Their keys in [lo, hi] (first the
// smallest and largest key) are counted in kBins bins; a bin's first place is the number of
// counted candidates in the bins above it, and a candidate's place is its bin's plus the number
// of its bin's candidates that rank above it (counted one by one, so the bins that hold picks
// must be small; the candidates of those bins are first moved into their bins' slots, and each
// thread places one slot's). When one of them holds more than kMaxBinEntries, lo moves up to the
// bin holding the picks-th best and the count is made once more over the narrower range; if that is
// still too crowded (keys bunched at a few values), returns false having written nothing (mine
// unchanged, cand untouched). START: the first count's bins start at in.lo_start (see RankInputs; a
// count that found fewer than picks at or above it is not the narrowing's). cand: kMaxCandidates
// entries of scratch (may hold candidates: they are in registers before it is written); hist:
// [2][kBins] scratch. Every thread of the block calls. `traced` (TopKSelectKernel's Marks; rows
// of at most kMaxCandidates only, whose path leaves these slots free): kTraceFirstData once the
// first count is done, kTraceExtra3 when START's count found fewer than picks (and is made
// again from key_min), kTraceExtra2 when the count is narrowed, kTraceLastData once the bins'
// places are known, kTraceExtra1 once the picks' candidates are in their bins' slots (tests read
// Extra3 and Extra2 to see which counts ran).
struct NoMarks {
  __device__ __forceinline__ void Mark(int) const {}
};
template <bool START = false, typename Traced = NoMarks>
__device__ bool BucketRankPlace(const uint64_t (&mine)[kRankPerThread], uint32_t count, int picks,
                                const RankInputs& in, uint64_t* cand, uint32_t* hist, Scratch& s,
                                int32_t* out_row, const Traced& traced = Traced()) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const uint32_t picks_u = static_cast<uint32_t>(picks);
  uint32_t* const counts = hist;         // [kBins]
  uint32_t* const first = hist + kBins;  // [kBins]: counted candidates in the bins above
  uint32_t lo = START ? in.lo_start : in.key_min;
  const uint32_t hi = in.key_max;
  uint32_t bin[kRankPerThread];
  bool counted[kRankPerThread];
  uint32_t counted_total = 0;
  bool narrowed = false;
  int shift = 0;
  for (int attempt = 0;; ++attempt) {
    const uint32_t span = hi - lo;
    shift = span == 0 ? 0 : max(32 - __clz(static_cast<int>(span)) - kBinBits, 0);
    if (attempt > 0 || !in.counts_zeroed) {
      reinterpret_cast<uint4*>(counts)[tid] = make_uint4(0, 0, 0, 0);
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < kRankPerThread; ++j) {
      const uint32_t key = static_cast<uint32_t>(mine[j] >> 32);
      counted[j] = static_cast<uint32_t>(tid + j * kThreads) < count && key >= lo;
      bin[j] = (key - lo) >> shift;
      CountInBin(counts, counted[j], bin[j]);
    }
    if (attempt == 0 && in.cluster_arrive) ClusterArrive();  // the other blocks' lists are read
    __syncthreads();
    if (attempt == 0 && tid == 0) traced.Mark(kTraceFirstData);
    // first[b] for this thread's bins 4 tid .. 4 tid + 3: the candidates of the higher threads'
    // bins, then of its own higher bins; s.bin: the bin holding the picks-th best.
    const uint4 c = reinterpret_cast<const uint4*>(counts)[tid];
    uint32_t inclusive = WarpInclusiveSum(c.x + c.y + c.z + c.w);
    if (lane == 31) s.warp[0][warp] = inclusive;
    __syncthreads();
    const uint32_t warp_total = s.warp[0][lane];
    const uint32_t warps_inclusive = WarpInclusiveSum(warp_total);
    counted_total = __shfl_sync(kFullMask, warps_inclusive, 31);
    inclusive += __shfl_sync(kFullMask, warps_inclusive - warp_total, warp);
    uint32_t running = counted_total - inclusive;
    const uint32_t bin_counts[4] = {c.x, c.y, c.z, c.w};
    bool crowded = false;
#pragma unroll
    for (int q = 3; q >= 0; --q) {
      first[4 * tid + q] = running;
      crowded = crowded || (running < picks_u && bin_counts[q] > kMaxBinEntries);
      if (running < picks_u && running + bin_counts[q] >= picks_u) s.bin = 4 * tid + q;
      running += bin_counts[q];
    }
    if (START && counted_total < picks_u) {  // lo_start above the picks-th best: count all
      if (tid == 0) traced.Mark(kTraceExtra3);
      __syncthreads();  // every thread has read the counts
      lo = in.key_min;
      continue;
    }
    if (!__syncthreads_or(crowded)) break;
    if (START ? narrowed : attempt == 1) return false;
    narrowed = true;
    if (tid == 0) traced.Mark(kTraceExtra2);
    lo += s.bin << shift;
  }
  if (tid == 0) {
    traced.Mark(kTraceLastData);
    s.bin_lo = lo;  // read back after the next barrier: fewer registers live across the scatter
    s.bin_shift = static_cast<uint32_t>(shift);
  }
  // Each counted candidate of a bin that holds picks goes to a slot of its bin's range.
#pragma unroll
  for (int j = 0; j < kRankPerThread; ++j) {
    if (counted[j] && first[bin[j]] < picks_u) {
      cand[first[bin[j]] + atomicSub(&counts[bin[j]], 1u) - 1] = mine[j];
    }
  }
  __syncthreads();
  if (tid == 0) traced.Mark(kTraceExtra1);
  // Those bins fill cand[0, filled) (through the bin holding the picks-th best); slot q's thread
  // places its candidate: its bin's first place plus its bin's candidates that rank above it.
  // One slot a thread (not the thread's own candidates, of which a few threads may hold several
  // picks while most hold none): the loop's length is one bin's count.
  const uint32_t filled = s.bin == 0 ? counted_total : first[s.bin - 1];
  const uint32_t bin_lo = s.bin_lo;
  const uint32_t bin_shift = s.bin_shift;
  for (uint32_t q = static_cast<uint32_t>(tid); q < filled; q += kThreads) {
    const uint64_t v = cand[q];
    const uint32_t b = (static_cast<uint32_t>(v >> 32) - bin_lo) >> bin_shift;
    const uint32_t begin = first[b];
    const uint32_t end = b == 0 ? counted_total : first[b - 1];
    uint32_t place = begin;
    for (uint32_t i = begin; i < end; ++i) place += cand[i] > v ? 1u : 0u;
    if (place < picks_u) out_row[place] = PickIndex(v);
  }
  return true;
}

// BucketRankPlace over cand[0, count) (count <= kMaxCandidates), its key range found first;
// returns false (nothing written, cand as it was) where the picks bunch.
__device__ bool BucketRankWrite(uint64_t* cand, uint32_t count, int picks, uint32_t* hist,
                                Scratch& s, int32_t* out_row) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  uint64_t mine[kRankPerThread];
  uint32_t key_min = 0xFFFFFFFFu;
  uint32_t key_max = 0;
#pragma unroll
  for (int j = 0; j < kRankPerThread; ++j) {
    const uint32_t e = static_cast<uint32_t>(tid + j * kThreads);
    mine[j] = e < count ? cand[e] : 0;
    if (e < count) {
      key_min = min(key_min, static_cast<uint32_t>(mine[j] >> 32));
      key_max = max(key_max, static_cast<uint32_t>(mine[j] >> 32));
    }
  }
  key_min = __reduce_min_sync(kFullMask, key_min);
  key_max = __reduce_max_sync(kFullMask, key_max);
  if (lane == 0) {
    s.warp[0][warp] = key_min;
    s.warp[1][warp] = key_max;
  }
  __syncthreads();  // every thread holds its candidates: cand may be overwritten from here
  const uint32_t lo = __reduce_min_sync(kFullMask, s.warp[0][lane]);
  const RankInputs in{lo, __reduce_max_sync(kFullMask, s.warp[1][lane]), false, false, lo};
  return BucketRankPlace(mine, count, picks, in, cand, hist, s, out_row);
}

// TopKVariant::kSelectSort on rows longer than kMaxCandidates: a key T above which, by a sample of
// the row, about 1.5 x picks + 24 x (the sample's stride) entries lie: enough that T is at or
// below the picks-th best key with near certainty, few enough (for picks up to 2048 and rows up
// to 64K entries) that the entries at or above T fit the candidate buffer. The sample is the same
// in every block of the row, and so is T (every block computes it alone). Histogram rounds of
// kBins bins over the sample keys, as SelectCandidates over the row. Every thread calls.
__device__ uint32_t SampleThreshold(const float* row, int n, int picks, uint32_t* hist,
                                    Scratch& s) {
  const int tid = static_cast<int>(threadIdx.x);
  const RowSample sample = LoadSample(row, n, picks);
  const int samples = sample.samples;
  const uint32_t* const key = sample.key;
  uint32_t need = sample.need;
  cpu::RadixRange range = cpu::FirstRadixRange(kBinBits);
  for (;;) {
    reinterpret_cast<uint4*>(hist)[tid] = make_uint4(0, 0, 0, 0);
    __syncthreads();
    const uint32_t span = range.hi - range.lo;
#pragma unroll
    for (int j = 0; j < kSamplesPerThread; ++j) {
      CountInBin(hist, tid + j * kThreads < samples && key[j] - range.lo <= span,
                 (key[j] - range.lo) >> range.shift);
    }
    __syncthreads();
    FindBin(reinterpret_cast<const uint4*>(hist)[tid], need, s);
    need -= s.above;
    if (s.in_bin <= 8 || range.shift == 0) return cpu::BinLow(range, s.bin);
    range = cpu::NarrowToBin(range, s.bin, kBinBits);
    __syncthreads();  // every thread has read s before the next round's FindBin writes it
  }
}

// The sum of `v` over the warp, the same bits in every lane (lane 0's tree, broadcast).
__device__ __forceinline__ float WarpSumFromLane0(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullMask, v, offset);
  return __shfl_sync(kFullMask, v, 0);
}

// WholeRowPlace's first key for the bins: the key above which about 1.5 picks + 64 of the row's n
// entries lie if its scores were normal with their mean and standard deviation (sum and sum of
// squares given), at least key_min; key_min where that quantile is not finite or would hold
// every entry. An estimate only: BucketRankPlace counts from key_min again where fewer than
// picks lie at or above it. Why: counted from key_min, bins of equal key width (2^shift order
// keys, each a fixed share of a binade) spend their resolution on the tiny-magnitude floats a
// row of mixed signs spans, so the picks of such a row crowd a few bins (more than
// kMaxBinEntries), which costs a second count (on an H100 at 32 x 4K, 2026-12-06: 1.0 of the
// 3.4 us the placing took). Not solved here: an estimate below zero for picks above it (a row
// centred near zero, k near n / 2) spans both signs' tiny magnitudes again, and the picks may
// still crowd (bins linear in the score would not; not tried).
__device__ __forceinline__ uint32_t BinStart(float sum, float squares, int n, int picks,
                                             uint32_t key_min) {
  const float above = 1.5f * static_cast<float>(picks) + 64.0f;
  if (above >= static_cast<float>(n)) return key_min;
  // Approximate reciprocals, square root and logarithm (a few instructions each, the same bits
  // in every thread): 1024 threads run this, and an estimate suffices.
  const float inv_n = __fdividef(1.0f, static_cast<float>(n));
  const float mean = sum * inv_n;
  const float var = fmaxf(squares * inv_n - mean * mean, 0.0f);
  const float sd = var > 0.0f ? var * rsqrtf(var) : 0.0f;
  // The normal quantile of 1 - above / n by the logistic approximation Phi(z) ~ 1 / (1 +
  // exp(-1.702 z)) (within 0.1 of z between the 5th and 95th percentiles).
  const float share = above * inv_n;
  const float start = mean + sd * (__logf(__fdividef(1.0f - share, share)) * (1.0f / 1.702f));
  return isfinite(start) ? max(OrderKey(start), key_min) : key_min;
}

// kSelectQuantile on a row of at most kMaxCandidates entries (the row's first block alone): the
// row loaded straight into the registers the placing by bins reads (and into cand, in case the
// picks bunch), its smallest and largest key, the sums BinStart takes and the zeroed counts ready
// at one block barrier, then BucketRankPlace from BinStart's key: two block barriers fewer than
// the load into cand and BucketRankWrite. Returns whether the picks were placed; false (cand
// holds the row, every thread past a barrier) where they bunch. `stop_after` as in
// TopKSelectKernel (4 or more: after the load; 2: after the barrier), returning true.
template <typename Traced>
__device__ bool WholeRowPlace(const float* row, int n, int picks, uint64_t* cand, uint32_t* hist,
                              Scratch& s, int stop_after, int32_t* out_row, const Traced& traced) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  reinterpret_cast<uint4*>(hist)[tid] = make_uint4(0, 0, 0, 0);  // BucketRankPlace's counts
  uint64_t mine[kRankPerThread];
  uint32_t key_min = 0xFFFFFFFFu;
  uint32_t key_max = 0;
  float sum = 0.0f;
  float squares = 0.0f;
#pragma unroll
  for (int j = 0; j < kRankPerThread; ++j) {
    const int e = tid + j * kThreads;
    mine[j] = 0;
    if (e < n) {
      const float score = row[e];
      const uint32_t key = OrderKey(score);
      mine[j] = PickKey(key, e);
      cand[e] = mine[j];
      key_min = min(key_min, key);
      key_max = max(key_max, key);
      sum += score;
      squares += score * score;
    }
  }
  key_min = __reduce_min_sync(kFullMask, key_min);
  key_max = __reduce_max_sync(kFullMask, key_max);
  sum = WarpSumFromLane0(sum);
  squares = WarpSumFromLane0(squares);
  if (lane == 0) {
    s.warp[0][warp] = key_min;
    s.warp[1][warp] = key_max;
    s.moments[0][warp] = sum;
    s.moments[1][warp] = squares;
  }
  if (tid == 0) traced.Mark(kTraceSetup);
  if (stop_after >= 4) return true;
  __syncthreads();  // the row's keys, range and sums, the zeroed counts
  if (stop_after == 2) return true;
  // Every warp sums the warps' sums in the same order: the same start in every thread.
  const uint32_t lo = __reduce_min_sync(kFullMask, s.warp[0][lane]);
  const uint32_t start = BinStart(WarpSumFromLane0(s.moments[0][lane]),
                                  WarpSumFromLane0(s.moments[1][lane]), n, picks, lo);
  const RankInputs in{lo, __reduce_max_sync(kFullMask, s.warp[1][lane]), true, false, start};
  return BucketRankPlace<true>(mine, static_cast<uint32_t>(n), picks, in, cand, hist, s, out_row,
                               traced);
}

// The select kernels' block trace marks (kernels/cuda/block_trace.h): compiled only into the
// TRACED instances, which the launcher runs while block_trace() is set (the marks would take
// registers from the kernels, which have 64 a thread and spill with them).
template <bool TRACED>
struct Marks {
  static constexpr bool kOn = false;
  __device__ __forceinline__ explicit Marks(const BlockTrace&) {}
  __device__ __forceinline__ void MarkDependency() const {}
  __device__ __forceinline__ void Mark(int) const {}
};
template <>
struct Marks<true> : trace::BlockTraceScope {
  static constexpr bool kOn = true;
  using trace::BlockTraceScope::BlockTraceScope;
};

// TRACED only: thread 0 waits for `value` (a load's result) and marks `slot`.
template <typename Traced>
__device__ __forceinline__ void MarkLanded(const Traced& traced, uint32_t value, int slot) {
  if constexpr (Traced::kOn) {
    if (threadIdx.x == 0) {
      asm volatile("" ::"r"(value));
      traced.Mark(slot);
    }
  }
}

// TopKVariant::kSelectPrefetch on a row longer than kMaxCandidates, every block of the row: the
// sample's threshold (SampleThresholdByWarp) while the block's part is loaded into registers,
// then the part's entries at or above it gathered into the block's own list (GatherAbove). After
// a row barrier every block knows the row's total. Where the picks are among them (at least picks,
// at most kMaxCandidates), block 0 reads every list into registers and places the picks by bins
// (BucketRankPlace) while the other blocks wait at the next row barrier, which block 0 passes once
// it has read their lists; where the picks bunch, block 0 leaves every candidate in cand and
// returns kCandidatesInBlock with their count and the threshold. Where the sample missed,
// returns kMissed once every block has read the counts (the row's blocks then select as
// kSelectSort does). `stop_after` 4 and 2 as in TopKSelectKernel.
enum class PrefetchOutcome { kDone, kCandidatesInBlock, kMissed };
struct PrefetchResult {
  PrefetchOutcome outcome;
  uint32_t count;
  uint32_t threshold;
};
// QUANTILE (TopKVariant::kSelectQuantile), rows of at most cpu::kQuantileMaxEntries: the sample
// is loaded first and spread over the warps (LoadSample<true>), and where cpu::QuantileRank is at
// least 2 the threshold is the median of the warps' rank keys (WarpRankKey, then MedianOfWarps in
// warp 0: two block barriers, no histogram rounds); else the rounds over that sample. Longer rows
// as without QUANTILE.
// PUSH (TopKVariant::kSelectQuantilePush): a row of several blocks exchanges its lists' counts
// and key ranges by pushes into `push` (BeginRowListsExchange / EndRowListsExchange) instead of
// a release row barrier after the gathering and remote loads; nullptr without PUSH.
template <bool QUANTILE, bool PUSH, typename Traced>
__device__ PrefetchResult PrefetchGatherPlace(const float* row, int n, int picks,
                                              cpu::RowPart row_part, uint64_t* cand, uint32_t* hist,
                                              Scratch& s, const RowBlocks& rb, int stop_after,
                                              int32_t* out_row, RowListsPush* push,
                                              const Traced& traced) {
  const int tid = static_cast<int>(threadIdx.x);
  const float* part = row + row_part.first;
  const bool aligned = (reinterpret_cast<uintptr_t>(part) & 15) == 0;
  uint4 u[kPrefetchVectors];  // nothing waits for them before the gathering
  RowSample sample;
  const bool quantile = QUANTILE && n <= cpu::kQuantileMaxEntries;
  if (quantile) sample = LoadSample<true>(row, n, picks);  // the threshold's first
  LoadVectors(u, reinterpret_cast<const uint4*>(part), 0, aligned ? row_part.count / 4 : 0);
  if (!quantile) sample = LoadSample(row, n, picks);
  uint32_t* const sample_hists = hist + kBins;                   // BucketRankPlace's `first` later
  reinterpret_cast<uint4*>(hist)[tid] = make_uint4(0, 0, 0, 0);  // BucketRankPlace's counts
  sample_hists[tid] = 0;
  if (tid == 0) {
    s.count = 0;
    s.key_min = 0xFFFFFFFFu;
    s.key_max = 0;
  }
  if constexpr (PUSH) {
    if (rb.count > 1) BeginRowListsExchange(*push, rb);
  }
  MarkLanded(traced, sample.key[0], kTraceExtra1);
  uint32_t threshold = 0;
  const int rank = quantile ? cpu::QuantileRank(
                                  picks, cpu::SampleStride(n, kSampleStride, cpu::kQuantileSamples),
                                  kMaxCandidates)
                            : 0;
  if (rank >= 2) {
    const uint32_t group_key = WarpRankKey(sample, rank);
    if (tid % 32 == 0) s.group_keys[tid / 32] = group_key;
    __syncthreads();  // the group keys; the zeroed counts and list
    if (tid < 32) {   // one warp: every warp taking the median cost more than a second barrier
      const uint32_t median = MedianOfWarps(s.group_keys);
      if (tid == 0) s.group_threshold = median;
    }
    __syncthreads();
    threshold = s.group_threshold;
  } else {
    __syncthreads();
    threshold = SampleThresholdByWarp(sample, sample_hists, s);
  }
  LocalList list = MakeLocalList(cand, &s.count, threshold, row_part.first);
  if (tid == 0) traced.Mark(kTraceSetup);
  MarkLanded(traced, u[kPrefetchVectors - 1].w, kTraceExtra2);
  // PUSH: this leaves the exchange's early cluster arrival unwaited, harmless only because no
  // cluster step follows on this path.
  if (stop_after == 4) return {PrefetchOutcome::kDone, 0, 0};
  GatherAbove(u, part, row_part.count, aligned, list, s);
  if (tid == 0) traced.Mark(kTraceFirstData);
  const RowLists lists = [&] {
    if constexpr (PUSH) {
      if (rb.count > 1) return EndRowListsExchange(*push, s, rb);  // their lists visible too
      __syncthreads();
      return ReadRowLists(s, rb);
    } else {
      RowSync(rb);  // release: this block's list; acquire: everyone's
      return ReadRowLists(s, rb);
    }
  }();
  if (tid == 0) traced.Mark(kTraceLastData);
  const bool sampled = lists.total >= static_cast<uint32_t>(picks) && lists.total <= kMaxCandidates;
  if (stop_after == 2 || !sampled || rb.rank != 0) {
    // No block leaves or changes its count before every block has read the counts (and block 0
    // the lists; the fallback selection zeroes block 0's count).
    RowSync(rb);
    if (tid == 0) traced.Mark(kTraceLoopDone);
    return {stop_after == 2 || sampled ? PrefetchOutcome::kDone : PrefetchOutcome::kMissed, 0, 0};
  }
  uint64_t mine[kRankPerThread];
  LoadRowCandidates(cand, lists, rb, mine);
  MarkLanded(traced, static_cast<uint32_t>(mine[0]), kTraceExtra3);
  const RankInputs in{lists.key_min, lists.key_max, true, rb.count > 1, lists.key_min};
  const bool placed = BucketRankPlace(mine, lists.total, picks, in, cand, hist, s, out_row);
  if (rb.count > 1) ClusterWait();  // the other blocks have read block 0's count
  if (placed) {
    if (tid == 0) traced.Mark(kTraceLoopDone);
    return {PrefetchOutcome::kDone, 0, 0};
  }
  __syncthreads();  // cand was read (BucketRankPlace's counts) before it takes every candidate
#pragma unroll
  for (int j = 0; j < kRankPerThread; ++j) {
    const uint32_t e = static_cast<uint32_t>(tid + j * kThreads);
    if (e < lists.total) cand[e] = mine[j];
  }
  return {PrefetchOutcome::kCandidatesInBlock, lists.total, list.threshold};
}

// TopKVariant::kSelectSort (PREFETCH false): the row's blocks (a cluster of gridDim.x / rows)
// gather the entries at or above a threshold from a sample of the row (SampleThreshold) into
// block 0's list; where that misses (fewer than picks, or more than the buffer), they select as
// TopKKernel does (SelectCandidates), gathering into the same list. Block 0 then places the picks
// by bins of their keys (BucketRankWrite); where the picks' keys bunch in a few bins, it narrows
// the candidates to about `picks` (NarrowCandidates; not for rows of at most kThreads entries)
// and sorts them (SortWrite). Rows of at most kMaxCandidates entries are loaded by block 0 alone.
// kSelectPrefetch (PREFETCH true): the same decisions, but on rows longer than kMaxCandidates the
// sample's rounds and the gathering run as PrefetchGatherPlace, which places the picks itself.
// `stop_after` (benchmarks only; 0 in products) ends the kernel early: 1 after the output's -1
// fill, 4 after the sample's threshold, 2 after the gathering (the candidates in block 0, or in
// the blocks' lists for kSelectPrefetch), 3 before a fallback sort, 5 or 6 in a fallback
// selection. Shared memory as TopKKernel.
template <bool PREFETCH, bool QUANTILE = false, bool TRACED = false, bool PUSH = false>
__global__ void __launch_bounds__(kThreads)
    TopKSelectKernel(const float* scores, int64_t stride, const int32_t* lengths, int k,
                     bool cache_part, int stop_after, int32_t* out, const BlockTrace trace) {
  extern __shared__ __align__(16) uint64_t smem[];
  uint64_t* const cand = smem;                                                // [kMaxCandidates]
  uint32_t* const hist = reinterpret_cast<uint32_t*>(cand + kMaxCandidates);  // [2][kBins]
  uint32_t* const cache = cache_part ? hist + 2 * kBins : nullptr;
  __shared__ Scratch s;
  const Marks<TRACED> traced(trace);
  GridDependencyWait();
  GridDependencyLaunchDependents();
  if (threadIdx.x == 0) traced.MarkDependency();
  const auto [rb, row, n, picks, out_row] = BeginRow(scores, stride, lengths, k, out);
  MarkLanded(traced, static_cast<uint32_t>(n), kTraceExtra0);
  if (picks == 0 || stop_after == 1) return;  // the whole row's blocks, before any cluster step
  uint32_t count = static_cast<uint32_t>(n);
  uint32_t lo = 0;
  uint32_t hi = 0xFFFFFFFFu;
  uint32_t need = static_cast<uint32_t>(picks);
  bool try_bins = true;  // false where the picks were found bunched already
  if (n <= kMaxCandidates) {
    if (rb.rank != 0) return;  // no cluster step follows
    if constexpr (QUANTILE) {
      if (WholeRowPlace(row, n, picks, cand, hist, s, stop_after, out_row, traced)) {
        if (threadIdx.x == 0 && stop_after == 0) traced.Mark(kTraceLoopDone);
        return;
      }
      try_bins = false;  // bunched: narrowed and sorted below
    } else {
      for (int i = threadIdx.x; i < n; i += kThreads) cand[i] = PickKey(OrderKey(row[i]), i);
      if (threadIdx.x == 0) traced.Mark(kTraceSetup);
      if (stop_after >= 4) return;  // benchmarks: no sample in this path
    }
  } else {
    // Every block gathers its candidates straight into block 0's list (distributed shared memory
    // where the row has several blocks); block 0 zeroes the count before a RowSync that orders
    // it before any block gathers.
    const CandidateList list = rb.count > 1
                                   ? CandidateList{InBlock(cand, 0), InBlock(&s.count, 0), false}
                                   : CandidateList{cand, &s.count, false};
    const cpu::RowPart row_part = cpu::PartOfRow(n, rb.count, rb.rank);
    const float* part = row + row_part.first;
    uint32_t threshold = 0;
    bool sampled = false;
    if constexpr (PREFETCH) {
      RowListsPush* push = nullptr;
      if constexpr (PUSH) {
        __shared__ RowListsPush push_storage;
        push = &push_storage;
      }
      const PrefetchResult result = PrefetchGatherPlace<QUANTILE, PUSH>(
          row, n, picks, row_part, cand, hist, s, rb, stop_after, out_row, push, traced);
      if (result.outcome == PrefetchOutcome::kDone) return;
      if (result.outcome == PrefetchOutcome::kCandidatesInBlock) {  // block 0; picks bunched
        sampled = true;
        try_bins = false;
        threshold = result.threshold;
        if (threadIdx.x == 0) s.count = result.count;
        __syncthreads();
      }
    } else {
      if (rb.rank == 0 && threadIdx.x == 0) s.count = 0;
      // First try: the entries at or above a threshold from a sample of the row, gathered in one
      // pass. They hold the picks when they number at least picks (and fit the buffer).
      threshold = SampleThreshold(row, n, picks, hist, s);
      if (stop_after == 4) return;
      RowSync(rb);  // block 0's zeroed count before any block gathers
      ForEachKey(part, nullptr, row_part.count, [&](uint32_t key, int i, bool valid) {
        AppendPick(valid && key >= threshold, key, row_part.first + i, list.entries, list.count);
      });
      RowSync(rb);  // release: this block's candidates; acquire: everyone's
      const uint32_t gathered = *list.count;
      sampled = gathered >= static_cast<uint32_t>(picks) && gathered <= kMaxCandidates;
      // Every block has read block 0's count before block 0 changes it (the zeroing below, or
      // NarrowCandidates' after a sampled gather) or leaves (distributed shared memory must not
      // be read once its block has exited).
      RowSync(rb);
    }
    if (!sampled) {  // the radix selection over the row
      if (rb.rank == 0 && threadIdx.x == 0) s.count = 0;
      SelectCandidates(part, row_part.count, row_part.first, cache, n, picks, list, hist, s, rb,
                       stop_after);
      if (stop_after >= 5) return;
      RowSync(rb);  // release: this block's candidates; acquire: everyone's
    }
    if (rb.rank != 0) return;
    count = min(s.count, static_cast<uint32_t>(kMaxCandidates));
    lo = sampled ? threshold : s.sel_lo;
    hi = sampled ? 0xFFFFFFFFu : s.sel_hi;
    need = sampled ? static_cast<uint32_t>(picks) : s.sel_need;
  }
  __syncthreads();
  if (stop_after == 2) return;
  if (try_bins && BucketRankWrite(cand, count, picks, hist, s, out_row)) {
    if (threadIdx.x == 0) traced.Mark(kTraceLoopDone);
    return;
  }
  // Candidates bunched at a few keys: narrowed by histogram rounds, then sorted.
  if (n > kThreads) count = NarrowCandidates(cand, count, lo, hi, need, picks, hist, s);
  if (stop_after == 3) return;
  SortWrite(cand, count, picks, reinterpret_cast<uint64_t*>(hist), out_row);
}

// How many clusters of `blocks` (2..8) blocks of `kKernel` (TopKKernel or TopKSelectKernel,
// with kFixedSmemBytes of shared memory) the device runs at once (clusters sit within one GPC,
// so this can be below SMs / blocks); 0 where the query fails. Queried for every size at the
// first call (make it outside graph capture, as the kernel attribute) and cached per kernel (one
// device kind per process assumed). Requires the kernel's shared-memory attribute set.
template <auto kKernel>
int MaxActiveClusters(int64_t blocks) {
  static const std::array<int, kMaxTopKBlocks + 1> clusters = [] {
    std::array<int, kMaxTopKBlocks + 1> counts = {};
    for (int size = 2; size <= kMaxTopKBlocks; ++size) {
      cudaLaunchAttribute cluster = {};
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = static_cast<unsigned>(size);
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = 1;
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(static_cast<unsigned>(size));
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = kFixedSmemBytes;
      config.attrs = &cluster;
      config.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&counts[size], kKernel, &config) != cudaSuccess) {
        cudaGetLastError();  // not sticky; clear it
        counts[size] = 0;
      }
    }
    return counts;
  }();
  return blocks >= 2 && blocks <= kMaxTopKBlocks ? clusters[blocks] : 0;
}

int SmCount() {
  static const int count = [] {
    int device = 0;
    int sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      return 0;
    }
    return sms;
  }();
  return count;
}

// Blocks per row of TopKKernel: the largest power of two up to kMaxAutoTopKBlocks that keeps all
// rows in one wave (rows x blocks within the SM count, rows within the clusters the device runs
// at once) and parts of at least 256 entries. Two at most: on an H200 (2026-12-04, graph timing,
// docs/perf.md) 2 blocks per row were the fastest or within 0.5 us of it at every batch 1 / 32
// and context 4K / 32K / 128K, while 4 and 8 lost 2-3x (32 x 128K: 16.4 us with 2, 29.6 with 4,
// 59.0 with 8).
constexpr int64_t kMaxAutoTopKBlocks = 2;
// TopKSelectKernel: the most blocks per row up to kMaxAutoSelectBlocks (any count, not only powers
// of two: where the device runs fewer than `rows` clusters of 4, 3 may still fit in one wave)
// with rows x blocks within the SM count, every row's cluster running at once, and parts of at
// least kMinSelectPart entries (kSelectSort) or kMinPrefetchPart (kSelectPrefetch; rows of at
// most kMaxCandidates entries take one block: block 0 alone loads them). kMinPrefetchPart: on an
// H100 (2026-12-06, graph timing, docs/perf.md issue 30) the fastest count, or within 0.11 us of
// it, at batch 1 / 32 / 128 and rows of 8K / 16K / 32K entries (1 block at 8K: 8.90 us against
// 9.97 with the 2 of parts of 4096, at batch 1; 9.23 against 10.29 at batch 32).
constexpr int64_t kMaxAutoSelectBlocks = 4;
constexpr int64_t kMinSelectPart = 4096;
constexpr int64_t kMinPrefetchPart = 8192;

int64_t PickBlocksPerRow(TopKVariant variant, int64_t rows, int64_t stride) {
  const int64_t sms = SmCount();
  if (variant != TopKVariant::kRadixCluster) {
    const bool prefetch = variant != TopKVariant::kSelectSort;
    for (int64_t blocks = kMaxAutoSelectBlocks; blocks > 1; --blocks) {
      const int clusters =
          variant == TopKVariant::kSelectQuantilePush
              ? MaxActiveClusters<TopKSelectKernel<true, true, false, true>>(blocks)
          : variant == TopKVariant::kSelectQuantile
              ? MaxActiveClusters<TopKSelectKernel<true, true>>(blocks)
              : (prefetch ? MaxActiveClusters<TopKSelectKernel<true>>(blocks)
                          : MaxActiveClusters<TopKSelectKernel<false>>(blocks));
      const int64_t min_part = prefetch ? kMinPrefetchPart : kMinSelectPart;
      if (rows * blocks <= sms && stride >= min_part * blocks && rows <= clusters) {
        return blocks;
      }
    }
    return 1;
  }
  int64_t blocks = 1;
  while (blocks < kMaxAutoTopKBlocks && rows * blocks * 2 <= sms && stride >= 512 * blocks &&
         rows <= MaxActiveClusters<TopKKernel>(blocks * 2)) {
    blocks *= 2;
  }
  return blocks;
}

cudaError_t LaunchTopK(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                       int64_t k, TopKVariant variant, int64_t blocks_per_row, int stop_after,
                       int32_t* out, cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("top_k", rows >= 0);
  PDSERVE_LAUNCH_REQUIRE("top_k", stride >= 0);
  PDSERVE_LAUNCH_REQUIRE("top_k", k >= 1);
  PDSERVE_LAUNCH_REQUIRE("top_k", k <= kMaxTopK);
  PDSERVE_LAUNCH_REQUIRE("top_k", stride <= kMaxStride);
  PDSERVE_LAUNCH_REQUIRE("top_k", blocks_per_row >= 0);
  PDSERVE_LAUNCH_REQUIRE("top_k", blocks_per_row <= kMaxTopKBlocks);
  PDSERVE_LAUNCH_REQUIRE("top_k", variant == TopKVariant::kRadixCluster ||
                                      variant == TopKVariant::kSelectSort ||
                                      variant == TopKVariant::kSelectPrefetch ||
                                      variant == TopKVariant::kSelectQuantile ||
                                      variant == TopKVariant::kSelectQuantilePush);
  if (variant == TopKVariant::kRadixCluster) {  // its merge ranks power-of-two clusters only
    PDSERVE_LAUNCH_REQUIRE("top_k", (blocks_per_row & (blocks_per_row - 1)) == 0);
  }
  if (rows == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("top_k", scores != nullptr);
  PDSERVE_LAUNCH_REQUIRE("top_k", lengths != nullptr);
  PDSERVE_LAUNCH_REQUIRE("top_k", out != nullptr);
  const cudaError_t attribute_status = [] {
    const int bytes = static_cast<int>(kFixedSmemBytes + kMaxCachedScores * sizeof(uint32_t));
    cudaError_t status =
        SetMaxDynamicSharedMemory(reinterpret_cast<const void*>(TopKKernel), bytes);
    if (status != cudaSuccess) return status;
    for (const auto kernel :
         {TopKSelectKernel<false>, TopKSelectKernel<true>, TopKSelectKernel<true, true>,
          TopKSelectKernel<false, false, true>, TopKSelectKernel<true, false, true>,
          TopKSelectKernel<true, true, true>, TopKSelectKernel<true, true, false, true>,
          TopKSelectKernel<true, true, true, true>}) {
      status = SetMaxDynamicSharedMemory(reinterpret_cast<const void*>(kernel), bytes);
      if (status != cudaSuccess) return status;
    }
    return cudaSuccess;
  }();
  if (attribute_status != cudaSuccess) return attribute_status;
  const int64_t blocks =
      blocks_per_row == 0 ? PickBlocksPerRow(variant, rows, stride) : blocks_per_row;
  PDSERVE_LAUNCH_REQUIRE("top_k", rows * blocks <= INT32_MAX);
  const int64_t part_cap = ((stride + blocks - 1) / blocks + 3) / 4 * 4;
  const bool cache_part = part_cap <= kMaxCachedScores;
  const size_t smem =
      kFixedSmemBytes + (cache_part ? static_cast<size_t>(part_cap) * sizeof(uint32_t) : 0);
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = static_cast<unsigned>(blocks);
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(rows * blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = blocks > 1 ? 2 : 1;
  const BlockTrace trace = block_trace();
  const bool traced = trace.slots != nullptr;
  const auto select = [&](auto plain, auto with_marks) {
    return cudaLaunchKernelEx(&config, traced ? with_marks : plain, scores, stride, lengths,
                              static_cast<int>(k), cache_part, stop_after, out, trace);
  };
  if (variant == TopKVariant::kSelectSort) {
    return select(TopKSelectKernel<false>, TopKSelectKernel<false, false, true>);
  }
  if (variant == TopKVariant::kSelectPrefetch) {
    return select(TopKSelectKernel<true>, TopKSelectKernel<true, false, true>);
  }
  if (variant == TopKVariant::kSelectQuantile) {
    return select(TopKSelectKernel<true, true>, TopKSelectKernel<true, true, true>);
  }
  if (variant == TopKVariant::kSelectQuantilePush) {
    return select(TopKSelectKernel<true, true, false, true>,
                  TopKSelectKernel<true, true, true, true>);
  }
  return cudaLaunchKernelEx(&config, TopKKernel, scores, stride, lengths, static_cast<int>(k),
                            cache_part, out);
}

}  // namespace

cudaError_t top_k_variant(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                          int64_t k, TopKVariant variant, int64_t blocks_per_row, int32_t* out,
                          cudaStream_t stream) {
  return LaunchTopK(scores, rows, stride, lengths, k, variant, blocks_per_row, 0, out, stream);
}

cudaError_t top_k_split(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                        int64_t k, int64_t blocks_per_row, int32_t* out, cudaStream_t stream) {
  return LaunchTopK(scores, rows, stride, lengths, k, TopKVariant::kRadixCluster, blocks_per_row, 0,
                    out, stream);
}

cudaError_t top_k(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                  int64_t k, int32_t* out, cudaStream_t stream) {
  return LaunchTopK(scores, rows, stride, lengths, k, kDefaultTopKVariant, 0, 0, out, stream);
}

cudaError_t top_k_select_stages(const float* scores, int64_t rows, int64_t stride,
                                const int32_t* lengths, int64_t k, TopKVariant variant,
                                int stop_after, int32_t* out, cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("top_k", stop_after >= 0);
  PDSERVE_LAUNCH_REQUIRE("top_k", variant == TopKVariant::kSelectSort ||
                                      variant == TopKVariant::kSelectPrefetch ||
                                      variant == TopKVariant::kSelectQuantile ||
                                      variant == TopKVariant::kSelectQuantilePush);
  return LaunchTopK(scores, rows, stride, lengths, k, variant, 0, stop_after, out, stream);
}

}  // namespace pdserve::kernels::cuda
