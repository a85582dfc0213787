// The prefill worker's CUDA engine (`backend: cuda`): the prompt runs on one slot of an
// engine::gpu::GpuModel in Forward calls cut at absolute multiples of prefill_block (as the CPU
// engine and the colocated runners cut them). The slot's state leaves layer by layer through
// pinned host memory (engine::gpu::StateStaging, allocated once per engine) as the last chunk
// makes it final: on one GPU the last chunk is begun (GpuModel::BeginForwardExporting), which
// enqueues the device-to-host copy of each of the staging's first `buffers` layers on a copy
// stream as soon as that layer's attention has written its state; then, while the later layers
// still compute, the engine takes each layer's copy in order (waiting for that copy only), stores
// it into the request's pages (StoreSlotStaged: spread over the engine's host threads, a
// TaskPool) and hands it to the worker (which posts its pages: checksums on the same pool, sends
// over the lanes), enqueuing the copy of the layer the freed buffer serves next (on the copy
// stream after that layer's attention); then it finishes the chunk for its logits. The pages hold
// the device's bf16 values exactly (bit for bit what GpuModel::ExportState gives). The slot is free
// again when Run returns: the worker runs one prefill at a time, so one slot suffices.
//
// Several GPUs (an expert-parallel engine::gpu::GpuModelGroup): the prompt runs on rank 0 and
// every other rank takes part in each chunk's MoE collectives with padding rows
// (GpuModel::Idle), since the worker has one prompt at a time to give it. What several GPUs buy
// the prefill worker is room for the experts, not data parallelism. A group's chunks run whole
// (its collectives synchronize inside the forward) and the state is stored after the last one.
//
// What does not overlap (docs/protocol.md, "Prefill on the CUDA engine"): a layer's state is
// final only after the last chunk, so nothing leaves during the earlier chunks; what the host has
// not stored and sent by the end of the last chunk's compute adds to TTFT.
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
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/gpu_model_group.h"
#include "engine/gpu/state_staging.h"
#include "runtime/cuda/device_state_pages.h"
#include "runtime/cuda/gpu_backend.h"
#include "runtime/prefill_engine.h"

namespace pdserve::runtime {

class GpuPrefillEngine final : public PrefillEngine {
 public:
  // Pinned staging the default (staging_buffers 0) may take: as many layer buffers
  // (GpuModel::StagingLayerBytes each) as fit, at least 2 and at most the model's layers.
  static constexpr size_t kStagingBudgetBytes = size_t{256} << 20;

  // Over `gpu` (not owned; it must outlive the engine; tests share one GpuModel). Uses slot 0.
  // staging_buffers: pinned layer buffers of the state staging (1 .. layers; 0: the default
  // above); the copies run at most that many layers ahead of the stores. host_threads: the
  // threads each layer's page store is spread over (and transfer_pool()'s), 1 .. 64; 0:
  // DefaultTransferHostThreads of this host. InvalidArgument for prefill_block outside
  // [1, gpu->max_chunk()], staging_buffers outside [0, layers] or host_threads outside [0, 64];
  // Internal when the pinned staging cannot be allocated.
  static absl::StatusOr<std::unique_ptr<GpuPrefillEngine>> Create(engine::gpu::GpuModel* gpu,
                                                                  int64_t prefill_block,
                                                                  int64_t staging_buffers = 0,
                                                                  int host_threads = 0);
  // Over every rank of `group` (owned); the staging is rank 0's. Errors as above.
  static absl::StatusOr<std::unique_ptr<GpuPrefillEngine>> Create(
      std::unique_ptr<engine::gpu::GpuModelGroup> group, int64_t prefill_block,
      int64_t staging_buffers = 0, int host_threads = 0);

  absl::StatusOr<std::vector<float>> Run(std::span<const int32_t> prompt,
                                         const runtime::PagedState& paged,
                                         const runtime::SequencePages& pages,
                                         const LayerStored& layer_stored,
                                         const ChunkDone& chunk_done) override;
  // The CUDA IPC path on one GPU: the chunks as Run, every layer stored into the device pages
  // with its checksums after the forward on the model's stream (runtime::DeviceStatePages::
  // StoreLayers: one launch pair for all layers), or, with the environment's
  // PDSERVE_CUDA_IPC_OVERLAP=1, each layer during the last chunk right after the layer's
  // attention (GpuModel::BeginForwardStoring, StoreLayer), then one wait for all of them. The
  // descriptor and checksum buffers are kept for the next request (PDSERVE_DEVICE_PAGES=fresh:
  // new ones a request and a StoreLayer a layer, the A/B baseline).
  // FailedPrecondition on an expert-parallel group (the state lies on rank 0, the arena's GPU may
  // be another).
  absl::StatusOr<DeviceRun> RunToDevice(
      std::span<const int32_t> prompt, const runtime::PagedState& paged,
      const runtime::SequencePages& device_pages,
      const std::vector<std::vector<PagedState::PageId>>& checksum_pages,
      const ChunkDone& chunk_done) override;
  bool stores_device_pages() const override { return group_->world() == 1; }
  int64_t max_context() const override { return group_->rank(0).max_context(); }
  std::string Describe() const override;
  TaskPool* transfer_pool() override { return &pool_; }

 private:
  GpuPrefillEngine(std::unique_ptr<engine::gpu::GpuModelGroup> group,
                   std::unique_ptr<engine::gpu::StateStaging> staging, int64_t prefill_block,
                   int host_threads)
      : group_(std::move(group)),
        staging_(std::move(staging)),
        prefill_block_(prefill_block),
        pool_(host_threads) {}

  // Checks the prompt's length and resets the slot (and the staging) for it.
  absl::Status BeginPrompt(std::span<const int32_t> prompt);
  // Runs the prompt's chunks (BeginPrompt first), the last one with BeginForwardStoring and
  // `last_chunk_final` when that is set, else whole; the last chunk's last-row logits.
  absl::StatusOr<std::vector<float>> ForwardChunks(
      std::span<const int32_t> prompt, const ChunkDone& chunk_done,
      const engine::gpu::GpuModel::LayerFinal& last_chunk_final);
  // Reports every layer of the chunk whose forward just returned (LayerForwarded).
  void NoteChunkLayers() const {
    for (int64_t l = 0; l < group_->rank(0).config().num_hidden_layers; ++l) NoteLayerForwarded(l);
  }

  // RunToDevice's buffers, kept across requests (unless KeepDevicePageBuffers() is false): the
  // stores' descriptors and the page checksums, on the device and pinned on the host (grown to
  // the most pages a request has had).
  struct DeviceBuffers {
    std::shared_ptr<DevicePageDescriptors> descriptors;
    engine::gpu::DeviceArray<uint64_t> sums;
    engine::gpu::PinnedArray<uint64_t> host_sums;
  };
  std::unique_ptr<engine::gpu::GpuModelGroup> group_;
  // Rank 0's; declared after group_ so it goes first (it must not outlive the model).
  std::unique_ptr<engine::gpu::StateStaging> staging_;
  int64_t prefill_block_;
  TaskPool pool_;
  DeviceBuffers device_buffers_;
};

// Where StoreSlotStaged's time went (steady clock, ms summed over the layers): waiting for the
// layers' device-to-host copies, storing the pinned blocks into the pages, and the layer_stored
// callbacks (the worker's posts: the checksums when the sender takes them at post time).
struct StagedStoreTimes {
  double copy_wait_ms = 0;
  double store_ms = 0;
  double stored_callback_ms = 0;
};

// What GpuPrefillEngine::Run does after the forward, on its own (bench/ep/staging_bench and
// bench/kvtransfer/gpu_state_transfer_bench time it): stores slot `slot`'s state at its position
// into `pages` (a fresh sequence: from position 0) layer by layer through `staging` (of `gpu`;
// empty: nothing held), calling layer_stored(l) after layer l is stored, in order. The
// device-to-host copies run up to staging.buffers() layers ahead of the stores; each layer's
// store is spread over `pool`'s threads (PagedState::StoreLayerRing; null: this thread). On an
// error the staging may still hold copies: Discard it before the next use. `times`, when given,
// gets where the time went. Errors: ExportLayerAsync's, TakeLayer's, PagedState::StoreLayer's,
// and layer_stored's own.
absl::Status StoreSlotStaged(engine::gpu::GpuModel& gpu, int64_t slot,
                             engine::gpu::StateStaging& staging, const runtime::PagedState& paged,
                             const runtime::SequencePages& pages,
                             const PrefillEngine::LayerStored& layer_stored,
                             TaskPool* pool = nullptr, StagedStoreTimes* times = nullptr);

// The factory the prefill worker takes for `backend: cuda` (PrefillWorkerOptions::engine_factory):
// runtime::LoadGpuModelGroup with one slot per rank of the model's whole context (a prompt may be
// as long as the worker accepts), prefill_block capped at options.max_chunk. Errors:
// LoadGpuModelGroup's.
PrefillEngineFactory GpuPrefillEngineFactory(runtime::GpuBackendOptions options);

}  // namespace pdserve::runtime
