// The prefill worker's CUDA engine (`backend: cuda`): the prompt runs on one slot of an
// engine::gpu::GpuModel in Forward calls cut at absolute multiples of prefill_block (as the CPU
// engine and the colocated runners cut them); after the last chunk the slot's state is exported
// once (GpuModel::ExportState: host fp32 in the CPU engine's layout, the device's bf16 window
// rows, entries and indexer keys exactly) and stored into the request's pages layer by layer,
// each layer handed to the worker (which posts its pages) as soon as it is stored. The slot is
// free again when Run returns: the worker runs one prefill at a time, so one slot suffices.
//
// Several GPUs (an expert-parallel engine::gpu::GpuModelGroup): the prompt runs on rank 0 and
// every other rank takes part in each chunk's MoE collectives with padding rows
// (GpuModel::Idle), since the worker has one prompt at a time to give it. What several GPUs buy
// the prefill worker is room for the experts, not data parallelism.
//
// Why not per layer during the forward, as the CPU engine does: GpuModel has no per-layer hook
// or export; its ExportState copies a whole slot in one synchronizing transfer. The pages
// therefore leave after the forward; the transfer overlaps only the stores of later layers
// (docs/protocol.md, "Prefill on the CUDA engine").
//
// Thread-safety: one Run at a time (GpuModel is not thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "colocated/gpu/gpu_backend.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/gpu_model_group.h"
#include "prefill/prefill_engine.h"

namespace pdserve::prefill {

class GpuPrefillEngine final : public PrefillEngine {
 public:
  // Over `gpu` (not owned; it must outlive the engine; tests share one GpuModel). Uses slot 0.
  // InvalidArgument for prefill_block outside [1, gpu->max_chunk()].
  static absl::StatusOr<std::unique_ptr<GpuPrefillEngine>> Create(engine::gpu::GpuModel* gpu,
                                                                  int64_t prefill_block);
  // Over every rank of `group` (owned). Errors as above.
  static absl::StatusOr<std::unique_ptr<GpuPrefillEngine>> Create(
      std::unique_ptr<engine::gpu::GpuModelGroup> group, int64_t prefill_block);

  absl::StatusOr<std::vector<float>> Run(std::span<const int32_t> prompt,
                                         const colocated::PagedState& paged,
                                         const colocated::SequencePages& pages,
                                         const LayerStored& layer_stored,
                                         const ChunkDone& chunk_done) override;
  int64_t max_context() const override { return group_->rank(0).max_context(); }
  std::string Describe() const override;

 private:
  GpuPrefillEngine(std::unique_ptr<engine::gpu::GpuModelGroup> group, int64_t prefill_block)
      : group_(std::move(group)), prefill_block_(prefill_block) {}

  std::unique_ptr<engine::gpu::GpuModelGroup> group_;
  int64_t prefill_block_;
};

// The factory the prefill worker takes for `backend: cuda` (PrefillWorkerOptions::engine_factory):
// colocated::LoadGpuModelGroup with one slot per rank of the model's whole context (a prompt may be
// as long as the worker accepts), prefill_block capped at options.max_chunk. Errors:
// LoadGpuModelGroup's.
PrefillEngineFactory GpuPrefillEngineFactory(colocated::GpuBackendOptions options);

}  // namespace pdserve::prefill
