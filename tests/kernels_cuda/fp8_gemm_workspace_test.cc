// The host formulas the memory plan counts GpuModel's workspaces with (engine/gpu_workspace_plan.h)
// against the kernels' own workspace functions, what the engine allocates with, at V4-Flash and
// V4-Pro shapes under the defaults: kernels/cuda/fp8_gemm_workspace.h (dense FP8 GEMMs, every row
// count to past cuBLASLt's threshold and some large ones; ProjectionBytes' shortcut against every
// row), moe_gemm_workspace.h at the grouped o_a's shapes, sparse_decode_workspace.h against
// SparseDecodeWorkspaceBytes. Host arithmetic only: no GPU needed.
#include "kernels/cuda/fp8_gemm_workspace.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_gemm_workspace.h"
#include "kernels/cuda/sparse_decode_attention.cuh"
#include "kernels/cuda/sparse_decode_workspace.h"

namespace pdserve::kernels::cuda {
namespace {

// [n, k] of V4-Flash's and V4-Pro's dense FP8 projections (q_b, o_a per group, o_b, shared down,
// the fused attention input) and a k / 128 that is not a multiple of 4 (padded weight scales).
constexpr std::pair<int64_t, int64_t> kShapes[] = {
    {32768, 1024}, {1024, 4096}, {4096, 8192},  {4096, 2048}, {2432, 4096},
    {65536, 1536}, {1536, 8192}, {7168, 16384}, {7168, 3072}, {1000, 640}};

TEST(Fp8GemmWorkspaceTest, HostFormulasAreWhatTheKernelsAskFor) {
  // The plan assumes the defaults (read once per process, before the first call here).
  unsetenv("PDSERVE_FP8_GEMM");
  unsetenv("PDSERVE_FP8_WGMMA");
  const Fp8WgmmaConfig& config = fp8_gemm_wgmma_default_config();
  EXPECT_EQ(fp8_gemm_forced_path(), "");
  EXPECT_EQ(config.warpgroups, kFp8WgmmaDecodeConfig.warpgroups);
  EXPECT_EQ(config.target_blocks, kFp8WgmmaDecodeConfig.target_blocks);
  EXPECT_EQ(config.a16_register_weights, kFp8WgmmaDecodeConfig.a16_register_weights);
  for (const auto& [n, k] : kShapes) {
    std::vector<int64_t> rows = {997, 4096, 8191, 8192, 16385};
    for (int64_t m = 1; m <= 300; ++m) rows.push_back(m);
    for (const int64_t m : rows) {
      const Fp8GemmPath path = fp8_workspace::PathFor(m, "");
      ASSERT_EQ(path, fp8_gemm_path(m)) << m;
      ASSERT_EQ(fp8_workspace::W8a8Bytes(m, n, k, path, kFp8WgmmaDecodeConfig),
                fp8_gemm_workspace_bytes(m, n, k))
          << m << " x " << n << " x " << k;
      ASSERT_EQ(fp8_workspace::W8a16Bytes(m, n, k, kFp8WgmmaDecodeConfig),
                fp8_gemm_w8a16_workspace_bytes(m, n, k))
          << m << " x " << n << " x " << k;
      ASSERT_EQ(fp8_workspace::QuantizedBytes(m, n, k), fp8_gemm_quantized_workspace_bytes(m, n, k))
          << m << " x " << n << " x " << k;
    }
  }
}

// W8A16 token tiles up to a16_cluster_reduce_tokens reduce their k splits in the kernel (no
// partial sums), larger ones through the workspace; cluster_reduce caps the splits at
// kFp8WgmmaClusterSplits. [2, 1024] (one row tile, 8 k blocks): 8 splits either way.
TEST(Fp8GemmWorkspaceTest, SmallW8a16TilesNeedNoPartialSums) {
  const Fp8WgmmaConfig c = kFp8WgmmaDecodeConfig;
  ASSERT_EQ(c.a16_cluster_reduce_tokens, 16);
  for (const int64_t m : {9, 12, 16}) {
    const fp8_workspace::WgmmaTiling t = fp8_workspace::PlanWgmmaTiling(m, 2, 1024, c, true);
    EXPECT_TRUE(t.cluster_reduce) << m;
    EXPECT_EQ(t.splits, 8) << m;
    EXPECT_EQ(t.partial_bytes, 0u) << m;
    // W8A8 is not affected.
    EXPECT_FALSE(fp8_workspace::PlanWgmmaTiling(m, 2, 1024, c, false).cluster_reduce) << m;
  }
  for (const int64_t m : {17, 24, 64}) {
    const fp8_workspace::WgmmaTiling t = fp8_workspace::PlanWgmmaTiling(m, 2, 1024, c, true);
    EXPECT_FALSE(t.cluster_reduce) << m;
    EXPECT_EQ(t.partial_bytes, fp8_workspace::AlignUp(static_cast<size_t>(8 * m * 2 * 4))) << m;
  }
  Fp8WgmmaConfig off = c;
  off.a16_cluster_reduce_tokens = 0;
  EXPECT_FALSE(fp8_workspace::PlanWgmmaTiling(12, 2, 1024, off, true).cluster_reduce);
}

// ProjectionBytes looks at every row up to MonotoneRows and the last 4 past it: the same as
// every row.
TEST(Fp8GemmWorkspaceTest, ProjectionBytesEqualsTheLargestOverEveryRow) {
  const int64_t monotone = fp8_workspace::MonotoneRows(kFp8WgmmaDecodeConfig);
  for (const auto& [n, k] : {std::pair<int64_t, int64_t>{4096, 8192}, {1000, 640}, {32768, 1024}}) {
    for (bool shared : {false, true}) {
      size_t most = 0;
      int64_t done = 0;
      for (int64_t rows : {int64_t{1}, int64_t{77}, monotone - 1, monotone + 2, 2 * monotone + 3}) {
        for (int64_t m = done + 1; m <= rows; ++m) {
          most =
              std::max(most, fp8_workspace::RowBytes(m, n, k, shared, "", kFp8WgmmaDecodeConfig));
        }
        done = rows;
        ASSERT_EQ(fp8_workspace::ProjectionBytes(rows, n, k, shared, "", kFp8WgmmaDecodeConfig),
                  most)
            << rows << " rows of " << n << " x " << k;
      }
    }
  }
}

// The grouped o_a (engine/gpu/gpu_model_fused.cc): 8 groups of [1024, 4096] (V4-Flash) and 16 of
// [1024, 8192] (V4-Pro), x_per_pick rows, up to 64 rows.
TEST(Fp8GemmWorkspaceTest, GroupedOaBytesAreWhatMoeGemmAsksFor) {
  unsetenv("PDSERVE_MOE_GEMM");
  for (const auto& [groups, k] : {std::pair<int64_t, int64_t>{8, 4096}, {16, 8192}}) {
    for (ExpertFormat format : {ExpertFormat::kFp8, ExpertFormat::kFp8W8A16}) {
      const ExpertWeights view{.format = format, .n_experts = groups, .n = 1024, .k = k};
      for (int64_t t = 1; t <= 64; ++t) {
        ASSERT_EQ(moe_workspace::AutoPathBytes(t, groups, t * groups, groups, 1024, k,
                                               format == ExpertFormat::kFp8W8A16),
                  moe_grouped_gemm_workspace_bytes(t, groups, t * groups, view))
            << t;
      }
    }
  }
}

// GpuModel::Impl::DecodeParams' launch (window 128, the CSA top-k or an HCA capacity) on 132
// multiprocessors: the workspace the launcher asks for is sparse_decode_workspace's.
TEST(Fp8GemmWorkspaceTest, DecodeAttentionBytesAreWhatTheLauncherAsksFor) {
  for (int64_t heads : {64, 128}) {
    for (int64_t compressed : {0, 512, 1024, 8192, 262144}) {
      for (int64_t batch : {1, 2, 3, 8, 64, 131, 132, 256}) {
        SparseDecodeParams p;
        p.batch = batch;
        p.heads = heads;
        p.window_size = 128;
        p.compressed_slots = compressed;
        p.entries_per_split = SparseDecodeEntriesPerSplit(batch, heads, 128 + compressed, 132);
        ASSERT_EQ(sparse_decode_workspace::DecodeCallBytes(batch, heads, 128 + compressed, 132),
                  SparseDecodeWorkspaceBytes(p))
            << batch << " x " << heads << " heads, " << compressed;
      }
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
