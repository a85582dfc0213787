// The split size rule of sparse_decode_attention (sparse_decode_attention.cuh): host arithmetic,
// a cost model fitted to H200 measurements.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/sparse_decode_attention.cuh"

namespace pdserve::kernels::cuda {

int64_t SparseDecodeSplits(const SparseDecodeParams& p) {
  if (p.entries_per_split <= 0) return 0;
  const int64_t entries = p.window_size + p.compressed_slots;
  return std::max<int64_t>(1, (entries + p.entries_per_split - 1) / p.entries_per_split);
}

int64_t SparseDecodeEntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries,
                                    int sm_count) {
  // Cost model in microseconds, fitted to a sweep of every split size on an H200
  // (bench/cuda/cuda_bench.cu with PDSERVE_BENCH_SPLITS=1, graph timing; docs/perf.md,
  // 2026-12-03): a block takes 1.04 per 32-row tile whatever the load (the per-block pipeline,
  // not HBM, bounds it), and splitting costs 4 (the partials staged and written, the combine
  // launch) + 0.2 per split (the combine's loop over them) + 0.3 per MB of partials written and
  // read back (fitted with fp32 partials; they are bf16 since, at the same cost per MB). Blocks
  // stay within one wave (one block fits per multiprocessor).
  constexpr double kTileUs = 1.04;
  constexpr double kSplitUs = 4.0;
  constexpr double kPerSplitUs = 0.2;
  constexpr double kPartialUsPerMb = 0.3;
  constexpr double kPartialMbPerBlock =
      kSparseHeadsPerBlock * kSparseHeadDim * sizeof(__nv_bfloat16) / 1e6;
  const int64_t blocks = std::max<int64_t>(1, batch * (heads / kSparseHeadsPerBlock));
  const int64_t tiles = std::max<int64_t>(1, (max_entries + kSparseTile - 1) / kSparseTile);
  const int64_t max_splits = std::min<int64_t>(tiles, std::max<int64_t>(1, sm_count / blocks));
  int64_t best_tiles = tiles;
  double best_us = static_cast<double>(tiles) * kTileUs;
  for (int64_t splits = 2; splits <= max_splits; ++splits) {
    const int64_t per = (tiles + splits - 1) / splits;  // tiles per split
    const int64_t used = (tiles + per - 1) / per;       // splits that split size makes
    const double us = static_cast<double>(per) * kTileUs + kSplitUs +
                      kPerSplitUs * static_cast<double>(used) +
                      kPartialUsPerMb * kPartialMbPerBlock * static_cast<double>(blocks * used);
    if (used > 1 && us < best_us) {
      best_us = us;
      best_tiles = per;
    }
  }
  return best_tiles * kSparseTile;
}

int64_t SparseDecodeClusterEntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries,
                                           int sm_count, const int* max_active_clusters) {
  const int64_t per = SparseDecodeEntriesPerSplit(batch, heads, max_entries, sm_count);
  const int64_t tiles = std::max<int64_t>(1, (max_entries + kSparseTile - 1) / kSparseTile);
  const int64_t clusters = std::max<int64_t>(1, batch * (heads / kSparseHeadsPerBlock));
  int64_t splits = std::min((tiles * kSparseTile + per - 1) / per, kSparseMaxClusterSplits);
  while (splits > 1 && max_active_clusters[splits] < clusters) --splits;
  const int64_t tiles_per_split = (tiles + splits - 1) / splits;
  return tiles_per_split * kSparseTile;
}

}  // namespace pdserve::kernels::cuda
