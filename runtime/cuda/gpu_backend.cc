#include "runtime/cuda/gpu_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/tensor_spec.h"
#include "engine/weights.h"
#include "runtime/cuda/gpu_step_runner.h"
#include "spdlog/spdlog.h"

namespace pdserve::runtime {

absl::StatusOr<std::unique_ptr<engine::gpu::GpuModelGroup>> LoadGpuModelGroup(
    const GpuBackendOptions& options, const std::string& model_dir,
    const engine::ModelConfig& config, int64_t slots_per_rank, int64_t max_context,
    int64_t state_tokens_per_rank) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        "backend cuda: no CUDA device is present (on this machine: --backend cpu for pdserve "
        "serve, backend: cpu for a worker of a deploy config)");
  }
  // Before the weights load, which takes a while for a large model.
  PDSERVE_RETURN_IF_ERROR(engine::gpu::CheckRankDevices(options.devices, "backend cuda"));
  const bool fp8 = options.weight_format == engine::gpu::WeightFormat::kFp8Block;
  engine::WeightsLoadOptions load;
  load.skip_fp8_matrices = fp8;
  load.skip_quantized_experts = fp8;
  PDSERVE_ASSIGN_OR_RETURN(engine::Weights weights, engine::Weights::Load(model_dir, config, load));
  // Load checked every stored tensor's shape and ids, the left-out ones included; ValidateWeights
  // repeats that for the tensors held and would call the left-out ones missing.
  if (!fp8) PDSERVE_RETURN_IF_ERROR(engine::ValidateWeights(config, weights));
  if (fp8) {
    spdlog::info(
        "backend cuda: weights fp8: {} projections stay FP8 (e4m3 + 128x128 scales), {} "
        "activations",
        weights.left_stored().size(),
        options.fp8_activations == engine::gpu::Fp8Activations::kBf16 ? "bf16 (W8A16)"
                                                                      : "fp8 (W8A8)");
  }
  engine::gpu::GpuGroupOptions group;
  group.devices = options.devices;
  group.comm = options.comm;
  engine::gpu::GpuModelOptions& gpu_options = group.model;
  gpu_options.slots = slots_per_rank;
  gpu_options.max_context = max_context;
  gpu_options.state_tokens = state_tokens_per_rank;
  gpu_options.max_chunk = GpuMaxChunk(options);
  gpu_options.gemm_inputs = options.gemm_inputs;
  gpu_options.weight_format = options.weight_format;
  gpu_options.fp8_activations = options.fp8_activations;
  gpu_options.checkpoint_dir = model_dir;
  for (engine::SwitchablePiece piece : options.reference_pieces) {
    if (piece == engine::SwitchablePiece::kSparseAttention) {
      gpu_options.fixed_shape_attention = false;
    }
    if (piece == engine::SwitchablePiece::kIndexer) gpu_options.fixed_shape_indexer = false;
  }
  gpu_options.test_lowest_score_indexer =
      options.indexer_fault == engine::IndexerFault::kLowestScores;
  gpu_options.test_unmasked_indexer = options.indexer_fault == engine::IndexerFault::kUnmaskedSlots;
  spdlog::info("{}", GpuImplementationSummary(options));
  return engine::gpu::GpuModelGroup::Create(config, weights, group);
}

int64_t GpuMaxChunk(const GpuBackendOptions& options) {
  return options.prefill_chunk > 0 ? options.prefill_chunk : options.max_chunk;
}

int64_t GpuPrefillBlock(const GpuBackendOptions& options, int64_t runner_block) {
  return options.prefill_chunk > 0 ? options.prefill_chunk
                                   : std::min(runner_block, options.max_chunk);
}

std::string GpuImplementationSummary(const GpuBackendOptions& options) {
  auto asked = [&](engine::SwitchablePiece piece) {
    return std::find(options.reference_pieces.begin(), options.reference_pieces.end(), piece) !=
           options.reference_pieces.end();
  };
  const bool attention = asked(engine::SwitchablePiece::kSparseAttention);
  const bool indexer = asked(engine::SwitchablePiece::kIndexer);
  std::string line = absl::StrCat(
      "backend cuda: decode sparse_attention=", attention ? "reference (asked)" : "fixed-shape",
      " indexer=", indexer ? "reference (asked)" : "fixed-shape", " fp8_state=bf16 state",
      asked(engine::SwitchablePiece::kFp8State) ? " (asked)" : "",
      "; prefill any-shape (the fixed-shape kernels run only where the model has V4 shapes)");
  if (options.indexer_fault != engine::IndexerFault::kNone) {
    absl::StrAppend(&line, " TEST FAULT indexer=", engine::IndexerFaultName(options.indexer_fault),
                    " (fixed-shape decode indexer",
                    indexer ? ", off: the reference indexer is asked for" : "", ")");
  }
  return line;
}

RunnerFactory GpuRunnerFactory(GpuBackendOptions options) {
  return
      [options](const RunnerContext& context) -> absl::StatusOr<std::unique_ptr<SequenceRunner>> {
        const auto ranks = static_cast<int64_t>(std::max<size_t>(1, options.devices.size()));
        // The canary's recompute slot (one more per rank) re-runs a whole sequence: its pages
        // come on top of the admitted sequences' (which admission reserves against
        // context.state_tokens), so a short pool never fails a check.
        const bool canary = context.options.canary;
        const int64_t state_tokens =
            context.state_tokens > 0
                ? (context.state_tokens + ranks - 1) / ranks + (canary ? context.max_context : 0)
                : 0;
        PDSERVE_ASSIGN_OR_RETURN(
            std::unique_ptr<engine::gpu::GpuModelGroup> group,
            LoadGpuModelGroup(options, context.model_dir, *context.config,
                              (context.slots + ranks - 1) / ranks + (canary ? 1 : 0),
                              context.max_context, state_tokens));
        spdlog::info("backend cuda: {}", group->Describe());
        RunnerOptions runner_options = context.options;
        runner_options.prefill_block = GpuPrefillBlock(options, runner_options.prefill_block);
        PDSERVE_ASSIGN_OR_RETURN(
            std::unique_ptr<GpuStepRunner> runner,
            GpuStepRunner::Create(std::move(group), *context.layout, context.pool, runner_options));
        return std::unique_ptr<SequenceRunner>(std::move(runner));
      };
}

}  // namespace pdserve::runtime
