// runtime::SlotImporter over one GpuModel's staged import (engine/gpu/gpu_model.h,
// BeginStagedImport ..): the CUDA decode side's early import of a transferred prompt, layer by
// layer, from the sequence's state pages (runtime::PagedState::LoadLayerRing, the direct
// import's fill) into a GpuModel slot.
//
// Claim takes a slot from `take_slot` and begins the staged import there (the slot's device
// state pages for the prompt are allocated now); ImportLayer fills the layer into the
// importer's pinned staging (two buffers; host threads `fill_pool`) with no model lock held,
// then enqueues its copies under the model lock; Copied asks the model without waiting for the
// device; Release cancels the staged import (its pages back) and returns the slot through
// `return_slot`. Finish (the runner's Place, or a benchmark) completes a taken import.
//
// Thread-safety: the model calls run under `lock` (ModelLock::LockForImport), so the caller's
// step loop must hold it (LockForStep) around its own model calls; Claim / ImportLayer /
// Copied / Release may come from different threads (EarlyImporter's contract: never two for
// one id at once; ImportLayer from one thread only, which alone uses the staging).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/task_pool.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/state_staging.h"
#include "runtime/cuda/device_state_pages.h"
#include "runtime/early_import.h"
#include "runtime/paged_state.h"
#include "serving/page_pool.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

struct GpuSlotImporterOptions {
  engine::gpu::GpuModel* gpu = nullptr;          // outlives the importer
  const serving::StateLayout* layout = nullptr;  // LayoutForModel(gpu->config()); outlives it
  serving::PagePool* pool = nullptr;             // where the transferred pages are; outlives it
  ModelLock* lock = nullptr;                     // serializes the model's calls; outlives it
  // The slot a claimed sequence imports into (ResourceExhausted when none is free), and its
  // return when the import ends without being taken.
  std::function<absl::StatusOr<int64_t>(serving::RequestId)> take_slot;
  std::function<void(serving::RequestId, int64_t slot)> return_slot;
  TaskPool* fill_pool = nullptr;  // LoadLayerRing's threads; null: the importer's thread alone
};

class GpuSlotImporter final : public SlotImporter {
 public:
  // InvalidArgument for a missing model, layout, pool, lock or slot callback; Internal for a
  // CUDA error making the staging.
  static absl::StatusOr<std::unique_ptr<GpuSlotImporter>> Create(GpuSlotImporterOptions options);
  ~GpuSlotImporter() override;

  absl::Status Claim(serving::RequestId id, int64_t position, int64_t total_tokens) override;
  // Claim whose layers come from device pages (the CUDA IPC path): ImportLayer then runs
  // DeviceStatePages::LoadLayer (device to device, no staging, no host fill) under the model
  // lock, its launches' descriptor buffers shared with the other device imports (kept across
  // requests: runtime::KeepDevicePageBuffers). `source` is held until the import is released or
  // finished. InvalidArgument for a layout DeviceStatePages refuses (fp32).
  absl::Status ClaimFromDevice(serving::RequestId id, int64_t position, int64_t total_tokens,
                               DevicePageSource source) override;
  absl::Status ImportLayer(serving::RequestId id, int64_t layer) override;
  // A device import's layers in one DeviceStatePages::LoadLayers (one hold of the model lock,
  // two launches); a host import's one by one (ImportLayer).
  absl::Status ImportLayers(serving::RequestId id, std::span<const int64_t> layers) override;
  absl::StatusOr<bool> Copied(serving::RequestId id) override;
  void Release(serving::RequestId id) override;
  // Release by a caller that holds the model lock already (a step loop's LockForStep).
  void ReleaseWithLockHeld(serving::RequestId id);

  // The slot of `id`'s import (claimed and not released). NotFound otherwise.
  absl::StatusOr<int64_t> SlotOf(serving::RequestId id) const;
  // Completes `id`'s import after EarlyImporter::Take (GpuModel::FinishStagedImport: the slot
  // reads its state from the next step on) and forgets it; the slot is the caller's from now
  // on. REQUIRES: the caller holds the model lock (a step loop's LockForStep). NotFound for an
  // unknown id; the model's errors (the import is then cancelled: the slot is empty, and still
  // the caller's).
  absl::Status Finish(serving::RequestId id);

 private:
  struct Import {
    int64_t slot = -1;
    int64_t position = 0;
    std::unique_ptr<PagedState> paged;
    SequencePages pages;
    // ClaimFromDevice: the layers' loads (used by ImportLayer's thread only) and their pages.
    std::unique_ptr<DeviceStatePages> device;
    DeviceSequencePages device_pages;
    std::shared_ptr<const void> device_hold;
  };
  // The record of `id`'s import, for an import call on it (NotFound when there is none).
  absl::StatusOr<const Import*> Running(serving::RequestId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Claim's work: the slot and its staged import for `import` (its position set).
  absl::Status ClaimSlot(serving::RequestId id, Import import);
  GpuSlotImporter(GpuSlotImporterOptions options,
                  std::unique_ptr<engine::gpu::StateStaging> staging,
                  std::shared_ptr<DevicePageDescriptors> descriptors);
  // Forgets `id`'s import and cancels it on the model (the caller holds the model lock when
  // `locked`); returns the slot through return_slot. False for an unknown id.
  bool ReleaseImport(serving::RequestId id, bool locked);

  const GpuSlotImporterOptions options_;
  const std::unique_ptr<engine::gpu::StateStaging> staging_;  // ImportLayer's thread only
  // The device imports' launch buffers, shared by every ClaimFromDevice (null with
  // PDSERVE_DEVICE_PAGES=fresh: each import makes its own, the A/B baseline).
  const std::shared_ptr<DevicePageDescriptors> descriptors_;
  mutable absl::Mutex mu_;
  std::map<serving::RequestId, Import> imports_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::runtime
