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
// no partial sums; 4 experts (256 blocks) too; 3 experts (192 blocks) split as ChooseKSplits says
// (4 at k = 4096, 4 at 2048), with the partial sums in the workspace.
TEST(MoeGemmWorkspaceTest, GroupedMmaSplitsKOnlyBelowItsBlockThreshold) {
  for (const bool a16 : {false, true}) {
    for (const int64_t top_k : {6, 4}) {
      const moe_workspace::MmaSizes up = moe_workspace::Mma(1, top_k, 1, 256, 4096, 4096, a16);
      const moe_workspace::MmaSizes down =
          moe_workspace::Mma(1, top_k, top_k, 256, 4096, 2048, a16);
      EXPECT_GE(64 * top_k, moe_workspace::kMoeSplitMaxBlocks);
      EXPECT_EQ(up.splits, 1) << "top_k " << top_k << " a16 " << a16;
      EXPECT_EQ(down.splits, 1) << "top_k " << top_k << " a16 " << a16;
      EXPECT_EQ(up.partial_bytes, 0u);
      EXPECT_EQ(down.partial_bytes, 0u);
    }
    const moe_workspace::MmaSizes up = moe_workspace::Mma(1, 3, 1, 256, 4096, 4096, a16);
    const moe_workspace::MmaSizes down = moe_workspace::Mma(1, 3, 3, 256, 4096, 2048, a16);
    EXPECT_EQ(up.splits, moe_workspace::ChooseKSplits(192, 32));
    EXPECT_EQ(up.splits, 4);
    EXPECT_EQ(down.splits, moe_workspace::ChooseKSplits(192, 16));
    EXPECT_EQ(down.splits, 4);
    EXPECT_EQ(up.partial_bytes, moe_workspace::AlignUp(size_t{4} * 3 * 4096 * 4));
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
