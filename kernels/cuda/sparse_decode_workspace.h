// sparse_decode_attention's split rule and device workspace
// (kernels/cuda/sparse_decode_attention.cuh) as host arithmetic, without CUDA:
// sparse_decode_split_rule.cu and sparse_decode_attention.cu compute them with it, and the memory
// plan (engine/gpu_workspace_plan.h) counts GpuModel's attn_workspace with it, so the plan and the
// allocation (engine/gpu/gpu_model_load.cc, Allocate: the largest over the decode buckets and
// layers) share one formula. Workspace layout: bf16 partial outputs [batch * splits * heads,
// kSparseHeadDim] | fp32 maxima [batch * splits * heads] | fp32 sums [batch * splits * heads], each
// part 256-byte aligned. Thread-safety: pure functions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kSparseHeadDim = 512;
inline constexpr int64_t kSparseHeadsPerBlock = 64;  // heads must be a multiple of this
inline constexpr int64_t kSparseTile = 32;           // entries_per_split must be a multiple
// kClusterMerge: most splits merged in one cluster (the portable cluster size).
inline constexpr int64_t kSparseMaxClusterSplits = 8;

namespace sparse_decode_workspace {

// Splits of `entries` (window_size + compressed_slots) KV entries at `entries_per_split` each
// (SparseDecodeSplits); 0 for entries_per_split <= 0.
inline int64_t Splits(int64_t entries, int64_t entries_per_split) {
  if (entries_per_split <= 0) return 0;
  return std::max<int64_t>(1, (entries + entries_per_split - 1) / entries_per_split);
}

// SparseDecodeEntriesPerSplit: the split size (a multiple of kSparseTile) for requests of up to
// `max_entries` entries that a cost model in microseconds, fitted to a sweep of every split size
// on an H200 (bench/cuda/cuda_bench.cu with PDSERVE_BENCH_SPLITS=1, graph timing; docs/perf.md,
// 2026-12-03), predicts fastest: a block takes 1.04 per 32-row tile whatever the load (the
// per-block pipeline, not HBM, bounds it), and splitting costs 4 (the partials staged and written,
// the combine launch) + 0.2 per split (the combine's loop over them) + 0.3 per MB of partials
// written and read back (fitted with fp32 partials; they are bf16 since, at the same cost per MB).
// Blocks stay within one wave (one block fits per multiprocessor).
inline int64_t EntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries, int sm_count) {
  constexpr double kTileUs = 1.04;
  constexpr double kSplitUs = 4.0;
  constexpr double kPerSplitUs = 0.2;
  constexpr double kPartialUsPerMb = 0.3;
  constexpr double kPartialMbPerBlock = kSparseHeadsPerBlock * kSparseHeadDim * 2 / 1e6;  // bf16
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

inline size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

// SparseDecodeWorkspaceBytes of a launch over `batch` requests of `heads` heads in `splits`
// splits.
inline size_t Bytes(int64_t batch, int64_t heads, int64_t splits) {
  const auto rows =
      static_cast<size_t>(batch) * static_cast<size_t>(splits) * static_cast<size_t>(heads);
  return AlignUp(rows * kSparseHeadDim * 2) + 2 * AlignUp(rows * sizeof(float));
}

// The workspace of GpuModel's decode call at `batch` rows over a layer of `entries` KV entries
// (window_size + compressed_slots: the indexer's top-k on CSA layers, the compressor's capacity
// on HCA layers, none on sliding layers), with GpuModel::Impl::DecodeParams' split size on a GPU
// of `sm_count` multiprocessors.
inline size_t DecodeCallBytes(int64_t batch, int64_t heads, int64_t entries, int sm_count) {
  return Bytes(batch, heads,
               Splits(entries, EntriesPerSplit(batch, heads, entries, std::max(sm_count, 1))));
}

}  // namespace sparse_decode_workspace
}  // namespace pdserve::kernels::cuda
