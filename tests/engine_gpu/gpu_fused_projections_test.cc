// GpuModelOptions::fused_projections (engine/fused_projections.h) against the unfused engine on
// the same weights: the transformers fixture models and the bundled model in bf16, and the
// bundled model FP8-quantized by tools/make_real_format_checkpoint.py in W8A16 and W8A8 (prefill
// in one call, chunked prefill and batched graph decode: PromptLogitsTwoWays), and the fused
// model's CUDA-graph decode against its eager decode.
//
// Tolerance. Fused and unfused compute the same products of the same weights and inputs: the
// stacked weight holds each part's bytes (FP8: its scales too) unchanged, the consumers read the
// same values at another row stride, and the glue kernels (strided cast, strided scale, the
// compressor's source stride) do the same per-element arithmetic. What may differ is the order
// of the fp32 sums inside a GEMM: cuBLAS and fp8_gemm pick their tiling and split over k from the
// shape, and N grows from one part's to the group's; FP8 o_a sums in moe_grouped_gemm instead of
// fp8_gemm. That is the class of difference the expert-parallel test admits for its reordered
// sums (gpu_expert_parallel_test.cc: argmax agreement 100%, max|diff| / max|ref| <= 1e-2), and
// the bound asserted here (W8A8 excepted: see its test). The number of rows equal bit for bit is
// printed (where the kernels happen to keep the order, all of them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/gpu/gpu_model.h"
#include "engine/weights.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/quantized_checkpoint.h"

namespace pdserve::engine::gpu {
namespace {

// PDSERVE_FUSED_PROJECTIONS=1 (or 0) fuses every model (or none): nothing to compare.
bool FusionForcedByEnvironment() {
  const char* env = std::getenv("PDSERVE_FUSED_PROJECTIONS");
  return env != nullptr && (std::string(env) == "1" || std::string(env) == "0");
}

struct Precision {
  WeightFormat format = WeightFormat::kBf16;
  Fp8Activations activations = Fp8Activations::kBf16;
  std::string dir;  // the checkpoint (kFp8Block)
};

std::unique_ptr<GpuModel> Make(const ModelConfig& config, const Weights& weights,
                               const Precision& s, bool fused, int64_t slots = 5) {
  GpuModelOptions options;
  options.slots = slots;
  options.max_chunk = 512;
  options.max_context = std::min<int64_t>(config.max_position_embeddings, 512);
  options.weight_format = s.format;
  options.fp8_activations = s.activations;
  options.checkpoint_dir = s.dir;
  options.fused_projections = fused;
  auto gpu = GpuModel::Create(config, weights, options);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  return gpu.ok() ? std::move(*gpu) : nullptr;
}

// Every prompt run's logits of `gpu` (PromptLogitsTwoWays, graph decode).
std::vector<Tensor> Logits(GpuModel& gpu, const std::vector<std::vector<int32_t>>& prompts) {
  return PromptLogitsTwoWays(gpu, prompts, /*use_graph=*/true);
}

// `got` against `want`, row by row; `identical` counts the rows equal bit for bit.
RowStats Compare(const std::vector<Tensor>& got, const std::vector<Tensor>& want, int64_t vocab,
                 int64_t* identical) {
  RowStats stats;
  EXPECT_EQ(got.size(), want.size());
  *identical = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    EXPECT_FALSE(got[i].data.empty() || want[i].data.empty()) << "prompt run " << i;
    if (got[i].data.size() != want[i].data.size()) {
      ADD_FAILURE() << "prompt run " << i << ": sizes differ";
      continue;
    }
    stats.Add(got[i], want[i], 0);
    for (int64_t r = 0; r < got[i].dim(0); ++r) {
      *identical += std::memcmp(got[i].ptr() + r * vocab, want[i].ptr() + r * vocab,
                                static_cast<size_t>(vocab) * sizeof(float)) == 0;
    }
  }
  return stats;
}

void Print(const std::string& what, const RowStats& stats, int64_t identical) {
  std::cout << "fused projections, " << what << ": " << stats.Summary(1e-2) << ", rows equal bit "
            << "for bit: " << identical << " of " << stats.rows() << "\n";
}

// Fused against unfused on `prompts`, with the bound above; prints `what`'s figures.
void ExpectFusedMatchesUnfused(const std::string& what, const ModelConfig& config,
                               const Weights& weights, const Precision& s,
                               const std::vector<std::vector<int32_t>>& prompts) {
  auto unfused = Make(config, weights, s, /*fused=*/false);
  auto fused = Make(config, weights, s, /*fused=*/true);
  ASSERT_NE(unfused, nullptr);
  ASSERT_NE(fused, nullptr);
  int64_t identical = 0;
  const RowStats stats =
      Compare(Logits(*fused, prompts), Logits(*unfused, prompts), config.vocab_size, &identical);
  Print(what, stats, identical);
  EXPECT_GT(stats.rows(), 0);
  EXPECT_EQ(stats.ArgmaxRate(), 1.0) << what;
  EXPECT_LE(stats.Worst(), 1e-2) << what;
}

// The fused model's graph decode against its eager decode, bit for bit.
void ExpectFusedGraphEqualsEager(const ModelConfig& config, const Weights& weights,
                                 const Precision& s,
                                 const std::vector<std::vector<int32_t>>& prompts) {
  auto gpu = Make(config, weights, s, /*fused=*/true, /*slots=*/8);
  ASSERT_NE(gpu, nullptr);
  ExpectGraphDecodeEqualsEager(*gpu, prompts, /*steps=*/16);
}

class GpuFusedProjectionsBf16Test : public ::testing::TestWithParam<std::string> {};

TEST_P(GpuFusedProjectionsBf16Test, FusedMatchesUnfused) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  if (FusionForcedByEnvironment()) GTEST_SKIP() << "PDSERVE_FUSED_PROJECTIONS set";
  TestModel m;
  LoadByName(GetParam(), &m);
  ExpectFusedMatchesUnfused(GetParam() + " bf16", m.config, m.weights, Precision{}, m.prompts);
}

TEST_P(GpuFusedProjectionsBf16Test, FusedGraphDecodeEqualsEager) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  TestModel m;
  LoadByName(GetParam(), &m);
  ExpectFusedGraphEqualsEager(m.config, m.weights, Precision{}, m.prompts);
}

INSTANTIATE_TEST_SUITE_P(Models, GpuFusedProjectionsBf16Test, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

// The bundled model FP8-quantized: W8A16 (bf16 activations) and W8A8 (e4m3 activations).
class GpuFusedProjectionsFp8Test : public ::testing::TestWithParam<Fp8Activations> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    precision_.dir = QuantizedCheckpoint();
    ASSERT_FALSE(precision_.dir.empty()) << "tools/make_real_format_checkpoint.py failed";
    precision_.format = WeightFormat::kFp8Block;
    precision_.activations = GetParam();
    ASSERT_NO_FATAL_FAILURE(LoadQuantized(precision_.dir, /*with_full=*/false, &q_));
    ASSERT_NO_FATAL_FAILURE(LoadTinyPrompts(&prompts_));
  }
  std::string Name() const {
    return GetParam() == Fp8Activations::kBf16 ? "kjv-v4-tiny FP8 W8A16" : "kjv-v4-tiny FP8 W8A8";
  }
  Precision precision_;
  Quantized q_;
  TestModel prompts_;
};

TEST_P(GpuFusedProjectionsFp8Test, FusedMatchesUnfused) {
  if (FusionForcedByEnvironment()) GTEST_SKIP() << "PDSERVE_FUSED_PROJECTIONS set";
  if (GetParam() == Fp8Activations::kBf16) {
    ExpectFusedMatchesUnfused(Name(), q_.config, *q_.slim, precision_, prompts_.prompts);
    return;
  }
  // W8A8 rounds every GEMM input to e4m3 (3 mantissa bits): a one-ulp difference in a bf16 value
  // that sits near a rounding boundary of e4m3 moves that input by up to 1/16, and later layers
  // carry it on. A reordered fp32 sum (above) can make such a difference, so fused and unfused
  // W8A8 are not held to each other at 1e-2. Each is held to the same reference instead, the
  // unfused W8A16 model on the same FP8 weights (the activations the only difference), and the
  // fused one must agree with it as well as the unfused one does (issue 25's measure: argmax
  // agreement and max|diff|/max|ref|).
  Precision w8a16 = precision_;
  w8a16.activations = Fp8Activations::kBf16;
  auto reference_model = Make(q_.config, *q_.slim, w8a16, /*fused=*/false);
  auto unfused = Make(q_.config, *q_.slim, precision_, /*fused=*/false);
  auto fused = Make(q_.config, *q_.slim, precision_, /*fused=*/true);
  ASSERT_TRUE(reference_model != nullptr && unfused != nullptr && fused != nullptr);
  const int64_t vocab = q_.config.vocab_size;
  const std::vector<Tensor> reference = Logits(*reference_model, prompts_.prompts);
  const std::vector<Tensor> unfused_logits = Logits(*unfused, prompts_.prompts);
  const std::vector<Tensor> fused_logits = Logits(*fused, prompts_.prompts);
  int64_t identical = 0;
  const RowStats direct = Compare(fused_logits, unfused_logits, vocab, &identical);
  Print(Name() + ", fused against unfused", direct, identical);
  const RowStats unfused_to_ref = Compare(unfused_logits, reference, vocab, &identical);
  Print(Name() + ", unfused against unfused W8A16", unfused_to_ref, identical);
  const RowStats fused_to_ref = Compare(fused_logits, reference, vocab, &identical);
  Print(Name() + ", fused against unfused W8A16", fused_to_ref, identical);
  {
    // Which fusion makes the difference: o_a's groups as separate calls (diagnostic only).
    setenv("PDSERVE_FUSED_O_A", "0", 1);
    auto fused_no_o_a = Make(q_.config, *q_.slim, precision_, /*fused=*/true);
    unsetenv("PDSERVE_FUSED_O_A");
    ASSERT_NE(fused_no_o_a, nullptr);
    const RowStats no_o_a =
        Compare(Logits(*fused_no_o_a, prompts_.prompts), unfused_logits, vocab, &identical);
    Print(Name() + ", fused with o_a unfused, against unfused", no_o_a, identical);
  }
  ASSERT_GT(fused_to_ref.rows(), 0);
  EXPECT_GE(fused_to_ref.ArgmaxRate(), unfused_to_ref.ArgmaxRate() - 0.01);
  EXPECT_LE(fused_to_ref.Worst(), 2.0 * unfused_to_ref.Worst() + 1e-3);
  EXPECT_GE(direct.ArgmaxRate(), 0.98);
}

TEST_P(GpuFusedProjectionsFp8Test, FusedGraphDecodeEqualsEager) {
  ExpectFusedGraphEqualsEager(q_.config, *q_.slim, precision_, prompts_.prompts);
}

std::string ActivationsName(const ::testing::TestParamInfo<Fp8Activations>& p) {
  return p.param == Fp8Activations::kBf16 ? "W8A16" : "W8A8";
}

INSTANTIATE_TEST_SUITE_P(Activations, GpuFusedProjectionsFp8Test,
                         ::testing::Values(Fp8Activations::kBf16, Fp8Activations::kFp8),
                         ActivationsName);

}  // namespace
}  // namespace pdserve::engine::gpu
