// kernels/cuda/moe_gemm_workspace.h (the memory plan's formula for the FP8 experts' workspace)
// against moe_grouped_gemm_workspace_bytes, what engine/gpu/gpu_model_load.cc allocates with, at
// V4-Flash and V4-Pro shapes, both FP8 formats, every token count up to past the wgmma path's
// threshold, one to eight expert-parallel ranks. Host arithmetic only: no GPU needed.
#include "kernels/cuda/moe_gemm_workspace.h"

#include <cstdint>
#include <cstdlib>

#include "gtest/gtest.h"
#include "kernels/cuda/moe_gemm.cuh"

namespace pdserve::kernels::cuda {
namespace {

struct Shape {
  int64_t hidden, inter, experts, top_k;
};

TEST(MoeGemmWorkspaceTest, AutoPathBytesAreWhatTheKernelAsksFor) {
  // The plan assumes the defaults (read once per process, before the first call here).
  unsetenv("PDSERVE_MOE_GEMM");
  unsetenv("PDSERVE_MOE_WGMMA");
  for (const Shape s : {Shape{4096, 2048, 256, 6}, Shape{7168, 3072, 384, 6}}) {
    for (int64_t world : {1, 4, 8}) {
      for (ExpertFormat format : {ExpertFormat::kFp8, ExpertFormat::kFp8W8A16}) {
        const bool a16 = format == ExpertFormat::kFp8W8A16;
        const int64_t experts = (s.experts + world - 1) / world;
        ExpertWeights gate_up{
            .format = format, .n_experts = experts, .n = 2 * s.inter, .k = s.hidden};
        ExpertWeights down{.format = format, .n_experts = experts, .n = s.hidden, .k = s.inter};
        for (int64_t t = 1; t <= 3 * kMoeWgmmaMinPicks / s.top_k; ++t) {
          ASSERT_EQ(
              moe_workspace::AutoPathBytes(t, s.top_k, t, experts, 2 * s.inter, s.hidden, a16),
              moe_grouped_gemm_workspace_bytes(t, s.top_k, t, gate_up))
              << "gate_up, tokens " << t << ", world " << world << ", a16 " << a16;
          ASSERT_EQ(moe_workspace::AutoPathBytes(t, s.top_k, t * s.top_k, experts, s.hidden,
                                                 s.inter, a16),
                    moe_grouped_gemm_workspace_bytes(t, s.top_k, t * s.top_k, down))
              << "down, tokens " << t << ", world " << world << ", a16 " << a16;
        }
      }
    }
  }
}

// The grouped mma.sync path splits k only below kMoeSplitMaxBlocks blocks (work items x 64-row
// tiles): at V4-Flash's batch 1 (top-6: 6 x 64 = 384 blocks) gate/up and down run unsplit, with
// no partial sums in the workspace; top-4 (256 blocks) and a grouped o_a of 16 groups x 16 row
// tiles (256 blocks) split as ChooseKSplits says (2), with the partial sums.
TEST(MoeGemmWorkspaceTest, GroupedMmaSplitsKOnlyBelowItsBlockThreshold) {
  EXPECT_EQ(moe_workspace::kMoeSplitMaxBlocks, 384);
  for (const bool a16 : {false, true}) {
    const moe_workspace::MmaSizes up = moe_workspace::Mma(1, 6, 1, 256, 4096, 4096, a16);
    const moe_workspace::MmaSizes down = moe_workspace::Mma(1, 6, 6, 256, 4096, 2048, a16);
    EXPECT_EQ(up.splits, 1) << "a16 " << a16;
    EXPECT_EQ(down.splits, 1) << "a16 " << a16;
    EXPECT_EQ(up.partial_bytes, 0u);
    EXPECT_EQ(down.partial_bytes, 0u);
    const moe_workspace::MmaSizes top4 = moe_workspace::Mma(1, 4, 1, 256, 4096, 4096, a16);
    EXPECT_EQ(top4.splits, moe_workspace::ChooseKSplits(256, 32));
    EXPECT_EQ(top4.splits, 2);
    EXPECT_EQ(top4.partial_bytes, moe_workspace::AlignUp(size_t{2} * 4 * 4096 * 4));
    const moe_workspace::MmaSizes o_a = moe_workspace::Mma(1, 16, 16, 16, 1024, 4096, a16);
    EXPECT_EQ(o_a.splits, 2);
    EXPECT_GT(o_a.partial_bytes, 0u);
  }
}

// MoeMmaGrouping::kReuse reads the grouping the gate+up call left: the down call finds it only
// where the grouping's place and item size in the workspace depend on the picks alone, not on the
// projection's n, k, input rows or format (V4-Flash's and V4-Pro's gate+up and down, every batch
// to 128 and past the decode sizes).
TEST(MoeGemmWorkspaceTest, TheGroupingsPlaceDependsOnThePicksAlone) {
  for (const Shape s : {Shape{4096, 2048, 256, 6}, Shape{7168, 3072, 384, 6}}) {
    for (int64_t tokens : {2, 5, 8, 37, 64, 128, 1000}) {
      for (bool a16 : {false, true}) {
        const moe_workspace::MmaSizes gate_up =
            moe_workspace::Mma(tokens, s.top_k, tokens, s.experts, 2 * s.inter, s.hidden, a16);
        const moe_workspace::MmaSizes down = moe_workspace::Mma(tokens, s.top_k, tokens * s.top_k,
                                                                s.experts, s.hidden, s.inter, !a16);
        EXPECT_EQ(gate_up.tiles, down.tiles) << tokens;
        EXPECT_EQ(gate_up.max_items, down.max_items) << tokens;
        EXPECT_EQ(gate_up.entry_bytes, down.entry_bytes) << tokens;
        EXPECT_EQ(gate_up.item_bytes, down.item_bytes) << tokens;
        EXPECT_EQ(gate_up.count_bytes, down.count_bytes) << tokens;
      }
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
