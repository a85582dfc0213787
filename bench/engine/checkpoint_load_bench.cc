// Checkpoint loading speed: Weights::Load (mmap, header checks, conversion to float32, name
// mapping, expert stacking, validation) of a 40 MB BF16 checkpoint under DeepSeek's names, and of
// the same weights with FP8 dense / FP4 expert tensors (16 MB). Run:
//   build/bench/engine/checkpoint_load_bench
// and record the figures in docs/checkpoints.md ("Load speed") with the date and machine.
#include <benchmark/benchmark.h>

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/checkpoint_layout.h"
#include "engine/config.h"
#include "engine/safetensors.h"
#include "engine/weights.h"

namespace pdserve::engine {
namespace {

// ~20M parameters: all three attention layer types, hash and routed MoE.
constexpr char kConfig[] = R"({
  "model_type": "deepseek_v4", "vocab_size": 4096, "hidden_size": 512,
  "moe_intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
  "head_dim": 128, "q_lora_rank": 256, "num_experts_per_tok": 2, "n_routed_experts": 6,
  "layer_types": ["sliding_attention", "compressed_sparse_attention",
                  "heavily_compressed_attention", "compressed_sparse_attention"],
  "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"], "partial_rotary_factor": 0.25,
  "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
  "o_groups": 4, "o_lora_rank": 128, "index_n_heads": 4, "index_head_dim": 64,
  "index_topk": 64, "max_position_embeddings": 4096})";

std::string Bf16(const std::vector<float>& v) {
  std::string out(v.size() * 2, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    const auto half = static_cast<uint16_t>(std::bit_cast<uint32_t>(v[i]) >> 16);
    out[2 * i] = static_cast<char>(half & 0xff);
    out[2 * i + 1] = static_cast<char>(half >> 8);
  }
  return out;
}

// Writes the checkpoint once per process; `quantized` stores 2-D dense weights as FP8 (UE8M0
// block scales) and experts as packed FP4 (I8, UE8M0 scales per 32), as DeepSeek ships them.
std::string WriteCheckpoint(bool quantized) {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/pdserve_load_bench_" +
                          (quantized ? "q" : "bf16");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << kConfig;
  const ModelConfig config = *ModelConfig::Parse(kConfig, "bench");
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<std::string> storage;
  storage.reserve(4096);
  std::vector<TensorBytes> tensors;
  auto add = [&](std::string name, DType dtype, std::vector<int64_t> shape, std::string bytes) {
    storage.push_back(std::move(bytes));
    tensors.push_back({std::move(name), dtype, std::move(shape), storage.back()});
  };
  for (const auto& [name, spec] : RequiredTensors(config)) {
    if (spec.integer) {
      std::vector<int64_t> ids(static_cast<size_t>(Tensor::NumElements(spec.shape)));
      for (auto& id : ids) id = static_cast<int64_t>(rng() % config.n_routed_experts);
      add(OriginalName({name}), DType::kI64, spec.shape,
          std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 8));
      continue;
    }
    const bool experts =
        name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj");
    const int64_t pieces = experts ? spec.shape[0] * (name.ends_with("down_proj") ? 1 : 2) : 1;
    for (int64_t p = 0; p < pieces; ++p) {
      TensorTarget target{name};
      std::vector<int64_t> shape = spec.shape;
      if (experts) {
        const bool down = name.ends_with("down_proj");
        target.expert = down ? p : p / 2;
        target.part =
            down ? TensorTarget::Part::kExpertDown
                 : (p % 2 ? TensorTarget::Part::kExpertUp : TensorTarget::Part::kExpertGate);
        shape = down ? std::vector<int64_t>{spec.shape[1], spec.shape[2]}
                     : std::vector<int64_t>{spec.shape[1] / 2, spec.shape[2]};
      }
      const int64_t n = Tensor::NumElements(shape);
      const std::string stored = OriginalName(target);
      const std::string base = stored.substr(0, stored.size() - 7);  // without ".weight"
      if (quantized && experts) {
        add(stored, DType::kI8, {shape[0], shape[1] / 2},
            std::string(static_cast<size_t>(n / 2), '\x35'));
        add(base + ".scale", DType::kF8E8M0, {shape[0], shape[1] / 32},
            std::string(static_cast<size_t>(shape[0] * shape[1] / 32), '\x77'));
      } else if (quantized && shape.size() == 2 && stored.ends_with(".weight") && shape[0] > 1) {
        add(stored, DType::kF8E4M3, shape, std::string(static_cast<size_t>(n), '\x2a'));
        add(base + ".scale", DType::kF8E8M0, {(shape[0] + 127) / 128, (shape[1] + 127) / 128},
            std::string(static_cast<size_t>(((shape[0] + 127) / 128) * ((shape[1] + 127) / 128)),
                        '\x76'));
      } else {
        std::vector<float> v(static_cast<size_t>(n));
        for (float& x : v) x = dist(rng);
        add(stored, DType::kBF16, shape, Bf16(v));
      }
    }
  }
  if (!WriteSafetensors(dir + "/model.safetensors", tensors).ok()) std::abort();
  return dir;
}

void BM_Load(benchmark::State& state) {
  const bool quantized = state.range(0) != 0;
  static const std::string dirs[2] = {WriteCheckpoint(false), WriteCheckpoint(true)};
  const std::string& dir = dirs[quantized ? 1 : 0];
  const ModelConfig config = *ModelConfig::Load(dir);
  const auto bytes = std::filesystem::file_size(dir + "/model.safetensors");
  for (auto _ : state) {
    auto weights = Weights::Load(dir, config);
    if (!weights.ok()) state.SkipWithError(std::string(weights.status().message()).c_str());
    benchmark::DoNotOptimize(weights);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["file_MB"] = static_cast<double>(bytes) / 1e6;
}
BENCHMARK(BM_Load)->Arg(0)->Arg(1)->ArgName("quantized")->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace pdserve::engine

BENCHMARK_MAIN();
