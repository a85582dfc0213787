// The CUDA backend of the colocated server (`pdserve serve --backend cuda`): a
// ServiceOptions::runner_factory that loads the model's weights onto one GPU as an
// engine::gpu::GpuModel with one state slot per batch sequence and serves it through
// colocated::GpuStepRunner.
//
// Thread-safety: the factory is called once, by ColocatedService::Create.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "colocated/step_runner.h"
#include "engine/gpu/gpu_model.h"
#include "engine/model_options.h"

namespace pdserve::colocated {

struct GpuBackendOptions {
  int device = 0;  // CUDA device ordinal
  engine::gpu::GemmInputs gemm_inputs = engine::gpu::GemmInputs::kBf16;
  int64_t max_chunk = 256;  // tokens per prefill Forward call; the runner's prefill_block is capped
  // guards.reference_kernels: kSparseAttention -> GpuModelOptions::fixed_shape_attention = false,
  // kIndexer -> fixed_shape_indexer = false (the any-shape reference kernels); kFp8State changes
  // nothing (the GPU state is bf16 / fp32 already).
  std::vector<engine::SwitchablePiece> reference_pieces;
};

// The model's weights (engine::Weights::Load from `model_dir`, then the CPU engine's
// ValidateWeights) uploaded as a GpuModel of `slots` slots, `max_context` tokens each, on
// options.device: what GpuRunnerFactory and the prefill worker's CUDA engine (prefill/gpu) run.
// Checks for a device before the weights load, which takes a while for a large model. The host
// copy of the weights is freed before it returns. Errors: the weights' (NotFound,
// InvalidArgument), FailedPrecondition when no CUDA device is present, InvalidArgument for a
// device outside the present ones, GpuModel::Create's.
absl::StatusOr<std::unique_ptr<engine::gpu::GpuModel>> LoadGpuModel(
    const GpuBackendOptions& options, const std::string& model_dir,
    const engine::ModelConfig& config, int64_t slots, int64_t max_context);

// The factory: weights from the context's model_dir (engine::Weights::Load, then the CPU engine's
// ValidateWeights), a GpuModel of context.slots slots and context.max_context tokens on
// options.device, and a GpuStepRunner owning it. Errors: the weights' (NotFound, InvalidArgument),
// FailedPrecondition when no CUDA device is present (GpuModel::Create) or for paranoid mode,
// InvalidArgument for a device outside the present ones, Internal for CUDA errors.
RunnerFactory GpuRunnerFactory(GpuBackendOptions options);

}  // namespace pdserve::colocated
