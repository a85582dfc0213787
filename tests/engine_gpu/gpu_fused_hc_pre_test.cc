// GpuModelOptions::fused_hc_pre (kernels/cuda/hyper_connection_fused.cuh) in the engine: with it,
// the fixture models' logits against the CPU engine under the bounds gpu_model_test.cc asserts
// for the unfused engine (issue 10's bf16 bound; fp32 GEMMs against the CPU emulating the GPU's
// storage), and the CUDA-graph decode against the eager one bit for bit. The fused pre-mix
// rounds the mixing weights differently from the unfused one (the normalization after the dot
// products, fp32 sums in another order: ~1e-6 relative, tests/kernels_cuda/
// hyper_connection_fused_test.cc), far inside those bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/gpu/gpu_model.h"
#include "engine/model.h"
#include "kernels/cuda/hyper_connection_fused.cuh"
#include "tests/engine_gpu/gpu_test_models.h"

namespace pdserve::engine::gpu {
namespace {

// PDSERVE_FUSED_HC_PRE=0 turns the option off for every model: nothing to test.
bool ForcedOffByEnvironment() {
  const char* env = std::getenv("PDSERVE_FUSED_HC_PRE");
  return env != nullptr && std::string(env) == "0";
}

std::unique_ptr<GpuModel> MakeFused(const TestModel& m, int64_t slots, int64_t max_chunk,
                                    GemmInputs inputs) {
  GpuModelOptions options;
  options.gemm_inputs = inputs;
  options.slots = slots;
  options.max_chunk = max_chunk;
  options.max_context = std::min<int64_t>(m.config.max_position_embeddings, 512);
  options.fused_hc_pre = true;
  auto gpu = GpuModel::Create(m.config, m.weights, options);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  return gpu.ok() ? std::move(*gpu) : nullptr;
}

class GpuFusedHcPreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    if (ForcedOffByEnvironment()) GTEST_SKIP() << "PDSERVE_FUSED_HC_PRE=0";
    LoadByName(GetParam(), &model_);
  }
  TestModel model_;
};

// The fixtures' shapes are ones the fused kernels take (else the engine would quietly keep the
// unfused path and the tests below would prove nothing about them), and the partials fit the
// unfused path's flat buffer, which the engine lends them. Needs no GPU.
TEST(GpuFusedHcPreShapesTest, FixtureShapesAreSupported) {
  for (const std::string& name : ModelNames()) {
    TestModel m;
    LoadByName(name, &m);
    const ModelConfig& c = m.config;
    EXPECT_TRUE(kernels::cuda::hyper_connection_pre_fused_supports(c.hc_mult, c.hidden_size,
                                                                   (2 + c.hc_mult) * c.hc_mult))
        << name;
    EXPECT_LE(kernels::cuda::hyper_connection_pre_fused_workspace(1, c.hc_mult, c.hidden_size),
              c.hc_mult * c.hidden_size)
        << name;
  }
}

TEST_P(GpuFusedHcPreTest, TheModelRunsFused) {
  auto gpu = MakeFused(model_, 2, 64, GemmInputs::kBf16);
  ASSERT_NE(gpu, nullptr);
  EXPECT_TRUE(gpu->fused_hc_pre());
}

// gpu_model_test.cc Bf16MatchesCpuOnTheFixtures' bound, over all fixtures' rows together as
// there: per model it does not hold for the unfused engine either (legacy_f32 alone, H200 runs
// of 2026-12-05: argmax agreement 0.968 and 6 of 126 rows over 2e-2, bf16 near-tie flips).
TEST(GpuFusedHcPreFixturesTest, Bf16MatchesCpuOnTheFixtures) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  if (ForcedOffByEnvironment()) GTEST_SKIP() << "PDSERVE_FUSED_HC_PRE=0";
  RowStats all;
  for (const std::string& name : ModelNames()) {
    TestModel m;
    LoadByName(name, &m);
    auto gpu = MakeFused(m, 5, 512, GemmInputs::kBf16);
    ASSERT_NE(gpu, nullptr);
    const RowStats stats = CompareOnPrompts(m, *m.cpu, *gpu);
    std::cout << name << ", fused hc pre, bf16 vs CPU fp32: " << stats.Summary(2e-2) << "\n";
    all.Merge(stats);
  }
  std::cout << "all fixtures, fused hc pre: " << all.Summary(2e-2) << "\n";
  EXPECT_GE(all.ArgmaxRate(), 0.99);
  EXPECT_LE(all.Over(2e-2), all.rows() / 50);
}

// gpu_model_test.cc Fp32GemmsMatchCpuWithGpuStoragePrecision's bound.
TEST_P(GpuFusedHcPreTest, Fp32GemmsMatchCpuWithGpuStoragePrecision) {
  ModelOptions options;
  options.EmulateGpuStorage();
  auto cpu = Model::FromWeights(model_.config, RoundedLikeGpu(model_.weights), options);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto gpu = MakeFused(model_, 5, 512, GemmInputs::kFp32);
  ASSERT_NE(gpu, nullptr);
  const RowStats stats = CompareOnPrompts(model_, *cpu, *gpu);
  std::cout << model_.name
            << ", fused hc pre, fp32 GEMMs vs CPU with bf16 storage: " << stats.Summary(5e-3)
            << "\n";
  EXPECT_GE(stats.ArgmaxRate(), 0.99);
  EXPECT_LE(stats.Over(5e-3), stats.rows() / 100);
  EXPECT_LE(stats.Worst(), 5e-2);
}

TEST_P(GpuFusedHcPreTest, GraphDecodeEqualsEagerBitForBit) {
  auto gpu = MakeFused(model_, 8, 64, GemmInputs::kBf16);
  ASSERT_NE(gpu, nullptr);
  ExpectGraphDecodeEqualsEager(*gpu, model_.prompts, /*steps=*/24);
}

INSTANTIATE_TEST_SUITE_P(Models, GpuFusedHcPreTest, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

}  // namespace
}  // namespace pdserve::engine::gpu
