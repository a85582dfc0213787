// Deterministic top-k over rows of float32 scores on the GPU, one cluster of 1-8 blocks per row.
//
// Same result as kernels/cpu/topk.h, element for element: descending score, ties broken by
// ascending index, exactly min(length, k) valid indices followed by -1. +0.0 and -0.0 are equal
// (as the CPU comparison treats them); +-inf order as usual; NaN must not occur (the callers'
// scores are finite sums or +-inf). Why the tie rule matters: docs/engine-reference.md.
//
// Method: each row is split into consecutive parts, one per block of a thread-block cluster of 1,
// 2, 4 or 8 blocks of 1024 threads (top_k picks 2 where rows x 2 stay within one block per
// multiprocessor, else 1: 4 and 8 measured 2-3x slower on an H200, kernels/cuda/topk.cu). Rows of
// at most max(k, 1024) entries are sorted whole. Longer rows: a radix select on order-preserving
// 32-bit keys whose digits adapt to the data, over the histograms of all the row's blocks summed
// through distributed shared memory (so every block takes the same decisions). The first round
// counts the top 12 bits of every key while the part is read from global memory (once: parts up to
// 40960 entries stay in shared memory as keys); each further round counts the keys of the kept bin
// in 4096 bins of the remaining width. As soon as the row's entries at or above the bin holding the
// k-th best fit in 4096 (typically after the first round), each block gathers its own and sorts
// them (bitonic, on (key, index) pairs, so ties order by index). When the k-th best key itself has
// more ties than fit (after at most three rounds), the entries above it and the row's lowest-index
// ties at it are taken (a block's ties after those of the blocks before it). Last, each block
// places its sorted entries: its own rank plus, by binary search, the entries greater in the other
// blocks' lists (copied from their shared memory); ranks below k are written. Only the candidates,
// a few hundred per block, are sorted; the row is never sorted whole.
//
// Variant kSelectSort (kernels/cuda/topk.cu, TopKSelectKernel): on rows longer than 4096 every
// block of the row takes the same sample of the row (every 16th entry), finds the key above which
// about 1.5 k + 24 x 16 entries lie, and gathers its part's entries at or above it straight into
// the row's first block (distributed shared memory); where that misses (fewer than k, or more
// than the 4096-entry buffer), the blocks run the selection above, gathering the same way. The
// first block places the picks without a sorting network: the candidates' keys are counted in
// 4096 bins spanning their range, a bin's first place is the count of the bins above it, and a
// pick's place is its bin's plus the candidates of its bin that rank above it (bins holding picks
// must hold at most 32; else the count is redone over the bins from the k-th best up, and where
// the picks still bunch, histogram rounds narrow the candidates to about k and a bitonic sort
// orders them). Rows of at most 4096 entries are loaded and placed by that block alone. Up to 4
// blocks per row (parts of at least 4096 entries, kSelectPrefetch 8192; 3 where the device cannot
// run `rows` clusters of 4 at once). It also lets the next kernel on the stream launch early
// (griddepcontrol.launch_dependents).
//
// CUDA-graph safe: the launch shape depends only on (rows, stride, k) and the device (its SM and
// cluster counts); per-row lengths are read from device memory when the kernel runs. Launched
// with programmatic stream serialization: the launch may begin while the kernel before it on the
// stream drains, and the kernel waits (griddepcontrol.wait) for that kernel's completion before
// it reads anything, so inside a graph its launch latency overlaps the scores kernel's tail.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kMaxTopK = 2048;

// scores: [rows, stride] fp32 (row r reads scores[r * stride + 0 .. lengths[r])); lengths: [rows]
// int32 in device memory, clamped to [0, stride]; out: [rows, k] int32. 1 <= k <= kMaxTopK,
// stride < 2^31 - 16384. Returns cudaErrorInvalidValue on bad arguments, else the launch status.
// Asynchronous on `stream`; no state besides a one-time kernel attribute and the device's cluster
// occupancy, cached (make the first call outside graph capture), so concurrent calls on different
// outputs are safe. The CPU twin of the method: kernels/cpu/topk_radix.h.
cudaError_t top_k(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                  int64_t k, int32_t* out, cudaStream_t stream);

// Which kernel top_k runs (same contract, identical results): kRadixCluster sorts each block's
// candidates and merges the blocks' lists by rank; kSelectSort gathers the row's candidates in
// one block and places the picks by bins (faster than kRadixCluster at every size measured on an
// H200, docs/perf.md issue 30; the default from 2026-12-04 to 2026-12-05);
// kSelectPrefetch takes kSelectSort's decisions (its CPU twin with sample_bin_bits 8) with fewer
// steps on rows longer than 4096: each block of the row loads its part into registers while it
// finds the sample's threshold by rounds of 256 bins (two barriers a round), gathers its part's
// entries at or above it into its own list (one shared atomic per warp; scores compared as floats
// with cpu::BitsAtOrAbove of the threshold key, the same answer), and the row's first block
// reads the lists through distributed shared memory straight into the placing by bins (the
// default from 2026-12-05 to 2026-12-06; docs/perf.md "the select top-k with its part
// prefetched").
// kSelectQuantile, the default since 2026-12-06, is kSelectPrefetch with the sample's threshold
// found without histogram rounds on rows of 4097-32768 entries: a sample of at most 1024
// entries, one a thread, loaded before the part; each warp takes the r-th best of its 32 sample
// keys (warp max rounds) and warp 0 the median of the 32 warps' keys, two block barriers in all
// (kernels/cpu/topk_radix.h QuantileRank; below rank 2 the rounds over that sample; longer rows
// kSelectPrefetch's sample and rounds; its CPU twin is select_sort with sample_bin_bits 8 and
// sample_quantile). Rows of at most 4096 entries go straight from global memory into the
// placing's registers (two block barriers fewer), and the placing's bins start at an estimate of
// the picks' lowest score from the row's mean and standard deviation, not at its smallest score
// (a row of mixed signs otherwise crowds the picks into a few bins and is counted twice; the
// estimate is checked by the count). On an H100 (2026-12-06 12:16 UTC, graph
// timing, the same run) it was faster than kSelectPrefetch at every batch 1 / 32 / 128 and
// context 4K / 32K / 128K: 32 x 128K 10.88 against 11.54 us, 32 x 32K 8.06 against 9.02, 32 x 4K
// 5.05 against 5.24 (docs/perf.md "the top-k's threshold from the warps' rank keys"); the
// engine's GPU suite passed with it as the default in that call (175 tests, 8 skipped).
// kSelectQuantilePush (opt-in, not yet run on a GPU in this form): kSelectQuantile whose row of
// several blocks exchanges its lists' counts and key ranges by pushing them into each other's
// shared memory (st.async on an mbarrier, the pushes to the row's first block after a release
// arrival) instead of a release cluster barrier after the gathering and remote loads
// (kernels/cuda/topk_prefetch.cuh EndRowListsExchange). A form whose pushes carried no release
// arrival took the top-k at 32 x 128K from 10.02 to 9.85 us on an H100 (docs/perf.md issue 30,
// "the row's lists exchanged").
enum class TopKVariant {
  kRadixCluster,
  kSelectSort,
  kSelectPrefetch,
  kSelectQuantile,
  kSelectQuantilePush
};
inline constexpr TopKVariant kDefaultTopKVariant = TopKVariant::kSelectQuantile;

// top_k with `variant` and `blocks_per_row` blocks per row (kRadixCluster: 1, 2, 4 or 8;
// the select variants: 1 to 8; 0 picks as top_k does for that variant).
// The result depends on neither; tests and benchmarks use them to reach every path.
cudaError_t top_k_variant(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                          int64_t k, TopKVariant variant, int64_t blocks_per_row, int32_t* out,
                          cudaStream_t stream);

// top_k_variant with kRadixCluster.
cudaError_t top_k_split(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                        int64_t k, int64_t blocks_per_row, int32_t* out, cudaStream_t stream);

// Benchmarks only (bench/cuda): `variant` (kSelectSort, kSelectPrefetch, kSelectQuantile or
// kSelectQuantilePush) with the automatic block count, ended early so that graph timing shows
// what each stage costs:
// stop_after 1 ends after the output's -1 fill (launch, dependency wait, lengths), 4 after the
// sample's threshold (rows longer than 4096; kSelectPrefetch: with the part's first loads in
// flight), 2 after the gathering (kSelectSort: the candidates in the row's first block;
// kSelectPrefetch: in each block's list, their counts read), 3 before a fallback sort, 5 and 6 in a
// fallback selection; 0 runs it whole. Outputs of a stopped run are incomplete.
cudaError_t top_k_select_stages(const float* scores, int64_t rows, int64_t stride,
                                const int32_t* lengths, int64_t k, TopKVariant variant,
                                int stop_after, int32_t* out, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
