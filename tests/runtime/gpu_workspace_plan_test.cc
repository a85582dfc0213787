// engine/gpu_workspace_plan.h at V4-Flash shapes (tests/fixtures/v4_configs/flash), one GPU, with
// each figure computed here by hand from the allocating code's layout: the dense FP8 GEMMs'
// workspace, W8A8's shared act-quant rows, the grouped o_a's workspace, the decode attention's
// split partials and the GPU sampler's workspace; and the plan's lines and totals with them.
// tests/kernels_cuda/fp8_gemm_workspace_test.cc checks the shared headers against the kernels'
// own functions.
#include "engine/gpu_workspace_plan.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "engine/config.h"
#include "engine/memory_plan.h"
#include "gtest/gtest.h"
#include "kernels/cuda/fp8_gemm_workspace.h"

namespace pdserve::engine {
namespace {

std::string FlashDir() {
  return std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/v4_configs/flash";
}

int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }

ModelConfig Flash() {
  absl::StatusOr<ModelConfig> config = ModelConfig::Load(FlashDir());
  EXPECT_TRUE(config.ok()) << config.status();
  return config.ok() ? *config : ModelConfig{};
}

// AllocateSharedActQuant at 4096 rows: slot 0 [rows, max(hidden 4096, 8 groups x o_lora 1024)]
// e4m3 + one fp32 scale per 128; slot 1 the attention output in o_a's 8 column groups of 4096
// (each its own 256-aligned matrix), larger than q_a's 1024 or the SwiGLU's 2048 columns.
TEST(GpuWorkspacePlanTest, SharedActQuantRowsByHand) {
  const ModelConfig c = Flash();
  const int64_t r = 4096;
  const SharedActQuantBytes b = SharedActQuantBuffers(c, r);
  EXPECT_EQ(b.rows0, r * 8192);
  EXPECT_EQ(b.scales0, r * 8192 / 128);
  EXPECT_EQ(b.rows1, 8 * Align(r * 4096));
  EXPECT_EQ(b.scales1, 8 * Align(r * 32 * 4) / 4);
  EXPECT_EQ(b.bytes(), 173015040);  // 165 MiB
  EXPECT_EQ(ActQuantGroupBytes(3, 256, 128), 2 * 512);
  EXPECT_EQ(ActQuantGroupScales(3, 256, 128), 2 * 64);
}

// The grouped o_a (8 groups of [1024, 4096], moe_grouped_gemm's mma path below 8192 picks) at its
// largest call, 64 rows = 512 picks over 8 "experts": entry_pick 512 x 4, 8 + 512 / 32 work items
// of 12 bytes, the counts, and the partial sums of 4 k splits (16 row tiles x 8 experts = 128
// blocks, doubled until 512) [4, 512, 1024] fp32; W8A8 adds the quantized rows [512, 4096] e4m3
// and their scales.
TEST(GpuWorkspacePlanTest, GroupedOaWorkspaceByHand) {
  const ModelConfig c = Flash();
  const int64_t w8a16 = Align(512 * 4) + Align(24 * 12) + 256 + Align(int64_t{4} * 512 * 1024 * 4);
  EXPECT_EQ(w8a16, 8391424);
  EXPECT_EQ(OaGroupedWorkspaceBytes(c, 256, /*w8a16=*/true), w8a16);
  EXPECT_EQ(OaGroupedWorkspaceBytes(c, 8192, /*w8a16=*/true), w8a16);  // at most 64 rows grouped
  EXPECT_EQ(OaGroupedWorkspaceBytes(c, 256, /*w8a16=*/false),
            w8a16 + Align(512 * 4096) + Align(512 * 32 * 4));
}

// Decode attention: from 132 requests on (one block per request and 64 heads, 132
// multiprocessors) a request's KV list is not split, so the largest bucket, 256 slots, has the
// most partial rows: 256 x 64 of bf16 [512] plus fp32 maxima and sums. Smaller buckets split into
// at most 132 / batch parts: never more than 132 x 64 rows.
TEST(GpuWorkspacePlanTest, DecodeAttentionWorkspaceByHand) {
  const ModelConfig c = Flash();
  const int64_t rows = 256 * 64;
  EXPECT_EQ(DecodeAttentionWorkspaceBytes(c, 256, 65536),
            Align(rows * 512 * 2) + 2 * Align(rows * 4));
  EXPECT_EQ(DecodeAttentionWorkspaceBytes(c, 256, 65536), 16908288);
  const int64_t one = DecodeAttentionWorkspaceBytes(c, 1, 1048576);  // a prefill worker's slot
  EXPECT_GT(one, 0);
  EXPECT_LE(one, Align(132 * 64 * 512 * 2) + 2 * Align(132 * 64 * 4));
}

// The GPU sampler at 64 rows of the 129280-token vocabulary: double z, uint64 keys, int32 ids in
// and out per logit, int32 begins and ends and 24-byte row states per row, CUB's alternate keys
// and values (+ 255 bytes of alignment), and the 176-byte SampledRow outputs.
TEST(GpuWorkspacePlanTest, SamplerBytesByHand) {
  const ModelConfig c = Flash();
  const int64_t n = 64 * 129280;
  const int64_t cub = Align(n * 8) + Align(n * 4) + 255;
  const int64_t bytes = Align(n * 8) + Align(n * 8) + 2 * Align(n * 4) + 2 * Align(64 * 4) +
                        Align(64 * 24) + Align(cub) + 64 * 176;
  EXPECT_EQ(SamplerBytes(c, 64), bytes);
  EXPECT_EQ(SamplerBytes(c, 64), 297874688);  // 284 MiB
  EXPECT_EQ(SamplerBytes(c, 4097), 0);        // past the kernel's 4096 rows: no GPU sampler
}

// The dense FP8 GEMMs at 8192 rows (`prefill_chunk: 8192`): the largest call is cuBLASLt's over
// 8192 rows of o_b ([4096, 8 x 1024]): the rows e4m3 [8192, 8192], their scales [64, 8192] fp32
// (64 k blocks, a multiple of 4: no padded weight scales) and cuBLASLt's own 32 MiB. At 1 row
// (decode, mma.sync): the split-k partial sums.
TEST(GpuWorkspacePlanTest, DenseFp8WorkspaceByHand) {
  const ModelConfig c = Flash();
  const int64_t at_8192 =
      int64_t{8192} * 8192 + Align(int64_t{8192} * 64 * 4) + (int64_t{32} << 20);
  EXPECT_EQ(at_8192, 102760448);
  EXPECT_EQ(DenseFp8WorkspaceBytes(c, 8192, /*shared_act_quant=*/false), at_8192);
  EXPECT_EQ(DenseFp8WorkspaceBytes(c, 8192, /*shared_act_quant=*/true), at_8192);
  // The projections: q_b, the indexer's q_b, o_a per group, o_b, the shared expert's down, and
  // the attention-input and shared gate / up groups fused or apart.
  const auto fused = DenseFp8Projections(c, true);
  const auto apart = DenseFp8Projections(c, false);
  EXPECT_NE(std::find(fused.begin(), fused.end(), std::pair<int64_t, int64_t>{4096, 8192}),
            fused.end());  // o_b
  EXPECT_NE(std::find(apart.begin(), apart.end(), std::pair<int64_t, int64_t>{1024, 4096}),
            apart.end());  // o_a per group, q_a
  EXPECT_NE(std::find(fused.begin(), fused.end(), std::pair<int64_t, int64_t>{4096, 4096}),
            fused.end());  // the shared gate + up stacked
  // The cache and the monotone tail give the header's every-row loop.
  for (int64_t rows : {1, 100, 4096, 60000}) {
    size_t most = 0;
    for (const auto& shapes : {fused, apart}) {
      for (const auto& [n, k] : shapes) {
        most = std::max(most, kernels::cuda::fp8_workspace::ProjectionBytes(
                                  rows, n, k, false, "", kernels::cuda::kFp8WgmmaDecodeConfig));
      }
    }
    EXPECT_EQ(DenseFp8WorkspaceBytes(c, rows, false), static_cast<int64_t>(most)) << rows;
  }
}

// The plan's workspace lines and totals: a `weights: fp8` decode worker on the quantized V4-Flash
// fixture counts every part; a bf16 worker only attention and sampler; a prefill worker no
// sampler.
TEST(GpuWorkspacePlanTest, ThePlanCountsAndNamesTheWorkspaces) {
  const ModelConfig c = Flash();
  auto w = PlanWeightBytes(FlashDir(), c);
  ASSERT_TRUE(w.ok()) << w.status();
  PlanRequest q{.worker = "decode-0", .world = 1, .max_batch = 64, .max_context = 65536};
  GpuPlan bf16 = PlanGpu(c, w->experts_today, w->replicated_today, q);
  EXPECT_EQ(bf16.workspace.dense_fp8, 0);
  EXPECT_EQ(bf16.workspace.attention, DecodeAttentionWorkspaceBytes(c, 64, 65536));
  EXPECT_EQ(bf16.workspace.sampler, SamplerBytes(c, 64));
  q.fp8_weights = true;
  q.fp8_experts = true;
  q.fp8_activations = true;
  q.fp8_shared_act_quant = true;
  const GpuPlan fp8 = PlanGpu(c, w->experts_fp8, w->replicated_fp8, q);
  EXPECT_EQ(fp8.workspace.dense_fp8, DenseFp8WorkspaceBytes(c, 256, true));
  EXPECT_EQ(fp8.workspace.act_quant, SharedActQuantBuffers(c, 256).bytes());
  EXPECT_EQ(fp8.workspace.o_a_grouped, OaGroupedWorkspaceBytes(c, 256, false));
  EXPECT_EQ(fp8.total() - fp8.weights - fp8.state - fp8.activations - fp8.graphs - fp8.runtime -
                fp8.transfer - fp8.fp8_experts,
            fp8.workspace.total());
  const std::string text = FormatPlan(c, *w, q);
  for (const char* line :
       {"workspace: dense FP8 GEMMs", "workspace: W8A8 shared act quant", "workspace: grouped o_a",
        "workspace: decode attention", "workspace: GPU sampler"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
  q.prefill = true;
  EXPECT_EQ(PlanGpu(c, w->experts_fp8, w->replicated_fp8, q).workspace.sampler, 0);
  // docs/memory-plan.md's figures: the table's settings (decode 64 x 65536, prefill one 1M slot;
  // 256 rows) on one GPU, W8A16 (the default) and W8A8 with the shared act quant.
  std::printf(
      "V4-Flash, 1 GPU, 256 rows: dense FP8 %lld (W8A16) / %lld (W8A8 + shared act quant), act "
      "quant %lld, grouped o_a %lld / %lld; decode 64 x 65536: attention %lld, sampler %lld; "
      "prefill 1 x 1048576: attention %lld bytes\n",
      static_cast<long long>(DenseFp8WorkspaceBytes(c, 256, false)),
      static_cast<long long>(fp8.workspace.dense_fp8),
      static_cast<long long>(fp8.workspace.act_quant),
      static_cast<long long>(OaGroupedWorkspaceBytes(c, 256, true)),
      static_cast<long long>(fp8.workspace.o_a_grouped),
      static_cast<long long>(fp8.workspace.attention),
      static_cast<long long>(fp8.workspace.sampler),
      static_cast<long long>(DecodeAttentionWorkspaceBytes(c, 1, 1048576)));
}

}  // namespace
}  // namespace pdserve::engine
