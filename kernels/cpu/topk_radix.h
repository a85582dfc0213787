// The split radix select of kernels/cuda/topk.cuh: the steps shared by the CUDA kernel and its
// CPU twin (TopKRadixSplit below), which takes the same decisions sequentially so that host tests
// check the algorithm (parts, rounds, the tie path, the merge) on rows of any shape, with narrow
// bins and a small candidate buffer to reach the rare paths on small rows.
//
// Plain C++ (the helpers are __host__ __device__ under nvcc). Thread-safe (no shared state).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PDSERVE_TOPK_HD __host__ __device__ __forceinline__
#else
#define PDSERVE_TOPK_HD inline
#endif

namespace pdserve::kernels::cpu {

// Order-preserving map of a float's bits to uint32 (larger float -> larger key), with -0.0
// folded onto +0.0 (equal scores, as the CPU comparison treats them). NaN must not occur.
PDSERVE_TOPK_HD uint32_t OrderKeyOfBits(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) == 0) bits = 0;
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Sort key: descending order of this is descending score, then ascending index. Never 0 for a
// real entry (the low word is >= 2^31), so 0 pads a sort. Unique per entry of a row.
PDSERVE_TOPK_HD uint64_t PickKey(uint32_t order_key, int32_t index) {
  return (static_cast<uint64_t>(order_key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}

PDSERVE_TOPK_HD int32_t PickIndex(uint64_t pick) {
  return static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(pick));
}

// The float bits whose order key is `key` (OrderKeyOfBits' inverse; -0.0's key is +0.0's, which
// this returns).
PDSERVE_TOPK_HD uint32_t BitsOfOrderKey(uint32_t key) {
  return (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
}

// The bits of a float t such that, for every non-NaN score x, `x >= t` (IEEE comparison, with
// denormals kept: no flush to zero) holds exactly when OrderKeyOfBits(bits of x) >= key: -inf
// where every score's key reaches `key`, NaN (no comparison holds) where none does. So a gathering
// can compare scores as floats (one instruction) instead of computing each one's key first
// (kernels/cuda/topk_prefetch.cuh AppendVectors). Keys between -0.0's and +0.0's: t = -0.0,
// which compares equal to +0.0.
PDSERVE_TOPK_HD uint32_t BitsAtOrAbove(uint32_t key) {
  if (key > 0xFF800000u) return 0x7FC00000u;   // above +inf's key: no score
  if (key <= 0x007FFFFFu) return 0xFF800000u;  // at or below -inf's key: every score
  return (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
}

// A gathering list's entry: the score's float bits over the pick's index word (as PickKey's), and
// its PickKey.
PDSERVE_TOPK_HD uint64_t ListEntryOfBits(uint32_t bits, int32_t index) {
  return (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}
PDSERVE_TOPK_HD uint64_t PickOfListEntry(uint64_t entry) {
  return (static_cast<uint64_t>(OrderKeyOfBits(static_cast<uint32_t>(entry >> 32))) << 32) |
         (entry & 0xFFFFFFFFu);
}

// Block `rank` of `blocks` takes entries [first, first + count) of a row of n: equal consecutive
// parts, a multiple of 4 entries each (so 16-byte loads stay aligned); late parts may be short or
// empty. n < 2^31 - 4 * blocks.
struct RowPart {
  int32_t first;
  int32_t count;
};
// In 32-bit unsigned arithmetic (the kernels' 1024 threads each run it; a 64-bit division is a
// subroutine of ~80 instructions): cap <= n / blocks + 7, so cap * rank < n + 7 blocks and
// first + cap < 2^32 for 0 <= rank < blocks <= 8 and 0 <= n < 2^31.
PDSERVE_TOPK_HD RowPart PartOfRow(int32_t n, int32_t blocks, int32_t rank) {
  const uint32_t un = static_cast<uint32_t>(n);
  const uint32_t ub = static_cast<uint32_t>(blocks);
  const uint32_t cap = ((un + ub - 1u) / ub + 3u) / 4u * 4u;
  const uint32_t at = cap * static_cast<uint32_t>(rank);
  const uint32_t first = at < un ? at : un;
  const uint32_t end = first + cap < un ? first + cap : un;
  return {static_cast<int32_t>(first), static_cast<int32_t>(end - first)};
}

// The keys a selection round counts: [lo, hi], in bins of 2^shift keys ((hi - lo) >> shift <
// 2^bin_bits).
struct RadixRange {
  uint32_t lo;
  uint32_t hi;
  int shift;
};

PDSERVE_TOPK_HD RadixRange FirstRadixRange(int bin_bits) {
  return {0u, 0xFFFFFFFFu, 32 - bin_bits};
}

// The first key of `bin` in `range`.
PDSERVE_TOPK_HD uint32_t BinLow(const RadixRange& range, uint32_t bin) {
  return range.lo + (bin << range.shift);
}

// The next round's range: the keys of `bin` (clipped to range.hi), in bins of 2^(shift -
// bin_bits) keys or less. Requires range.shift > 0.
PDSERVE_TOPK_HD RadixRange NarrowToBin(const RadixRange& range, uint32_t bin, int bin_bits) {
  const uint32_t lo = BinLow(range, bin);
  const uint32_t width = (1u << range.shift) - 1u;
  const uint32_t hi = range.hi - lo > width ? lo + width : range.hi;
  const uint32_t span = hi - lo;
  int bits = 0;  // bit length of span
  while (bits < 32 && (span >> bits) != 0) ++bits;
  return {lo, hi, bits > bin_bits ? bits - bin_bits : 0};
}

// The select kernels' sample of a row of n entries: every stride-th entry, stride at least
// `sample_stride` and large enough for at most `max_samples` samples.
PDSERVE_TOPK_HD int32_t SampleStride(int32_t n, int32_t sample_stride, int32_t max_samples) {
  const int32_t sparse = (n + max_samples - 1) / max_samples;
  return sparse > sample_stride ? sparse : sample_stride;
}

// TopKVariant::kSelectQuantile's threshold from its sample (at most kQuantileSamples entries,
// stride `stride`; the histogram rounds below rank 2 take the same sample), without histogram
// rounds: sample e belongs to group e % kQuantileGroups (the kernel's warp), each group gives its
// r-th best key (counted with repeats; 0 where the group has fewer), and the threshold is the
// kQuantileMedianRank-th best of the group keys (their median). About 32 stride r entries of the
// row then lie at or above it, r = QuantileRank: about min(3 picks, (picks + max_candidates) / 2),
// inside the [picks, max_candidates] a sampled gather needs. Ranks below 2 give too coarse a
// quantile (the kernel then takes the histogram rounds).
constexpr int kQuantileGroups = 32;
constexpr int32_t kQuantileSamples = 1024;  // the sample's most entries (one per kernel thread)
// Longer rows take kSelectPrefetch's sample (2048 entries) and rounds: past it the 1024-entry
// sample's stride would pass 32 (k = 512 has rank 1 from stride 48) and the rounds' margin of 24
// samples (about 1.5 k + 24 stride entries) outgrows the 4096-entry buffer at 256K entries (1M
// tokens at compression 4: 6912 entries with 1024 samples, 3840 with 2048).
constexpr int32_t kQuantileMaxEntries = 32 * kQuantileSamples;
constexpr int kQuantileMedianRank = 16;
PDSERVE_TOPK_HD int32_t QuantileRank(int32_t picks, int32_t stride, int32_t max_candidates) {
  // 32-bit: picks <= 2^28 and stride <= 2^26 (at most 2^31 entries in 1024 samples or more).
  const uint32_t three = 3u * static_cast<uint32_t>(picks);
  const uint32_t middle =
      (static_cast<uint32_t>(picks) + static_cast<uint32_t>(max_candidates)) / 2u;
  const uint32_t target = three < middle ? three : middle;
  const uint32_t per_rank = static_cast<uint32_t>(kQuantileGroups) * static_cast<uint32_t>(stride);
  return static_cast<int32_t>((target + per_rank - 1u) / per_rank);
}

// Parameters of the CPU twin; the CUDA kernels' are {blocks per row, 12, 4096, 1024, variant}
// (kSelectPrefetch: select_sort with sample_bin_bits 8; kSelectQuantile: that and
// sample_quantile).
struct RadixSplitConfig {
  int blocks = 1;             // parts per row, 1..8
  int bin_bits = 12;          // bins per round: 2^bin_bits
  int max_candidates = 4096;  // the most candidates a row gathers (the sort buffer)
  int whole_sort = 1024;      // rows of at most max(k, this) entries are sorted whole
  // TopKVariant::kSelectSort (kernels/cuda/topk.cu TopKSelectKernel): the parts' candidates are
  // gathered into one list whose picks are placed by bins of their keys (BucketRank); where bins
  // that hold picks have more than max_bin_entries, narrowed (NarrowSelected: not rows of at most
  // whole_sort entries, the kernel's threads) and sorted. Rows of at most max_candidates are
  // gathered whole. Not modeled: kSelectQuantile's first count on such a row starts at an
  // estimate from the row's mean and standard deviation (kernels/cuda/topk.cu BinStart, in the
  // GPU's approximate arithmetic), so where this twin's count from the smallest key is crowded
  // the kernel may place the picks by bins at once; the picks are the same.
  bool select_sort = false;
  uint32_t max_bin_entries = 32;
  // select_sort, rows longer than max_candidates: first the entries at or above a threshold from
  // every sample_stride-th entry (sparser past max_samples samples), when that holds the picks.
  int32_t sample_stride = 16;
  int32_t max_samples = 2048;
  // The sample's histogram rounds: 2^sample_bin_bits bins each; 0 takes bin_bits (kSelectSort's
  // 12). TopKVariant::kSelectPrefetch (one warp scans each round): 8.
  int sample_bin_bits = 0;
  // TopKVariant::kSelectQuantile: the sample's threshold by group ranks (QuantileRank >= 2;
  // else the rounds above).
  bool sample_quantile = false;
};

// What one TopKRadixSplit call did (for tests: which paths ran).
struct RadixSplitStats {
  int rounds = 0;           // histogram rounds over the row
  bool tie_path = false;    // the k-th key's ties were ranked by index
  bool whole_sort = false;  // the row was sorted whole
  int candidates = 0;       // entries gathered over all parts
  int max_part_candidates = 0;
  bool sampled = false;        // select_sort: the sample's threshold held the picks
  bool bucket_ranked = false;  // select_sort: the picks were placed by bins, not sorted
  int narrow_rounds = 0;       // select_sort: histogram rounds over the gathered candidates
  int sorted = 0;              // select_sort: entries in the final sort
};

// Top-k of scores[0, n) by the CUDA kernel's steps: same result as TopK (kernels/cpu/topk.h).
// 1 <= k; out [k] int32 (-1 past min(n, k)). n < 2^31 - 32.
RadixSplitStats TopKRadixSplit(const float* scores, int32_t n, int32_t k,
                               const RadixSplitConfig& config, int32_t* out);

}  // namespace pdserve::kernels::cpu
