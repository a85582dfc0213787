// The CUDA backend of the colocated server (`pdserve serve --backend cuda`) and of the workers: a
// ServiceOptions::runner_factory that loads the model's weights onto one GPU as an
// engine::gpu::GpuModel, or onto several as an expert-parallel engine::gpu::GpuModelGroup (one
// rank per GPU), with one state slot per batch sequence, and serves it through
// runtime::GpuStepRunner.
//
// Thread-safety: the factory is called once, by ColocatedService::Create.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/gpu_model_group.h"
#include "engine/model_options.h"
#include "runtime/step_types.h"

namespace pdserve::runtime {

struct GpuBackendOptions {
  // CUDA device ordinals, one rank each: one device is a plain GpuModel, several an
  // expert-parallel group.
  std::vector<int> devices = {0};
  // The group's communicator (several devices only).
  engine::gpu::ExpertCommKind comm = engine::gpu::ExpertCommKind::kAuto;
  engine::gpu::GemmInputs gemm_inputs = engine::gpu::GemmInputs::kBf16;
  // kFp8Block (`--weights fp8`, worker key `weights: fp8`): the projections the checkpoint stores
  // FP8 with block scales stay FP8 on the GPU (engine/gpu/gpu_model.h, WeightFormat); the host
  // never holds a float32 copy of them.
  engine::gpu::WeightFormat weight_format = engine::gpu::WeightFormat::kBf16;
  // With kFp8Block (`--fp8-activations`, worker key `fp8_activations`): bf16 activations (W8A16,
  // the default) or e4m3 per 1 x 128 (W8A8); engine/gpu/gpu_model.h, Fp8Activations.
  engine::gpu::Fp8Activations fp8_activations = engine::gpu::Fp8Activations::kBf16;
  int64_t max_chunk = 256;  // tokens per prefill Forward call; the runner's prefill_block is capped
  // > 0 (worker key `prefill_chunk`, `pdserve serve --prefill-chunk`): the model's max_chunk AND
  // the block prompts are cut at (runner and prefill engine alike, so PD equals colocated); a
  // chunk reads every weight once, so larger chunks read them fewer times per prompt. 0: today's
  // cut at the runner's prefill_block (64) with max_chunk rows of activations.
  int64_t prefill_chunk = 0;
  // guards.reference_kernels: kSparseAttention -> GpuModelOptions::fixed_shape_attention = false,
  // kIndexer -> fixed_shape_indexer = false (the any-shape reference kernels); kFp8State changes
  // nothing (the GPU state is bf16 / fp32 already).
  std::vector<engine::SwitchablePiece> reference_pieces;
  // TEST ONLY (kNone in every deployment; engine/model_options.h, PDSERVE_TEST_SCRAMBLE_INDEXER):
  // kLowestScores turns on GpuModelOptions::test_lowest_score_indexer, kUnmaskedSlots
  // test_unmasked_indexer (both on the fixed-shape decode indexer only).
  engine::IndexerFault indexer_fault = engine::IndexerFault::kNone;
};

// One line for the startup log, e.g. "backend cuda: decode attention=fixed-shape
// indexer=reference (asked) fp8_state=bf16 state", plus " TEST FAULT indexer=lowest_scores
// (fixed-shape decode indexer)" when options.indexer_fault is set. Prefill always runs the
// any-shape kernels.
std::string GpuImplementationSummary(const GpuBackendOptions& options);

// The GpuModel's max_chunk for `options`: prefill_chunk when set, else max_chunk.
int64_t GpuMaxChunk(const GpuBackendOptions& options);
// The block prompts are cut at on the GPU: prefill_chunk when set, else `runner_block` (the
// runner's or worker's prefill_block) capped at max_chunk.
int64_t GpuPrefillBlock(const GpuBackendOptions& options, int64_t runner_block);

// The model's weights (engine::Weights::Load from `model_dir`, then the CPU engine's
// ValidateWeights) uploaded as a group of one GpuModel per options.devices entry, each of
// `slots_per_rank` slots of `max_context` tokens with paged state pools of
// `state_tokens_per_rank` tokens (GpuModelOptions::state_tokens; 0: every slot full): what
// GpuRunnerFactory and the prefill worker's CUDA engine (runtime/cuda) run. Checks the devices
// before the weights load, which takes a while for a large model. The host copy of the weights is
// freed before it returns. Errors: the weights' (NotFound, InvalidArgument), FailedPrecondition
// when no CUDA device is present, InvalidArgument for no devices or a device outside the present
// ones, GpuModelGroup::Create's.
absl::StatusOr<std::unique_ptr<engine::gpu::GpuModelGroup>> LoadGpuModelGroup(
    const GpuBackendOptions& options, const std::string& model_dir,
    const engine::ModelConfig& config, int64_t slots_per_rank, int64_t max_context,
    int64_t state_tokens_per_rank = 0);

// The factory: weights from the context's model_dir, a group (LoadGpuModelGroup) whose ranks hold
// context.slots slots between them (ceil(slots / ranks) each, one more each with
// context.options.canary: the canary's recompute slot) of context.max_context tokens, with
// ceil(context.state_tokens / ranks) tokens of paged state each (plus max_context for the
// canary's slot; 0: every slot full), and a GpuStepRunner owning it. Errors: LoadGpuModelGroup's,
// Internal for CUDA errors.
RunnerFactory GpuRunnerFactory(GpuBackendOptions options);

}  // namespace pdserve::runtime
