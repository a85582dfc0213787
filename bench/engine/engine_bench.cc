// CPU engine throughput: prefill and decode tokens/s for a ~22M-parameter DeepSeek-V4 config with
// random weights (all three attention layer types, hash and routed MoE). Run:
//   build/bench/engine/engine_bench
// and record the figures in docs/perf.md with the date and `lscpu` model name.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "engine/model.h"
#include "engine/random_weights.h"
#include "engine/tensor_spec.h"

namespace pdserve::engine {
namespace {

ModelConfig BenchConfig() {
  ModelConfig c;
  c.vocab_size = 6144;
  c.hidden_size = 512;
  c.moe_intermediate_size = 256;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 8;
  c.head_dim = 128;
  c.qk_rope_head_dim = 32;
  c.rope_main.partial_rotary_factor = 0.25;  // head_dim * factor = qk_rope_head_dim
  c.rope_compress.partial_rotary_factor = 0.25;
  c.q_lora_rank = 256;
  c.num_experts_per_tok = 2;
  c.n_routed_experts = 6;
  c.layer_types = {LayerType::kSlidingAttention, LayerType::kCompressedSparseAttention,
                   LayerType::kHeavilyCompressedAttention, LayerType::kCompressedSparseAttention};
  c.mlp_layer_types = {MlpLayerType::kHashMoe, MlpLayerType::kMoe, MlpLayerType::kMoe,
                       MlpLayerType::kMoe};
  c.compress_rate_csa = 4;
  c.compress_rate_hca = 128;
  c.rope_compress.rope_type = "yarn";
  c.rope_compress.rope_theta = 160000.0;
  c.rope_compress.factor = 16.0;
  c.rope_compress.original_max_position_embeddings = 256;
  c.max_position_embeddings = 4096;
  c.hc_mult = 4;
  c.sliding_window = 128;
  c.o_groups = 4;
  c.o_lora_rank = 128;
  c.index_n_heads = 4;
  c.index_head_dim = 64;
  c.index_topk = 64;
  return c;
}

const Model& BenchModel() {
  static const Model* model = [] {
    const ModelConfig config = BenchConfig();
    return new Model(*Model::FromWeights(config, RandomWeights(config, 1)));
  }();
  return *model;
}

std::vector<int32_t> Tokens(int64_t n) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> id(0, 6143);
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (auto& t : tokens) t = id(rng);
  return tokens;
}

int64_t ParameterCount(const ModelConfig& config) {
  int64_t n = 0;
  for (const TensorSpec& spec : ExpectedTensors(config)) n += Tensor::NumElements(spec.shape);
  return n;
}

// Prefill of range(0) tokens in one Forward call from an empty state; range(1) = 1: only the
// last row's logits (ChunkLogits::kLastRow, what serving asks for), 0: every row's.
void BM_Prefill(benchmark::State& state) {
  const Model& model = BenchModel();
  const std::vector<int32_t> tokens = Tokens(state.range(0));
  const ChunkLogits rows = state.range(1) == 1 ? ChunkLogits::kLastRow : ChunkLogits::kAllRows;
  for (auto _ : state) {
    ModelState s = model.NewState();
    benchmark::DoNotOptimize(model.Forward(&s, tokens, nullptr, rows));
  }
  state.counters["tokens_per_s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * state.range(0)), benchmark::Counter::kIsRate);
  state.counters["params_M"] = static_cast<double>(ParameterCount(BenchConfig())) / 1e6;
}
BENCHMARK(BM_Prefill)
    ->ArgsProduct({{64, 128, 1024}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Decode: one token per Forward call after a prompt of range(0) tokens.
void BM_Decode(benchmark::State& state) {
  const Model& model = BenchModel();
  const std::vector<int32_t> prompt = Tokens(state.range(0));
  ModelState s = model.NewState();
  benchmark::DoNotOptimize(model.Forward(&s, prompt));
  int32_t next = 5;
  for (auto _ : state) {
    auto logits = model.Forward(&s, {next});
    next = static_cast<int32_t>((next * 31 + 7) % 6144);
    benchmark::DoNotOptimize(logits);
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Decode)->Arg(128)->Arg(1024)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace pdserve::engine

BENCHMARK_MAIN();
