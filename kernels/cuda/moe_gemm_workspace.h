// The device workspace of moe_grouped_gemm's two paths (kernels/cuda/moe_gemm.cuh) as host
// arithmetic, without CUDA: moe_gemm.cu and moe_gemm_wgmma.cu lay their workspaces out with it,
// and the memory plan (engine/memory_plan.cc) counts the FP8 experts' workspace with it, so the
// plan and the allocation (engine/gpu/gpu_model_load.cc, AllocateFp8Experts) share one formula.
// Layouts (each part 256-byte aligned):
//   mma:   entry_pick [picks] int32 | items [max_items] | counts | FP8: xq [x_rows, k] e4m3,
//          xs [k / 128, x_rows] fp32 | partial [splits, picks, n] fp32 when k is split;
//   wgmma: entry_pick | items | counts | FP8: xq, xs | xg [picks, k] (FP8 e4m3, W8A16 bf16) |
//          FP8: xsg [k / 128, picks] fp32.
// Thread-safety: pure functions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace pdserve::kernels::cuda::moe_workspace {

inline constexpr int64_t kBlockK = 128;          // block_scaled::kBlockK
inline constexpr int64_t kMmaRowsPerBlock = 64;  // block_scaled::kRowsPerBlock
inline constexpr size_t kWorkItemBytes = 12;     // sizeof(block_scaled::WorkItem)
inline constexpr int kWgmmaSmallTile = 64;       // entries per work item
inline constexpr int kWgmmaLargeTile = 128;
inline constexpr int64_t kWgmmaMaxItems = 65535;  // grid.y
// PDSERVE_MOE_GEMM=auto (the default): the wgmma path from this many routed picks
// (tokens * top_k) on (moe_gemm.cuh has the measurement).
inline constexpr int64_t kMoeWgmmaMinPicks = 8192;
// The grouped mma.sync path splits k only below this many blocks (work items x 64-row tiles):
// from here on the split sums' reduce kernel, one launch more, costs more than the extra blocks
// gain. Measured at V4-Flash's batch 1 (6 routed experts x 64 row tiles = 384 blocks, where
// ChooseKSplits asked for 2 splits; docs/perf.md, "Issue 25, 2026-12-06 (later)"); below it (e.g.
// V4-Pro's grouped o_a, 16 groups x 16 row tiles) the splits are ChooseKSplits' as before.
inline constexpr int64_t kMoeSplitMaxBlocks = 384;

inline size_t AlignUp(size_t v) { return (v + 255) & ~size_t{255}; }

// Token tiles of 8 per block (the template parameter NT) for `rows` entries per item.
// (At most 4 tiles: with 8 the accumulators spilled and 64 tokens ran 4-7x slower than 32 on the
// H200, 2026-12-04; more tokens take more items, which re-read the weight tile from L2.)
inline int TilesFor(int64_t rows) { return rows <= 8 ? 1 : rows <= 16 ? 2 : 4; }

// Splits of k so that about 512 blocks run (4 per multiprocessor on an H200, 132 of them), each
// split at least 2 blocks of 128 k, at most 16 splits. A pure function of the sizes, so the
// workspace size is known before the launch.
inline int32_t ChooseKSplits(int64_t blocks, int64_t kblocks) {
  int32_t splits = 1;
  while (splits < 16 && blocks * splits < 512 && kblocks / (2 * splits) >= 2) splits *= 2;
  return splits;
}

// The mma.sync path's sizes for `tokens` x `top_k` picks, x_rows input rows and experts of
// [n, k] (`a16`: W8A16, which reads x as it is).
struct MmaSizes {
  int tiles = 1;
  int64_t max_items = 0;
  int32_t splits = 1;
  size_t entry_bytes = 0;
  size_t item_bytes = 0;
  size_t count_bytes = 256;
  size_t xq_bytes = 0;
  size_t xs_bytes = 0;
  size_t partial_bytes = 0;
  size_t total() const {
    return entry_bytes + item_bytes + count_bytes + xq_bytes + xs_bytes + partial_bytes;
  }
};
inline MmaSizes Mma(int64_t tokens, int64_t top_k, int64_t x_rows, int64_t n_experts, int64_t n,
                    int64_t k, bool a16) {
  MmaSizes p;
  const int64_t picks = tokens * top_k;
  const int64_t busy = std::max<int64_t>(1, std::min(n_experts, picks));
  // Entries per item: about 4x the mean picks per routed expert, so a skewed batch rarely needs
  // more than one item per expert.
  p.tiles = TilesFor(4 * ((picks + busy - 1) / busy));
  const int64_t chunk = 8 * p.tiles;
  p.max_items = busy + picks / chunk;
  const int64_t row_tiles = (n + kMmaRowsPerBlock - 1) / kMmaRowsPerBlock;
  p.splits =
      row_tiles * busy >= kMoeSplitMaxBlocks ? 1 : ChooseKSplits(row_tiles * busy, k / kBlockK);
  p.entry_bytes = AlignUp(static_cast<size_t>(picks) * 4);
  p.item_bytes = AlignUp(static_cast<size_t>(p.max_items) * kWorkItemBytes);
  if (!a16) {
    p.xq_bytes = AlignUp(static_cast<size_t>(x_rows * k));
    p.xs_bytes = AlignUp(static_cast<size_t>(x_rows * (k / kBlockK)) * 4);
  }
  p.partial_bytes = p.splits > 1 ? AlignUp(static_cast<size_t>(p.splits) * picks * n * 4) : 0;
  return p;
}

// The warpgroup-MMA path's sizes; token_tile as MoeWgmmaConfig::token_tile (0: 128 entries per
// work item when the routed experts average more than 64 picks, else 64).
struct WgmmaSizes {
  int n_tile = kWgmmaSmallTile;
  int64_t max_items = 0;
  size_t entry_bytes = 0;
  size_t item_bytes = 0;
  size_t count_bytes = 256;
  size_t xq_bytes = 0;
  size_t xs_bytes = 0;
  size_t xg_bytes = 0;
  size_t xsg_bytes = 0;
  size_t total() const {
    return entry_bytes + item_bytes + count_bytes + xq_bytes + xs_bytes + xg_bytes + xsg_bytes;
  }
};
inline WgmmaSizes Wgmma(int64_t tokens, int64_t top_k, int64_t x_rows, int64_t n_experts, int64_t k,
                        bool a16, int token_tile) {
  WgmmaSizes p;
  const int64_t picks = tokens * top_k;
  const int64_t busy = std::max<int64_t>(1, std::min(n_experts, picks));
  if (token_tile == kWgmmaSmallTile || token_tile == kWgmmaLargeTile) {
    p.n_tile = token_tile;
  } else {
    p.n_tile = picks > 64 * busy ? kWgmmaLargeTile : kWgmmaSmallTile;
  }
  p.max_items = busy + picks / p.n_tile;
  const int64_t kblocks = k / kBlockK;
  p.entry_bytes = AlignUp(static_cast<size_t>(picks) * 4);
  p.item_bytes = AlignUp(static_cast<size_t>(p.max_items) * kWorkItemBytes);
  if (!a16) {
    p.xq_bytes = AlignUp(static_cast<size_t>(x_rows * k));
    p.xs_bytes = AlignUp(static_cast<size_t>(x_rows * kblocks) * 4);
    p.xsg_bytes = AlignUp(static_cast<size_t>(picks * kblocks) * 4);
  }
  p.xg_bytes = AlignUp(static_cast<size_t>(picks * k) * (a16 ? 2 : 1));
  return p;
}

// The wgmma path's own size limits beyond moe_grouped_gemm's: TMA coordinates (n_experts * n and
// k under 2^31) and at most kWgmmaMaxItems work items.
inline bool WgmmaSizesFit(int64_t tokens, int64_t top_k, int64_t n_experts, int64_t n, int64_t k) {
  const int64_t picks = tokens * top_k;
  return n_experts * n < (int64_t{1} << 31) && k < (int64_t{1} << 31) &&
         std::min(n_experts, picks) + picks / kWgmmaSmallTile <= kWgmmaMaxItems;
}

// moe_grouped_gemm_workspace_bytes of one call of FP8 / W8A16 experts under PDSERVE_MOE_GEMM=auto
// and the default MoeWgmmaConfig, for sizes moe_grouped_gemm takes (the memory plan's: its rows
// stay far below the 2^31-pick and 2^62-element limits): the mma path's bytes, and from
// kMoeWgmmaMinPicks picks on the larger of both paths' where the wgmma path takes the sizes.
inline size_t AutoPathBytes(int64_t tokens, int64_t top_k, int64_t x_rows, int64_t n_experts,
                            int64_t n, int64_t k, bool a16) {
  const size_t mma = Mma(tokens, top_k, x_rows, n_experts, n, k, a16).total();
  if (tokens * top_k < kMoeWgmmaMinPicks || !WgmmaSizesFit(tokens, top_k, n_experts, n, k)) {
    return mma;
  }
  return std::max(mma, Wgmma(tokens, top_k, x_rows, n_experts, k, a16, 0).total());
}

}  // namespace pdserve::kernels::cuda::moe_workspace
