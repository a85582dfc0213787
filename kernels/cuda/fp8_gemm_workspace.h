// The device workspace of the dense FP8 GEMMs (kernels/cuda/fp8_gemm.cuh: fp8_gemm,
// fp8_gemm_w8a16, fp8_gemm_quantized) as host arithmetic, without CUDA: fp8_gemm.cu and
// fp8_gemm_wgmma.cu size their workspaces with it, and the memory plan
// (engine/gpu_workspace_plan.h) counts GpuModel's dense FP8 workspace with it, so the plan and the
// allocation (engine/gpu/gpu_model_load.cc, AllocateFp8) share one formula. Also the path rule and
// the wgmma kernel's config, which the sizes depend on. Layouts (each part 256-byte aligned):
//   mma:      xq [m, k] e4m3 | xs [k / 128, m] fp32 (W8A8) | partial [splits, m, n] fp32 (unless
//             the splits reduce in the kernel);
//   wgmma:    the same parts with the wgmma kernel's tiles and splits;
//   cuBLASLt: xq, xs of the first m & ~3 rows | the weight scales padded | kCublasLtWorkspace, or
//             the mma path's for the last m % 4 rows where larger.
// Thread-safety: pure functions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kernels/cuda/moe_gemm_workspace.h"

namespace pdserve::kernels::cuda {

// Which kernel fp8_gemm tries first for m tokens (fp8_gemm.cuh, "Paths"). Host only.
inline constexpr int64_t kFp8MmaMaxTokens = 8;
// fp8_gemm_cublaslt: only for n a multiple of this (whole 128 x 128 weight scale blocks).
inline constexpr int64_t kFp8LtRowBlock = 128;
// fp8_gemm: cuBLASLt from this many tokens on.
inline constexpr int64_t kFp8LtMinTokens = 64;
enum class Fp8GemmPath { kWgmma, kCublasLt, kMma };
// cuBLASLt's own workspace inside fp8_gemm_cublaslt's (fp8_gemm.cuh).
inline constexpr size_t kCublasLtWorkspace = size_t{32} << 20;

// fp8_gemm_wgmma's tiles and pipeline; fp8_gemm.cuh documents each field.
inline constexpr int kFp8WgmmaClusterSplits = 8;
struct Fp8WgmmaConfig {
  int warpgroups = 1;
  int stages = 4;
  int target_blocks = 264;
  bool cluster_reduce = false;
  bool smem_scales = false;
  bool a16_register_weights = false;
  bool alternate_turns = false;
  bool two_in_flight = false;
  bool split_tokens = false;
  bool stagger_k = false;
  bool multicast_activations = false;
  // 96 or 128: token tiles up to 64 with one consumer warpgroup and one block at a time run a
  // build of the kernel capped at that many registers a thread (more blocks per multiprocessor;
  // same arithmetic and bits); 0: the kernel as it is.
  int max_registers = 0;
  // W8A16 (fp8_gemm_w8a16_wgmma) token tiles up to this size reduce their k splits in the kernel
  // as cluster_reduce does, whatever cluster_reduce says (0: none; at most 64).
  int a16_cluster_reduce_tokens = 0;
};
// The config fp8_gemm and fp8_gemm_w8a16 use without PDSERVE_FP8_WGMMA (fp8_gemm.cuh says why).
inline constexpr Fp8WgmmaConfig MakeFp8WgmmaDecodeConfig() {
  Fp8WgmmaConfig c{0, 0, 264, false, true, true};
  c.a16_cluster_reduce_tokens = 16;
  return c;
}
inline constexpr Fp8WgmmaConfig kFp8WgmmaDecodeConfig = MakeFp8WgmmaDecodeConfig();

namespace fp8_workspace {

using moe_workspace::AlignUp;
using moe_workspace::ChooseKSplits;
using moe_workspace::kBlockK;
using moe_workspace::kMmaRowsPerBlock;
using moe_workspace::TilesFor;

// block_scaled::kMaxClusterSplits: W8A16 splits reduced in the mma kernel.
inline constexpr int32_t kMmaClusterSplits = 8;
// fp8_gemm_wgmma's limits (fp8_gemm_wgmma_parts.cuh static_asserts they agree).
inline constexpr int kWgmmaMaxTokenTile = 128;
inline constexpr int kWgmmaMaxWarpgroups = 2;
inline constexpr int kWgmmaMaxSplits = 32;
inline constexpr int kWgmmaRegWeightTokens = 64;
inline constexpr int kWgmmaClusterReduceTokens = 64;
inline constexpr int kWgmmaAlternateA8Tokens = 64;
inline constexpr int kWgmmaSplitTokensMin = 8;

// fp8_gemm_path for m tokens with PDSERVE_FP8_GEMM = `forced` ("" for the default).
inline Fp8GemmPath PathFor(int64_t m, std::string_view forced) {
  if (forced == "mma") return Fp8GemmPath::kMma;
  if (forced == "wgmma") return Fp8GemmPath::kWgmma;
  if (forced == "cublaslt") return Fp8GemmPath::kCublasLt;
  if (m <= kFp8MmaMaxTokens) return Fp8GemmPath::kMma;
  if (forced == "own") return Fp8GemmPath::kWgmma;
  return m < kFp8LtMinTokens ? Fp8GemmPath::kWgmma : Fp8GemmPath::kCublasLt;
}

// The workspace of one call of m x n x k split `splits` ways over k: the quantized rows and their
// scales (W8A8; W8A16, `a16`, reads x as it is) and the split-k partial sums, unless the splits
// reduce in the kernel (cluster_reduce).
struct SplitWorkspace {
  int32_t splits = 1;
  bool cluster_reduce = false;
  size_t xq_bytes = 0;
  size_t xs_bytes = 0;
  size_t partial_bytes = 0;
  size_t total() const { return xq_bytes + xs_bytes + partial_bytes; }
  void SetBytes(int64_t m, int64_t n, int64_t k, bool a16) {
    xq_bytes = a16 ? 0 : AlignUp(static_cast<size_t>(m * k));
    xs_bytes = a16 ? 0 : AlignUp(static_cast<size_t>(m * (k / kBlockK)) * sizeof(float));
    partial_bytes =
        splits > 1 && !cluster_reduce ? AlignUp(static_cast<size_t>(splits) * m * n * 4) : 0;
  }
};

// The mma.sync path (fp8_gemm_mma, fp8_gemm_w8a16_mma): each row its own, tiles of 8 tokens, k
// split as ChooseKSplits says. W8A16 with one token tile reduces its k splits (at most
// kMmaClusterSplits) in the kernel: no partial sums then.
struct DensePlan : SplitWorkspace {
  int tiles = 1;
  int64_t items = 0;
};
inline DensePlan PlanDense(int64_t m, int64_t n, int64_t k, bool a16) {
  DensePlan p;
  p.tiles = TilesFor(m);
  p.items = (m + 8 * p.tiles - 1) / (8 * p.tiles);
  const int64_t row_tiles = (n + kMmaRowsPerBlock - 1) / kMmaRowsPerBlock;
  p.splits = ChooseKSplits(row_tiles * p.items, k / kBlockK);
  p.cluster_reduce = a16 && p.tiles == 1 && p.splits > 1;
  if (p.cluster_reduce) p.splits = std::min(p.splits, kMmaClusterSplits);
  p.SetBytes(m, n, k, a16);
  return p;
}

// The wgmma kernel's tiles and k splits (the part of its launch plan the workspace depends on;
// fp8_gemm_wgmma.cu adds the pipeline). fp8_gemm.cuh's Fp8WgmmaConfig says what each field does.
struct WgmmaTiling : SplitWorkspace {
  int n_tile = 8;   // tokens per block
  int wgs = 2;      // row groups of 64 weight rows
  int turns = 1;    // consumer warpgroups taking turns on one row group's k blocks
  int tgroups = 1;  // split_tokens: token groups per block
  int64_t token_tiles = 1;
  int64_t row_tiles = 1;
};
inline WgmmaTiling PlanWgmmaTiling(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config,
                                   bool a16) {
  WgmmaTiling p;
  p.n_tile = static_cast<int>(
      std::min<int64_t>(kWgmmaMaxTokenTile, (std::max<int64_t>(m, 1) + 7) / 8 * 8));
  // warpgroups 0 (auto): 2 for W8A16 token tiles past kWgmmaRegWeightTokens when there are
  // target_blocks row tiles of 64 without a split (wq_b at 128 tokens: the bf16 activations
  // re-read per block halved), else 1.
  const int64_t row_tiles_1 = (n + 63) / 64;
  const bool two = a16 && p.n_tile > kWgmmaRegWeightTokens && config.target_blocks > 0 &&
                   row_tiles_1 >= config.target_blocks;
  p.wgs = config.warpgroups == 0 ? (two ? 2 : 1)
                                 : std::clamp(config.warpgroups, 1, kWgmmaMaxWarpgroups);
  if (config.alternate_turns && (a16 || p.n_tile <= kWgmmaAlternateA8Tokens)) {  // one row group
    p.wgs = 1;
    p.turns = 2;
  } else if (config.split_tokens && m > kWgmmaSplitTokensMin) {  // two token groups
    p.wgs = 1;
    p.tgroups = 2;
    p.n_tile =
        static_cast<int>(std::min<int64_t>(kWgmmaMaxTokenTile / 2, ((m + 1) / 2 + 7) / 8 * 8));
  }
  const int n_block = p.n_tile * p.tgroups;
  p.token_tiles = (m + n_block - 1) / n_block;
  p.row_tiles = (n + 64 * p.wgs - 1) / (64 * p.wgs);
  const int64_t tiles = std::max<int64_t>(1, p.token_tiles * p.row_tiles);
  const int64_t kblocks = k / kBlockK;
  int64_t splits = config.target_blocks > 0 ? (config.target_blocks + tiles / 2) / tiles : 1;
  // cluster_reduce only for token tiles <= kWgmmaClusterReduceTokens (at 128 tokens it was 1.7x
  // slower than the reduce kernel on the H200, 2026-12-04 15:40 UTC).
  const bool cluster =
      (config.cluster_reduce || (a16 && p.n_tile <= config.a16_cluster_reduce_tokens)) &&
      p.n_tile <= kWgmmaClusterReduceTokens && p.turns == 1 && p.tgroups == 1;
  const int64_t max_splits = cluster ? kFp8WgmmaClusterSplits : kWgmmaMaxSplits;
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(max_splits, kblocks));
  if (cluster) {
    while ((splits & (splits - 1)) != 0) splits &= splits - 1;  // a power of two: 1, 2, 4, 8
  }
  p.splits = static_cast<int32_t>(splits);
  p.cluster_reduce = cluster && p.splits > 1;
  p.SetBytes(m, n, k, a16);
  return p;
}

// fp8_gemm_cublaslt: cuBLASLt reads the BLK128x128 weight scales with a leading dimension of
// round_up(k / 128, 4) and needs the activation-scale rows a multiple of 4, so the first m & ~3
// rows go through cuBLASLt (the weight scales copied padded when k / 128 is not a multiple of 4)
// and the last m % 4 rows through the mma path (fp8_gemm.cu has the measurement behind it).
struct LtPlan {
  int64_t lt_rows = 0;    // rows through cuBLASLt (a multiple of 4)
  int64_t kb_padded = 0;  // leading dimension of the weight scales cuBLASLt reads
  bool repack = false;    // copy the weight scales to a padded buffer first
  size_t xq_bytes = 0, xs_bytes = 0, scale_bytes = 0, tail_bytes = 0;
  size_t lt_total() const { return xq_bytes + xs_bytes + scale_bytes + kCublasLtWorkspace; }
  size_t total() const { return std::max(lt_total(), tail_bytes); }
};
inline LtPlan PlanLt(int64_t m, int64_t n, int64_t k) {
  LtPlan p;
  const int64_t kb = k / kBlockK;
  p.lt_rows = m & ~int64_t{3};
  p.kb_padded = (kb + 3) & ~int64_t{3};
  p.repack = p.kb_padded != kb;
  p.xq_bytes = AlignUp(static_cast<size_t>(p.lt_rows * k));
  p.xs_bytes = AlignUp(static_cast<size_t>(p.lt_rows * kb) * sizeof(float));
  const int64_t nb = (n + kFp8LtRowBlock - 1) / kFp8LtRowBlock;
  p.scale_bytes = p.repack ? AlignUp(static_cast<size_t>(nb * p.kb_padded) * sizeof(float)) : 0;
  p.tail_bytes = m > p.lt_rows ? PlanDense(m - p.lt_rows, n, k, false).total() : 0;
  return p;
}

// The three functions' workspaces for sizes they take (fp8_gemm.cu checks the sizes and returns 0
// for others): fp8_gemm_workspace_bytes on `path` (fp8_gemm_path(m)) with the wgmma `config`,
// fp8_gemm_w8a16_workspace_bytes, fp8_gemm_quantized_workspace_bytes.
inline size_t W8a8Bytes(int64_t m, int64_t n, int64_t k, Fp8GemmPath path,
                        const Fp8WgmmaConfig& config) {
  const size_t lt = path == Fp8GemmPath::kCublasLt ? PlanLt(m, n, k).total() : 0;
  return std::max(
      {PlanDense(m, n, k, false).total(), PlanWgmmaTiling(m, n, k, config, false).total(), lt});
}
inline size_t W8a16Bytes(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config) {
  return std::max(PlanDense(m, n, k, true).partial_bytes,
                  PlanWgmmaTiling(m, n, k, config, true).total());
}
inline size_t QuantizedBytes(int64_t m, int64_t n, int64_t k) {
  const size_t lt = PlanLt(m, n, k).scale_bytes + kCublasLtWorkspace;
  const int64_t m4 = m & ~int64_t{3};
  return std::max({lt, PlanDense(m4, n, k, false).partial_bytes,
                   PlanDense(m - m4, n, k, false).partial_bytes, size_t{256}});
}

// What GpuModel::Impl::AllocateFp8 sizes its fp8_workspace for, per call of m rows of one FP8
// projection of [n, k] (a grouped o_a: n = its rows per group): the largest of fp8_gemm's and
// fp8_gemm_w8a16's workspaces and, with fp8_shared_act_quant, fp8_gemm_quantized's where the path
// is cuBLASLt. `forced`: PDSERVE_FP8_GEMM ("" by default); `config`: the wgmma config.
inline size_t RowBytes(int64_t m, int64_t n, int64_t k, bool shared_act_quant,
                       std::string_view forced, const Fp8WgmmaConfig& config) {
  const Fp8GemmPath path = PathFor(m, forced);
  return std::max(
      {W8a8Bytes(m, n, k, path, config), W8a16Bytes(m, n, k, config),
       shared_act_quant && path == Fp8GemmPath::kCublasLt ? QuantizedBytes(m, n, k) : size_t{0}});
}
// From this many rows on every k split of the three functions is 1 (the mma path splits below
// 512 blocks of 32 rows, the wgmma path below about target_blocks tiles of at most 128 rows), so
// RowBytes past it is a non-decreasing part (the activations' bytes) plus a part that depends on
// m % 4 only (the cuBLASLt path's mma tail): its largest over m0 .. m is at one of the last 4.
inline int64_t MonotoneRows(const Fp8WgmmaConfig& config) {
  return 512 * 32 + int64_t{kWgmmaMaxTokenTile} * (std::max(config.target_blocks, 0) + 1);
}
// RowBytes' largest over every call of 1 .. max_rows rows (the k split makes it non-monotonic in
// the rows): AllocateFp8's figure for one projection. Past MonotoneRows only the last 4 rows
// count (above; tests/kernels_cuda/fp8_gemm_workspace_test.cc checks it against every row).
inline size_t ProjectionBytes(int64_t max_rows, int64_t n, int64_t k, bool shared_act_quant,
                              std::string_view forced, const Fp8WgmmaConfig& config) {
  const int64_t monotone = MonotoneRows(config);
  size_t most = 0;
  for (int64_t m = 1; m <= std::min(max_rows, monotone); ++m) {
    most = std::max(most, RowBytes(m, n, k, shared_act_quant, forced, config));
  }
  for (int64_t m = std::max(monotone + 1, max_rows - 3); m <= max_rows; ++m) {
    most = std::max(most, RowBytes(m, n, k, shared_act_quant, forced, config));
  }
  return most;
}

}  // namespace fp8_workspace
}  // namespace pdserve::kernels::cuda
