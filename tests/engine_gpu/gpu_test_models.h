// Shared by the CUDA engine's tests (tests/engine_gpu): the models they run (the transformers
// fixture models and the bundled model, found under PDSERVE_SOURCE_DIR or the source tree this
// binary was built from), the GPU probe, the CPU-side rounding that matches the GPU's weights and
// the per-row logits comparison.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "engine/gpu/gpu_model.h"
#include "engine/model.h"
#include "engine/quant.h"
#include "engine/weights.h"
#include "nlohmann/json.hpp"
#include "tests/engine/rounded_weights.h"

namespace pdserve::engine::gpu {

inline std::filesystem::path SourceDir() {
  const char* env = std::getenv("PDSERVE_SOURCE_DIR");
  return (env != nullptr && *env != '\0') ? std::filesystem::path(env)
                                          : std::filesystem::path(PDSERVE_SOURCE_DIR_DEFAULT);
}

inline nlohmann::json ReadJson(const std::filesystem::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

struct TestModel {
  std::string name;
  ModelConfig config;
  Weights weights;
  std::unique_ptr<Model> cpu;
  std::vector<std::vector<int32_t>> prompts;
};

// Loads a model directory twice: once for the CPU engine, once as the weights the GPU uploads.
inline void Load(const std::filesystem::path& dir, TestModel* m) {
  auto config = ModelConfig::Load(dir.string());
  ASSERT_TRUE(config.ok()) << config.status();
  m->config = *config;
  auto weights = Weights::Load(dir.string(), m->config);
  ASSERT_TRUE(weights.ok()) << weights.status();
  m->weights = std::move(*weights);
  auto cpu = Model::Load(dir.string());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  m->cpu = std::make_unique<Model>(std::move(*cpu));
}

inline std::vector<std::string> ModelNames() {
  return {"mixed_yarn_f32", "csa_sigmoid_bf16", "legacy_f32", "kjv-v4-tiny"};
}

// A model name as a test name ("kjv-v4-tiny" -> "kjv_v4_tiny").
inline std::string ModelTestName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// The bundled model's fixture prompts (token ids; tests/fixtures/small_model), then a long held-out
// stretch: past the sliding window (64), many HCA (32) and CSA (4) entries. Reads no weights, so
// a test of another model of the same tokenizer (kjv-v4-wide) needs only the fixtures.
inline void LoadTinyPrompts(TestModel* m) {
  const nlohmann::json j = ReadJson(SourceDir() / "tests/fixtures/small_model/logits.json");
  for (const auto& p : j["prompts"]) m->prompts.push_back(p["ids"].get<std::vector<int32_t>>());
  std::ifstream in(SourceDir() / "tests/fixtures/small_model/heldout_slice_ids.bin",
                   std::ios::binary);
  std::vector<uint32_t> raw(300);
  in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 4));
  ASSERT_TRUE(in) << "tests/fixtures/small_model/heldout_slice_ids.bin";
  m->prompts.emplace_back(raw.begin(), raw.end());
}

inline void LoadByName(const std::string& name, TestModel* m) {
  m->name = name;
  if (name == "kjv-v4-tiny") {
    Load(SourceDir() / "models" / name, m);
    LoadTinyPrompts(m);
    return;
  }
  const std::filesystem::path dir = SourceDir() / "tests/fixtures/engine" / name;
  Load(dir / "model", m);
  const nlohmann::json j = ReadJson(dir / "cases.json");
  for (const auto& c : j["cases"]) m->prompts.push_back(c["tokens"].get<std::vector<int32_t>>());
}

inline std::unique_ptr<GpuModel> MakeGpu(const TestModel& m, int64_t slots, int64_t max_chunk,
                                         GemmInputs inputs = GemmInputs::kBf16) {
  GpuModelOptions options;
  options.gemm_inputs = inputs;
  options.slots = slots;
  options.max_chunk = max_chunk;
  options.max_context = std::min<int64_t>(m.config.max_position_embeddings, 512);
  auto gpu = GpuModel::Create(m.config, m.weights, options);
  if (!gpu.ok()) {
    if (absl::IsFailedPrecondition(gpu.status())) return nullptr;
    ADD_FAILURE() << gpu.status();
    return nullptr;
  }
  return std::move(*gpu);
}

// Prefills `slot` (reset first) with the first `n` tokens of m's longest prompt (repeated to
// length), in chunks of 13.
inline void PrefillSlot(const TestModel& m, GpuModel& gpu, int64_t slot, int64_t n) {
  ASSERT_TRUE(gpu.ResetSlot(slot).ok());
  const std::vector<int32_t>& text = m.prompts.back();
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < n; ++i) tokens.push_back(text[static_cast<size_t>(i) % text.size()]);
  for (int64_t at = 0; at < n; at += 13) {
    const int64_t end = std::min(n, at + 13);
    ASSERT_TRUE(
        gpu.Forward(slot, std::vector<int32_t>(tokens.begin() + at, tokens.begin() + end)).ok());
  }
}

inline bool HasGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

inline int64_t Argmax(const float* row, int64_t n) { return std::max_element(row, row + n) - row; }

// The CPU engine emulating the GPU's precision: bf16 storage and the GPU's bf16-rounded weights
// (the reference the runner and prefill tests compare tokens with). Null, with a failure, on error.
inline std::unique_ptr<Model> CpuLikeGpu(const TestModel& m) {
  ModelOptions options;
  options.EmulateGpuStorage();
  auto cpu = Model::FromWeights(m.config, RoundedLikeGpu(m.weights), options);
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  return cpu.ok() ? std::make_unique<Model>(std::move(*cpu)) : nullptr;
}

// GPU rows against reference rows, one figure per row: max_v |gpu - ref| / max |ref| over the
// row's whole prompt (issue 10's max|diff| / max|ref|), and whether the argmax agrees.
struct RowStats {
  std::vector<double> rel;
  int64_t argmax_equal = 0;

  // gpu [n, vocab] against rows [first, first + n) of ref [prompt length, vocab].
  void Add(const Tensor& gpu, const Tensor& ref, int64_t first) {
    const int64_t vocab = ref.dim(1);
    double max_ref = 0.0;
    for (float v : ref.data) max_ref = std::max(max_ref, std::abs(static_cast<double>(v)));
    for (int64_t i = 0; i < gpu.dim(0); ++i) {
      const float* g = gpu.ptr() + i * vocab;
      const float* r = ref.ptr() + (first + i) * vocab;
      double d = 0.0;
      for (int64_t v = 0; v < vocab; ++v) {
        ASSERT_TRUE(std::isfinite(g[v])) << "row " << first + i << " logit " << v;
        d = std::max(d, std::abs(static_cast<double>(g[v]) - r[v]));
      }
      rel.push_back(d / std::max(max_ref, 1e-30));
      argmax_equal += Argmax(g, vocab) == Argmax(r, vocab);
    }
  }
  void Merge(const RowStats& o) {
    rel.insert(rel.end(), o.rel.begin(), o.rel.end());
    argmax_equal += o.argmax_equal;
  }
  int64_t rows() const { return static_cast<int64_t>(rel.size()); }
  double ArgmaxRate() const {
    return static_cast<double>(argmax_equal) / std::max<int64_t>(rows(), 1);
  }
  double Worst() const { return rel.empty() ? 0.0 : *std::max_element(rel.begin(), rel.end()); }
  int64_t Over(double bound) const {
    return std::count_if(rel.begin(), rel.end(), [&](double r) { return r > bound; });
  }
  std::string Summary(double bound) const {
    return std::to_string(rows()) + " rows, argmax agreement " + std::to_string(ArgmaxRate()) +
           ", worst max|diff|/max|ref| " + std::to_string(Worst()) + ", rows over " +
           std::to_string(bound) + ": " + std::to_string(Over(bound));
  }
};

// Two copies of three requests (slots 0-2 and 3-5, the prompts' first 40 tokens): one decoded
// eagerly, one through the captured graph of the same bucket (3 -> 4 rows), `steps` steps. Every
// step's logits must be identical bit for bit. REQUIRES gpu.slots() >= 6.
inline void ExpectGraphDecodeEqualsEager(GpuModel& gpu,
                                         const std::vector<std::vector<int32_t>>& prompts,
                                         int steps) {
  const int64_t vocab = gpu.config().vocab_size;
  std::vector<int32_t> last(3);
  for (int64_t s = 0; s < 3; ++s) {
    const auto& prompt = prompts[static_cast<size_t>(s) % prompts.size()];
    const std::vector<int32_t> tokens(prompt.begin(),
                                      prompt.begin() + std::min<size_t>(prompt.size(), 40));
    auto a = gpu.Forward(s, tokens);
    auto b = gpu.Forward(s + 3, tokens);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(std::memcmp(a->ptr(), b->ptr(), a->data.size() * sizeof(float)), 0);
    last[static_cast<size_t>(s)] =
        static_cast<int32_t>(Argmax(a->ptr() + (a->dim(0) - 1) * vocab, vocab));
  }
  for (int step = 0; step < steps; ++step) {
    auto eager = gpu.DecodeStep({0, 1, 2}, last, /*use_graph=*/false);
    auto graph = gpu.DecodeStep({3, 4, 5}, last, /*use_graph=*/true);
    ASSERT_TRUE(eager.ok()) << eager.status();
    ASSERT_TRUE(graph.ok()) << graph.status();
    ASSERT_EQ(std::memcmp(eager->ptr(), graph->ptr(), eager->data.size() * sizeof(float)), 0)
        << "step " << step;
    for (int64_t s = 0; s < 3; ++s) {
      last[static_cast<size_t>(s)] = static_cast<int32_t>(Argmax(eager->ptr() + s * vocab, vocab));
    }
  }
}

// Logits of `gpu` on every prompt in two ways: whole-prompt prefill in one call (slot 0), then, for
// the first slots - 1 prompts at once in slots 1.., chunked prefill of the first half in chunks of
// 7 followed by the rest as batched decode steps (the buckets' CUDA graphs when use_graph). Returns
// one [prompt length, vocab] tensor per prompt for the first way, then one per prompt of the
// second, in prompt order.
inline std::vector<Tensor> PromptLogitsTwoWays(GpuModel& gpu,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               bool use_graph) {
  std::vector<Tensor> whole, split;
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(prompts.size()), gpu.slots() - 1);
  for (const auto& tokens : prompts) {
    EXPECT_TRUE(gpu.ResetSlot(0).ok());
    auto logits = gpu.Forward(0, tokens);
    EXPECT_TRUE(logits.ok()) << logits.status();
    whole.push_back(logits.ok() ? std::move(*logits) : Tensor());
  }
  std::vector<int64_t> next(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) {
    const auto& tokens = prompts[static_cast<size_t>(s)];
    split.emplace_back(
        std::vector<int64_t>{static_cast<int64_t>(tokens.size()), gpu.config().vocab_size});
    EXPECT_TRUE(gpu.ResetSlot(s + 1).ok());
    const int64_t half = std::max<int64_t>(1, static_cast<int64_t>(tokens.size()) / 2);
    for (int64_t at = 0; at < half; at += 7) {
      const int64_t end = std::min(half, at + 7);
      auto logits =
          gpu.Forward(s + 1, std::vector<int32_t>(tokens.begin() + at, tokens.begin() + end));
      EXPECT_TRUE(logits.ok()) << logits.status();
      if (logits.ok())
        std::copy(logits->data.begin(), logits->data.end(),
                  split.back().ptr() + at * gpu.config().vocab_size);
    }
    next[static_cast<size_t>(s)] = half;
  }
  for (;;) {
    std::vector<int64_t> slots;
    std::vector<int32_t> step;
    for (int64_t s = 0; s < n; ++s) {
      const auto& tokens = prompts[static_cast<size_t>(s)];
      if (next[static_cast<size_t>(s)] < static_cast<int64_t>(tokens.size())) {
        slots.push_back(s + 1);
        step.push_back(tokens[static_cast<size_t>(next[static_cast<size_t>(s)])]);
      }
    }
    if (slots.empty()) break;
    auto logits = gpu.DecodeStep(slots, step, use_graph);
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) break;
    const int64_t vocab = gpu.config().vocab_size;
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto s = static_cast<size_t>(slots[i] - 1);
      std::copy_n(logits->ptr() + static_cast<int64_t>(i) * vocab, vocab,
                  split[s].ptr() + next[s]++ * vocab);
    }
  }
  whole.insert(whole.end(), std::make_move_iterator(split.begin()),
               std::make_move_iterator(split.end()));
  return whole;
}

// Every prompt of `m` on `gpu` in two ways, each row against the CPU engine `cpu`'s one-shot
// logits: whole-prompt prefill in one call (slot 0), and chunked prefill of the first half in
// chunks of 7 followed by the rest as batched decode steps, all prompts at once in slots 1.. .
inline RowStats CompareOnPrompts(const TestModel& m, const Model& cpu, GpuModel& gpu) {
  RowStats stats;
  std::vector<Tensor> refs;
  for (const auto& tokens : m.prompts) {
    ModelState state = cpu.NewState();
    auto ref = cpu.Forward(&state, tokens);
    EXPECT_TRUE(ref.ok()) << ref.status();
    refs.push_back(ref.ok() ? std::move(*ref) : Tensor());
  }
  const std::vector<Tensor> logits = PromptLogitsTwoWays(gpu, m.prompts, /*use_graph=*/false);
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i].data.empty()) continue;  // a failed call, reported already
    stats.Add(logits[i], refs[i % refs.size()], 0);
  }
  return stats;
}

}  // namespace pdserve::engine::gpu
