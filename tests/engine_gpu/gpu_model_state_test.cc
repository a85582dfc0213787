// GpuModel::ExportState / ImportState (engine/gpu/gpu_model.h): a slot's state in the CPU
// engine's layout against the CPU engine's own state, an exported state imported into another
// slot continuing bit for bit, a CPU-engine state decoded on the GPU, and the refusals. Same
// models as gpu_model_test.cc; skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "engine/gpu/gpu_model.h"
#include "engine/model.h"
#include "engine/ring_state.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/state_compare.h"

namespace pdserve::engine::gpu {
namespace {

Tensor Row(const Tensor& logits, int64_t i) {
  Tensor row({1, logits.dim(1)});
  std::copy_n(logits.ptr() + i * logits.dim(1), logits.dim(1), row.ptr());
  return row;
}

class GpuModelStateTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    LoadByName(GetParam(), &model_);
  }
  // The CPU engine emulating the GPU's storage on the GPU's rounded weights.
  std::unique_ptr<Model> EmulatingCpu() {
    ModelOptions options;
    options.EmulateGpuStorage();
    auto cpu = Model::FromWeights(model_.config, RoundedLikeGpu(model_.weights), options);
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    return cpu.ok() ? std::make_unique<Model>(std::move(*cpu)) : nullptr;
  }
  TestModel model_;
};

// After a prefill (one call, and in chunks of 7) the exported state has the CPU engine's shapes
// exactly and its values within bf16 storage rounding: per tensor max|diff| / max|ref| <= 1e-2
// for 95% of the tensors and <= 0.25 for all (a misplaced row gives ~1 or more; a near-tie expert
// or indexer choice the two engines make apart moves a later layer's rows more than rounding). Fp32
// GEMMs, against the CPU emulating bf16 storage, so only rounding differs.
TEST_P(GpuModelStateTest, ExportAfterPrefillMatchesCpuWithBf16Storage) {
  auto cpu = EmulatingCpu();
  ASSERT_NE(cpu, nullptr);
  auto gpu = MakeGpu(model_, 2, 512, GemmInputs::kFp32);
  ASSERT_NE(gpu, nullptr);
  std::vector<double> rel;
  for (const auto& prompt : model_.prompts) {
    ModelState ref = cpu->NewState();
    ASSERT_TRUE(cpu->Forward(&ref, prompt).ok());
    ASSERT_TRUE(gpu->ResetSlot(0).ok());
    ASSERT_TRUE(gpu->Forward(0, prompt).ok());
    ASSERT_TRUE(gpu->ResetSlot(1).ok());
    for (size_t at = 0; at < prompt.size(); at += 7) {
      const size_t end = std::min(prompt.size(), at + 7);
      ASSERT_TRUE(gpu->Forward(1, std::vector<int32_t>(prompt.begin() + static_cast<long>(at),
                                                       prompt.begin() + static_cast<long>(end)))
                      .ok());
    }
    for (int64_t slot : {0, 1}) {
      auto exported = gpu->ExportState(slot);
      ASSERT_TRUE(exported.ok()) << exported.status();
      ASSERT_EQ(exported->position, ref.position);
      const auto got = Fields(*exported);
      const auto want = Fields(ref);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        const Tensor& g = *got[i].second;
        const Tensor& r = *want[i].second;
        ASSERT_EQ(g.shape, r.shape) << got[i].first << " at position " << ref.position;
        if (r.numel() == 0) continue;
        double max_ref = 0.0;
        double diff = 0.0;
        for (int64_t j = 0; j < r.numel(); ++j) {
          ASSERT_TRUE(std::isfinite(g.data[static_cast<size_t>(j)])) << got[i].first;
          max_ref =
              std::max(max_ref, std::abs(static_cast<double>(r.data[static_cast<size_t>(j)])));
          diff = std::max(diff, std::abs(static_cast<double>(g.data[static_cast<size_t>(j)]) -
                                         r.data[static_cast<size_t>(j)]));
        }
        rel.push_back(diff / std::max(max_ref, 1e-30));
        EXPECT_LE(rel.back(), 0.25) << got[i].first << " at position " << ref.position;
      }
    }
  }
  const auto within = std::count_if(rel.begin(), rel.end(), [](double r) { return r <= 1e-2; });
  std::cout << model_.name << ", exported state vs CPU with bf16 storage: " << rel.size()
            << " tensors, " << within << " within 1e-2, worst "
            << (rel.empty() ? 0.0 : *std::max_element(rel.begin(), rel.end())) << "\n";
  EXPECT_GE(static_cast<double>(within), 0.95 * static_cast<double>(rel.size()));
}

// Export from one slot, import into another that held a different request: the copy exports
// identically and both continue with identical logits bit for bit, in one decode batch (eager
// and graph) and as a prefill chunk.
TEST_P(GpuModelStateTest, ExportThenImportContinuesBitForBit) {
  auto gpu = MakeGpu(model_, 4, 512);
  ASSERT_NE(gpu, nullptr);
  const auto& prompt = model_.prompts.back();
  ASSERT_TRUE(gpu->Forward(2, prompt).ok());
  ASSERT_TRUE(gpu->Forward(0, model_.prompts.front()).ok());  // stale contents in the target
  auto state = gpu->ExportState(2);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_TRUE(gpu->ImportState(0, *state).ok());
  EXPECT_EQ(gpu->Position(0), static_cast<int64_t>(prompt.size()));
  auto again = gpu->ExportState(0);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(SameState(*state, *again));
  const int64_t vocab = model_.config.vocab_size;
  int32_t token = prompt.back();
  for (int step = 0; step < 12; ++step) {
    auto logits = gpu->DecodeStep({0, 2}, {token, token}, /*use_graph=*/step % 2 == 0);
    ASSERT_TRUE(logits.ok()) << logits.status();
    for (int64_t v = 0; v < vocab; ++v) ASSERT_TRUE(std::isfinite(logits->ptr()[v]));
    ASSERT_EQ(std::memcmp(logits->ptr(), logits->ptr() + vocab, vocab * sizeof(float)), 0)
        << "step " << step;
    token = static_cast<int32_t>(Argmax(logits->ptr(), vocab));
  }
  const std::vector<int32_t> chunk(prompt.begin(),
                                   prompt.begin() + std::min<size_t>(5, prompt.size()));
  auto a = gpu->Forward(0, chunk);
  auto b = gpu->Forward(2, chunk);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(std::memcmp(a->ptr(), b->ptr(), a->data.size() * sizeof(float)), 0);
}

// A state the CPU engine (bf16 storage) computed, imported into a slot and decoded there, gives
// the logits of the slot that ran the same prefill on the GPU within bf16 rounding, token by
// token over the rest of each prompt. Fp32 GEMMs.
TEST_P(GpuModelStateTest, ImportedCpuStateDecodesLikeTheGpuPrefill) {
  auto cpu = EmulatingCpu();
  ASSERT_NE(cpu, nullptr);
  auto gpu = MakeGpu(model_, 2, 512, GemmInputs::kFp32);
  ASSERT_NE(gpu, nullptr);
  RowStats imported_vs_gpu;
  RowStats imported_vs_cpu;
  for (const auto& prompt : model_.prompts) {
    if (prompt.size() < 2) continue;
    const auto half = static_cast<long>(prompt.size() / 2);
    const std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + half);
    const std::vector<int32_t> rest(prompt.begin() + half, prompt.end());
    ModelState state = cpu->NewState();
    ASSERT_TRUE(cpu->Forward(&state, prefix).ok());
    ASSERT_TRUE(gpu->ImportState(0, state).ok());
    ASSERT_TRUE(gpu->ResetSlot(1).ok());
    ASSERT_TRUE(gpu->Forward(1, prefix).ok());
    auto cpu_rest = cpu->Forward(&state, rest);
    ASSERT_TRUE(cpu_rest.ok());
    Tensor from_gpu({static_cast<int64_t>(rest.size()), model_.config.vocab_size});
    std::vector<Tensor> from_import;
    for (size_t i = 0; i < rest.size(); ++i) {
      auto logits = gpu->DecodeStep({0, 1}, {rest[i], rest[i]}, /*use_graph=*/true);
      ASSERT_TRUE(logits.ok()) << logits.status();
      from_import.push_back(Row(*logits, 0));
      std::copy_n(logits->ptr() + logits->dim(1), logits->dim(1),
                  from_gpu.ptr() + static_cast<int64_t>(i) * logits->dim(1));
    }
    for (size_t i = 0; i < rest.size(); ++i) {
      imported_vs_gpu.Add(from_import[i], from_gpu, static_cast<int64_t>(i));
      imported_vs_cpu.Add(from_import[i], *cpu_rest, static_cast<int64_t>(i));
    }
  }
  std::cout << model_.name
            << ", CPU state imported vs GPU prefill: " << imported_vs_gpu.Summary(5e-3) << "\n"
            << model_.name
            << ", CPU state imported vs CPU continuing: " << imported_vs_cpu.Summary(5e-3) << "\n";
  EXPECT_GT(imported_vs_gpu.rows(), 0);
  EXPECT_GE(imported_vs_gpu.ArgmaxRate(), 0.95);
  EXPECT_LE(imported_vs_gpu.Over(5e-3), std::max<int64_t>(1, imported_vs_gpu.rows() / 50));
  EXPECT_LE(imported_vs_gpu.Worst(), 5e-2);
}

TEST_P(GpuModelStateTest, BadSlotOrMismatchedStateIsInvalidArgument) {
  auto gpu = MakeGpu(model_, 2, 64);
  ASSERT_NE(gpu, nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportState(-1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportState(2).status()));
  const std::vector<int32_t> prompt(model_.prompts.back().begin(),
                                    model_.prompts.back().begin() + 9);
  ASSERT_TRUE(gpu->Forward(0, prompt).ok());
  ASSERT_TRUE(gpu->Forward(1, {prompt[0], prompt[1], prompt[2]}).ok());
  auto good = gpu->ExportState(0);
  ASSERT_TRUE(good.ok());
  auto before = gpu->ExportState(1);
  ASSERT_TRUE(before.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(2, *good)));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(-1, *good)));
  ModelState bad = *good;
  bad.layers.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(1, bad)));
  bad = *good;
  bad.position += 1;  // rows of 9 tokens claimed as 10
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(1, bad)));
  bad = *good;
  bad.layers[0].window_kv = Tensor({bad.layers[0].window_kv.dim(0), model_.config.head_dim + 1});
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(1, bad)));
  bad = *good;
  bad.position = gpu->max_context() + 1;
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(1, bad)));
  EXPECT_EQ(gpu->Position(1), 3);
  auto after = gpu->ExportState(1);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(SameState(*before, *after));
  // An empty state is a valid import: the slot starts over.
  ASSERT_TRUE(gpu->ImportState(1, model_.cpu->NewState()).ok());
  EXPECT_EQ(gpu->Position(1), 0);
}

INSTANTIATE_TEST_SUITE_P(Models, GpuModelStateTest, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

}  // namespace
}  // namespace pdserve::engine::gpu
