// GpuModelOptions::fp8_shared_act_quant against the same W8A8 engine without it, on the bundled
// model FP8-quantized by tools/make_real_format_checkpoint.py (as gpu_fp8_weights_test.cc):
// prefill in one call, chunked prefill and batched graph decode (PromptLogitsTwoWays), with the
// projections fused and unfused. Where the option applies (rows >= kFp8LtMinTokens, n a multiple
// of 128: the long held-out prompt's prefill) the cast or SwiGLU kernel writes the e4m3 rows and
// scales that fp8_gemm's cuBLASLt path would quantize itself, and fp8_gemm_quantized multiplies
// them; elsewhere nothing changes. So every logit must be equal bit for bit. Compiled, not yet run
// on a GPU (2026-12-04).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu_workspace_plan.h"
#include "engine/weights.h"
#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/quantized_checkpoint.h"

namespace pdserve::engine::gpu {
namespace {

// The buffers' group layout the engine and the memory plan size them with
// (engine/gpu_workspace_plan.h) is act_quant's (ActGroupBytes / ActGroupScales). Host arithmetic:
// runs without a device.
TEST(GpuSharedActQuantTest, GroupBytesAreActQuantsLayout) {
  for (int64_t rows : {1, 3, 64, 255, 4096}) {
    for (int64_t cols : {128, 512, 4096}) {
      for (int64_t groups : {1, 2, 8}) {
        EXPECT_EQ(ActQuantGroupBytes(rows, groups * cols, cols),
                  groups * kernels::cuda::ActGroupBytes(rows, cols));
        EXPECT_EQ(ActQuantGroupScales(rows, groups * cols, cols),
                  groups * kernels::cuda::ActGroupScales(rows, cols));
      }
    }
  }
}

std::unique_ptr<GpuModel> Make(const ModelConfig& config, const Weights& weights,
                               const std::string& dir, bool fused, bool shared_act_quant) {
  GpuModelOptions options;
  options.slots = 5;
  options.max_chunk = 512;
  options.max_context = std::min<int64_t>(config.max_position_embeddings, 512);
  options.weight_format = WeightFormat::kFp8Block;
  options.fp8_activations = Fp8Activations::kFp8;
  options.checkpoint_dir = dir;
  options.fused_projections = fused;
  options.fp8_shared_act_quant = shared_act_quant;
  auto gpu = GpuModel::Create(config, weights, options);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  return gpu.ok() ? std::move(*gpu) : nullptr;
}

class GpuSharedActQuantTest : public ::testing::TestWithParam<bool> {};

TEST_P(GpuSharedActQuantTest, LogitsEqualPerCallActQuantBitForBit) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const char* forced = std::getenv("PDSERVE_FP8_SHARED_ACT_QUANT");
  if (forced != nullptr && *forced != '\0') {
    GTEST_SKIP() << "PDSERVE_FP8_SHARED_ACT_QUANT set: both models alike";
  }
  const std::string dir = QuantizedCheckpoint();
  ASSERT_FALSE(dir.empty()) << "tools/make_real_format_checkpoint.py failed";
  Quantized q;
  ASSERT_NO_FATAL_FAILURE(LoadQuantized(dir, /*with_full=*/false, &q));
  TestModel prompts;
  ASSERT_NO_FATAL_FAILURE(LoadTinyPrompts(&prompts));
  // The option must have rows to act on: a prompt prefilled at cuBLASLt sizes.
  size_t longest = 0;
  for (const auto& p : prompts.prompts) longest = std::max(longest, p.size());
  ASSERT_GE(static_cast<int64_t>(longest), kernels::cuda::kFp8LtMinTokens);

  auto plain = Make(q.config, *q.slim, dir, GetParam(), /*shared_act_quant=*/false);
  auto shared = Make(q.config, *q.slim, dir, GetParam(), /*shared_act_quant=*/true);
  ASSERT_TRUE(plain != nullptr && shared != nullptr);
  const std::vector<Tensor> want = PromptLogitsTwoWays(*plain, prompts.prompts, true);
  const std::vector<Tensor> got = PromptLogitsTwoWays(*shared, prompts.prompts, true);
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(got.empty());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(got[i].data.empty() || want[i].data.empty()) << "prompt run " << i;
    ASSERT_EQ(got[i].data.size(), want[i].data.size()) << "prompt run " << i;
    for (size_t e = 0; e < got[i].data.size(); ++e) {
      ASSERT_EQ(std::memcmp(&got[i].data[e], &want[i].data[e], sizeof(float)), 0)
          << "prompt run " << i << ", logit " << e << ": " << got[i].data[e] << " vs "
          << want[i].data[e];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Projections, GpuSharedActQuantTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "Fused" : "Unfused";
                         });

}  // namespace
}  // namespace pdserve::engine::gpu
