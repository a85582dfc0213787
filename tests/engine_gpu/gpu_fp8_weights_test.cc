// The GPU engine with FP8-resident weights (WeightFormat::kFp8Block) against the same weights
// dequantized, on the bundled model FP8-quantized by tools/make_real_format_checkpoint.py at test
// time (`--quantize-from models/kjv-v4-tiny`: the release layout, FP8 e4m3 projections with UE8M0
// 128 x 128 scales, FP4 experts; PDSERVE_FP8_CHECKPOINT names an already written one instead).
// Four engines on every prompt of the bundled model (prefill in one call, then chunked prefill +
// batched decode through the CUDA graphs): the GPU in FP8 (projections' stored bytes on the device;
// the FP4 experts converted to FP8 at load) twice, with bf16 activations (W8A16, the default:
// fp8_gemm_w8a16, moe_grouped_gemm kFp8W8A16) and with e4m3 ones (W8A8: fp8_gemm, moe_grouped_gemm
// kFp8), the GPU in bf16 (Weights::Load's dequantized values rounded to bf16) and the CPU engine
// in fp32 on the same dequantized values. Prints argmax agreement and max|diff| / max|ref| for
// each FP8 mode vs CPU and vs bf16, and bf16 vs CPU (the lead copies the figures into
// docs/engine-gpu.md).
//
// Tolerance. The weights are identical in the two GPU modes: an e4m3 value times a power-of-two
// scale is exact in bf16. What differs is the FP8 mode's activations, quantized per 1 x 128 to
// e4m3 (3 mantissa bits: relative rounding error <= 2^-4, RMS about 2^-4 / sqrt(3) = 3.6% per
// element, against bf16's 2^-9), and its GEMM outputs rounded to bf16. Independent per-element
// errors give a dot product an error of about 3.6% of its RMS; one layer's sublayer outputs add
// to a residual stream that carries the rest, so the logits move by a few percent of their range.
// Asserted: argmax agreement >= 95% and at least 95% of rows with max|diff| / max|ref| <= 0.1, for
// FP8 vs bf16 and FP8 vs CPU. A wrong layout or scale (weights read transposed, a scale block
// off by one) gives ~1 and near-random argmaxes, far outside. The criterion (FP8 vs bf16
// at least as close as bf16 vs CPU) is printed, not asserted: it holds only if FP8 activation
// noise stays below bf16's, which the arithmetic above does not promise. The CPU emulation of
// the FP8 arithmetic (tests/engine/fp8_emulation_agreement.cc) predicts ~98% argmax agreement
// with the CPU on this model for W8A8, 99.8% for W8A16: W8A16 is asserted at issue 25's 99%
// (its only differences from the bf16 GPU path are the bf16 rounding of the FP8 GEMMs' outputs
// and the fp32 summation order).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/gpu/gpu_model.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/quantized_checkpoint.h"

namespace pdserve::engine::gpu {
namespace {

struct Compared {
  RowStats w8a16_cpu, w8a8_cpu, bf16_cpu, w8a16_bf16, w8a8_bf16;
};

std::unique_ptr<GpuModel> Make(const ModelConfig& config, const Weights& weights,
                               WeightFormat format, const std::string& dir,
                               Fp8Activations activations = Fp8Activations::kBf16,
                               GemmInputs inputs = GemmInputs::kBf16) {
  GpuModelOptions options;
  options.fp8_activations = activations;
  options.gemm_inputs = inputs;
  options.slots = 5;
  options.max_chunk = 512;
  options.max_context = std::min<int64_t>(config.max_position_embeddings, 512);
  options.weight_format = format;
  options.checkpoint_dir = dir;
  auto gpu = GpuModel::Create(config, weights, options);
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  return gpu.ok() ? std::move(*gpu) : nullptr;
}

void Print(const char* what, const RowStats& s) {
  std::vector<double> sorted = s.rel;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted.empty() ? 0.0 : sorted[sorted.size() / 2];
  const double p95 = sorted.empty() ? 0.0 : sorted[sorted.size() * 95 / 100];
  std::cout << "fp8 weights, " << what << ": " << s.Summary(0.1) << ", median " << median
            << ", p95 " << p95 << "\n";
}

TEST(GpuFp8WeightsTest, Fp8ResidentMatchesDequantizedWeightsOnTheQuantizedBundledModel) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = QuantizedCheckpoint();
  ASSERT_FALSE(dir.empty()) << "python3 tools/make_real_format_checkpoint.py --quantize-from "
                               "models/kjv-v4-tiny failed (set PDSERVE_FP8_CHECKPOINT to one "
                               "written elsewhere)";
  TestModel prompts_of;
  LoadByName("kjv-v4-tiny", &prompts_of);
  const std::vector<std::vector<int32_t>>& prompts = prompts_of.prompts;

  Quantized q;
  ASSERT_NO_FATAL_FAILURE(LoadQuantized(dir, /*with_full=*/true, &q));
  const ModelConfig* config = &q.config;
  std::optional<Weights>& full = q.full;
  std::optional<Weights>& slim = q.slim;
  // The bundled model: 6 layers x 8 (q_a q_b kv o_a o_b, 3 shared) + 3 CSA x 6 + 2 HCA x 2
  // compressor projections, and 6 layers x 2 stacked FP4 expert tensors (FP8 on the GPU).
  const char* other = std::getenv("PDSERVE_FP8_CHECKPOINT");
  if (other == nullptr || *other == '\0') {
    EXPECT_EQ(slim->left_stored().size(), 6u * 8 + 3 * 6 + 2 * 2 + 6 * 2);
  }

  auto w8a16 = Make(*config, *slim, WeightFormat::kFp8Block, dir, Fp8Activations::kBf16);
  auto w8a8 = Make(*config, *slim, WeightFormat::kFp8Block, dir, Fp8Activations::kFp8);
  auto bf16 = Make(*config, *full, WeightFormat::kBf16, "");
  ASSERT_NE(w8a16, nullptr);
  ASSERT_NE(w8a8, nullptr);
  ASSERT_NE(bf16, nullptr);
  auto cpu = Model::FromWeights(*config, std::move(*full));
  ASSERT_TRUE(cpu.ok()) << cpu.status();

  std::vector<Tensor> refs;
  for (const auto& tokens : prompts) {
    ModelState state = cpu->NewState();
    auto ref = cpu->Forward(&state, tokens);
    ASSERT_TRUE(ref.ok()) << ref.status();
    refs.push_back(std::move(*ref));
  }
  const std::vector<Tensor> got_w8a16 = PromptLogitsTwoWays(*w8a16, prompts, /*use_graph=*/true);
  const std::vector<Tensor> got_w8a8 = PromptLogitsTwoWays(*w8a8, prompts, /*use_graph=*/true);
  const std::vector<Tensor> got_bf16 = PromptLogitsTwoWays(*bf16, prompts, /*use_graph=*/true);
  ASSERT_EQ(got_w8a16.size(), got_bf16.size());
  ASSERT_EQ(got_w8a8.size(), got_bf16.size());
  Compared c;
  bool modes_differ = false;
  for (size_t i = 0; i < got_bf16.size(); ++i) {
    if (got_w8a16[i].data.empty() || got_w8a8[i].data.empty() || got_bf16[i].data.empty()) {
      continue;  // failed, reported
    }
    const Tensor& ref = refs[i % refs.size()];
    c.w8a16_cpu.Add(got_w8a16[i], ref, 0);
    c.w8a8_cpu.Add(got_w8a8[i], ref, 0);
    c.bf16_cpu.Add(got_bf16[i], ref, 0);
    c.w8a16_bf16.Add(got_w8a16[i], got_bf16[i], 0);
    c.w8a8_bf16.Add(got_w8a8[i], got_bf16[i], 0);
    modes_differ = modes_differ || got_w8a16[i].data != got_w8a8[i].data;
  }
  Print("W8A16 (fp8_activations bf16) GPU vs CPU fp32", c.w8a16_cpu);
  Print("W8A8 (fp8_activations fp8) GPU vs CPU fp32", c.w8a8_cpu);
  Print("bf16 GPU vs CPU fp32", c.bf16_cpu);
  Print("W8A16 GPU vs bf16 GPU", c.w8a16_bf16);
  Print("W8A8 GPU vs bf16 GPU", c.w8a8_bf16);
  std::cout << "fp8 weights, W8A16-vs-bf16 argmax agreement "
            << (c.w8a16_bf16.ArgmaxRate() >= c.bf16_cpu.ArgmaxRate() ? ">=" : "<")
            << " bf16-vs-CPU's\n";
  EXPECT_TRUE(modes_differ) << "fp8_activations changed nothing";
  EXPECT_GE(c.bf16_cpu.ArgmaxRate(), 0.99);   // issue 10's bound, today's path
  EXPECT_GE(c.w8a16_cpu.ArgmaxRate(), 0.99);  // issue 25's bound
  EXPECT_GE(c.w8a16_bf16.ArgmaxRate(), 0.99);
  for (const RowStats* s : {&c.w8a16_cpu, &c.w8a16_bf16}) EXPECT_LE(s->Over(0.05), s->rows() / 50);
  for (const RowStats* s : {&c.w8a8_cpu, &c.w8a8_bf16}) {
    EXPECT_GE(s->ArgmaxRate(), 0.95);
    EXPECT_LE(s->Over(0.1), s->rows() / 20);
  }
}

// A bf16 checkpoint in the FP8 mode: nothing is stored FP8, so every projection is bf16 and the
// logits equal the bf16 mode's bit for bit (same kernels, same weights).
TEST(GpuFp8WeightsTest, Bf16CheckpointInFp8ModeIsTheBf16Path) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  TestModel m;
  LoadByName("kjv-v4-tiny", &m);
  const std::string dir = (SourceDir() / "models/kjv-v4-tiny").string();
  auto fp8 = Make(m.config, m.weights, WeightFormat::kFp8Block, dir);
  auto bf16 = Make(m.config, m.weights, WeightFormat::kBf16, "");
  ASSERT_NE(fp8, nullptr);
  ASSERT_NE(bf16, nullptr);
  const std::vector<std::vector<int32_t>> prompts(m.prompts.begin(), m.prompts.begin() + 2);
  const std::vector<Tensor> a = PromptLogitsTwoWays(*fp8, prompts, /*use_graph=*/true);
  const std::vector<Tensor> b = PromptLogitsTwoWays(*bf16, prompts, /*use_graph=*/true);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].data, b[i].data) << "prompt run " << i;
}

// WeightFormat::kBf16Dequantized on the quantized bundled model: the stored FP8 / FP4 tensors
// dequantized at load one tensor (expert) at a time, from weights that lack them, give kBf16's
// logits (from Weights::Load's float32 copy of every tensor) bit for bit: same values (the tool's
// UE8M0 group scales make the FP4 -> FP8 conversion exact), same kernels.
TEST(GpuFp8WeightsTest, Bf16DequantizedIsTheBf16PathWithoutTheHostCopy) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = QuantizedCheckpoint();
  ASSERT_FALSE(dir.empty()) << "tools/make_real_format_checkpoint.py failed";
  TestModel prompts_of;
  LoadByName("kjv-v4-tiny", &prompts_of);
  Quantized q;
  ASSERT_NO_FATAL_FAILURE(LoadQuantized(dir, /*with_full=*/true, &q));
  const ModelConfig* config = &q.config;
  std::optional<Weights>& full = q.full;
  std::optional<Weights>& slim = q.slim;
  ASSERT_FALSE(slim->left_stored().empty());
  auto dequantized = Make(*config, *slim, WeightFormat::kBf16Dequantized, dir);
  auto bf16 = Make(*config, *full, WeightFormat::kBf16, "");
  ASSERT_NE(dequantized, nullptr);
  ASSERT_NE(bf16, nullptr);
  const std::vector<std::vector<int32_t>> prompts(prompts_of.prompts.begin(),
                                                  prompts_of.prompts.begin() + 3);
  const std::vector<Tensor> a = PromptLogitsTwoWays(*dequantized, prompts, /*use_graph=*/true);
  const std::vector<Tensor> b = PromptLogitsTwoWays(*bf16, prompts, /*use_graph=*/true);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_FALSE(a[i].data.empty()) << "prompt run " << i;
    EXPECT_EQ(a[i].data, b[i].data) << "prompt run " << i;
  }
}

// Issue 25's comparison at a size the float32 host copy cannot load (PDSERVE_FP8_LARGE_CHECKPOINT:
// e.g. tools/make_real_format_checkpoint.py's 8-layer V4-Flash, 27 GB; skipped without it): the
// GPU with FP8-resident weights (W8A16, the default, and W8A8) against the same weights dequantized
// to bf16 (kBf16Dequantized) on the same GPU, one model on the device at a time, on the bundled
// model's prompts (the tool writes the bundled tokenizer's vocabulary). Random weights give flat
// logits, and 8 random layers amplify every rounding difference (on the 2-layer checkpoint W8A16
// vs bf16 agreed on 97.2% of argmaxes, on the 8-layer one 59.6% while the FP8 GEMMs rounded their
// outputs to bf16, 70.4% with fp32 outputs: H200, 2026-12-04), so the yardstick is measured in
// the same run: the bf16 weights with fp32 activations into the dense GEMMs. Asserted: W8A16 >=
// 30% (far above chance, 1 / 4096; a layout or scale error leaves ~0), and issue 25's criterion:
// W8A16 agrees with the bf16 path at least as well as the bf16 path with the yardstick.
// The printed lines ("fp8 weights, ...") are what tools/gpu/run_fp8_experts.sh tabulates.
TEST(GpuFp8WeightsTest, Fp8ResidentAgainstBf16DequantizedOnALargeCheckpoint) {
  if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
  const char* env = std::getenv("PDSERVE_FP8_LARGE_CHECKPOINT");
  if (env == nullptr || *env == '\0') GTEST_SKIP() << "PDSERVE_FP8_LARGE_CHECKPOINT not set";
  const std::string dir(env);
  TestModel prompts_of;  // the bundled model's prompt ids only (the fixture; no model needed)
  ASSERT_NO_FATAL_FAILURE(LoadTinyPrompts(&prompts_of));
  Quantized q;
  ASSERT_NO_FATAL_FAILURE(LoadQuantized(dir, /*with_full=*/false, &q));
  auto logits_of = [&](WeightFormat format, Fp8Activations activations, GemmInputs inputs) {
    auto gpu = Make(q.config, *q.slim, format, dir, activations, inputs);
    return gpu == nullptr ? std::vector<Tensor>()
                          : PromptLogitsTwoWays(*gpu, prompts_of.prompts, /*use_graph=*/true);
  };
  const std::vector<Tensor> w8a16 =
      logits_of(WeightFormat::kFp8Block, Fp8Activations::kBf16, GemmInputs::kBf16);
  const std::vector<Tensor> w8a8 =
      logits_of(WeightFormat::kFp8Block, Fp8Activations::kFp8, GemmInputs::kBf16);
  const std::vector<Tensor> bf16 =
      logits_of(WeightFormat::kBf16Dequantized, Fp8Activations::kBf16, GemmInputs::kBf16);
  // The same bf16 weight values with fp32 activations into the dense projections (GemmInputs::
  // kFp32; the experts and the state stay bf16): how far bf16 activations alone move these
  // layers' logits, the yardstick at a depth the CPU engine cannot load.
  const std::vector<Tensor> f32 =
      logits_of(WeightFormat::kBf16Dequantized, Fp8Activations::kBf16, GemmInputs::kFp32);
  ASSERT_FALSE(bf16.empty());
  ASSERT_EQ(w8a16.size(), bf16.size());
  ASSERT_EQ(w8a8.size(), bf16.size());
  ASSERT_EQ(f32.size(), bf16.size());
  RowStats a16, a8, b16, a16_f32;
  for (size_t i = 0; i < bf16.size(); ++i) {
    ASSERT_FALSE(w8a16[i].data.empty() || w8a8[i].data.empty() || bf16[i].data.empty() ||
                 f32[i].data.empty());
    a16.Add(w8a16[i], bf16[i], 0);
    a8.Add(w8a8[i], bf16[i], 0);
    b16.Add(bf16[i], f32[i], 0);
    a16_f32.Add(w8a16[i], f32[i], 0);
  }
  std::cout << "fp8 weights, large checkpoint: " << q.config.num_hidden_layers << " layers, "
            << q.config.n_routed_experts << " routed experts, hidden " << q.config.hidden_size
            << "\n";
  Print("large: W8A16 GPU vs bf16-dequantized GPU", a16);
  Print("large: W8A8 GPU vs bf16-dequantized GPU", a8);
  Print("large: bf16-dequantized GPU vs the same with fp32 dense GEMM inputs", b16);
  Print("large: W8A16 GPU vs bf16 weights with fp32 dense GEMM inputs", a16_f32);
  // Far above chance (1 / vocabulary) and above what a layout or scale error leaves (~0).
  // Measured 2026-12-04 16:12 UTC on the 8-layer V4-Flash: W8A16 vs bf16 70.4%, W8A8 17.3%, the
  // yardstick 66.2%.
  EXPECT_GE(a16.ArgmaxRate(), 0.3);
  EXPECT_GE(a16.ArgmaxRate(), b16.ArgmaxRate());
}

}  // namespace
}  // namespace pdserve::engine::gpu
