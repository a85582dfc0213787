#include "runtime/cuda/gpu_slot_importer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "spdlog/spdlog.h"

namespace pdserve::runtime {
namespace {

// Holds the model lock for an import section.
class ImportSection {
 public:
  explicit ImportSection(ModelLock* lock) : lock_(lock) { lock_->LockForImport(); }
  ~ImportSection() { lock_->Unlock(); }
  ImportSection(const ImportSection&) = delete;
  ImportSection& operator=(const ImportSection&) = delete;

 private:
  ModelLock* const lock_;
};

absl::Status NoImport(serving::RequestId id) {
  return absl::NotFoundError(absl::StrCat("sequence ", id, " has no early import"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuSlotImporter>> GpuSlotImporter::Create(
    GpuSlotImporterOptions options) {
  if (options.gpu == nullptr || options.layout == nullptr || options.pool == nullptr ||
      options.lock == nullptr || !options.take_slot || !options.return_slot) {
    return absl::InvalidArgumentError(
        "GpuSlotImporter: model, layout, pool, lock and the slot callbacks are required");
  }
  const auto layers = static_cast<int64_t>(options.gpu->config().num_hidden_layers);
  absl::StatusOr<std::unique_ptr<engine::gpu::StateStaging>> staging;
  {
    ImportSection section(options.lock);
    staging = options.gpu->NewStateStaging(std::min<int64_t>(2, layers));
  }
  if (!staging.ok()) return staging.status();
  std::shared_ptr<DevicePageDescriptors> descriptors;
  if (KeepDevicePageBuffers()) {
    // Two batches a layer: a second import's layers do not wait for the first one's.
    PDSERVE_ASSIGN_OR_RETURN(descriptors, DevicePageDescriptors::Create(
                                              static_cast<size_t>(2 * std::max<int64_t>(layers, 1)),
                                              /*mapped=*/true));
  }
  return std::unique_ptr<GpuSlotImporter>(
      new GpuSlotImporter(std::move(options), std::move(*staging), std::move(descriptors)));
}

GpuSlotImporter::GpuSlotImporter(GpuSlotImporterOptions options,
                                 std::unique_ptr<engine::gpu::StateStaging> staging,
                                 std::shared_ptr<DevicePageDescriptors> descriptors)
    : options_(std::move(options)),
      staging_(std::move(staging)),
      descriptors_(std::move(descriptors)) {}

GpuSlotImporter::~GpuSlotImporter() {
  std::vector<serving::RequestId> left;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, import] : imports_) left.push_back(id);
  }
  for (serving::RequestId id : left) Release(id);
}

absl::Status GpuSlotImporter::Claim(serving::RequestId id, int64_t position, int64_t total_tokens) {
  Import import;
  import.position = position;
  PDSERVE_ASSIGN_OR_RETURN(const serving::PageTable table, options_.pool->Table(id));
  PDSERVE_ASSIGN_OR_RETURN(import.pages, MapPages(*options_.pool, table));
  import.paged =
      std::make_unique<PagedState>(options_.gpu->config(), *options_.layout, total_tokens);
  return ClaimSlot(id, std::move(import));
}

absl::Status GpuSlotImporter::ClaimFromDevice(serving::RequestId id, int64_t position,
                                              int64_t total_tokens, DevicePageSource source) {
  Import import;
  import.position = position;
  PDSERVE_ASSIGN_OR_RETURN(import.device, DeviceStatePages::Create(options_.gpu, *options_.layout,
                                                                   total_tokens, descriptors_));
  import.device_pages.pages = std::move(source.pages);
  import.device_hold = std::move(source.hold);
  return ClaimSlot(id, std::move(import));
}

absl::Status GpuSlotImporter::ClaimSlot(serving::RequestId id, Import import) {
  {
    absl::MutexLock lock(&mu_);
    if (imports_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already importing"));
    }
  }
  PDSERVE_ASSIGN_OR_RETURN(import.slot, options_.take_slot(id));
  absl::Status begun;
  {
    ImportSection section(options_.lock);
    begun = options_.gpu->BeginStagedImport(import.slot, import.position);
  }
  if (!begun.ok()) {
    options_.return_slot(id, import.slot);
    return begun;
  }
  absl::MutexLock lock(&mu_);
  imports_[id] = std::move(import);
  return absl::OkStatus();
}

absl::StatusOr<const GpuSlotImporter::Import*> GpuSlotImporter::Running(serving::RequestId id) {
  // The record stays while the caller's import call runs: Release for the id waits for it
  // (EarlyImporter), and nothing else changes a claimed record.
  absl::MutexLock lock(&mu_);
  auto it = imports_.find(id);
  if (it == imports_.end()) return NoImport(id);
  return &it->second;
}

absl::Status GpuSlotImporter::ImportLayer(serving::RequestId id, int64_t layer) {
  PDSERVE_ASSIGN_OR_RETURN(const Import* const import, Running(id));
  const int64_t slot = import->slot;
  const int64_t position = import->position;
  if (import->device != nullptr) {
    // Device to device: the copies are enqueued on the model's import stream, nothing to fill.
    ImportSection section(options_.lock);
    return import->device->LoadLayer(slot, layer, import->device_pages);
  }
  // The fill (the host's copy out of the pages) runs with no lock: steps go on meanwhile.
  PDSERVE_RETURN_IF_ERROR(staging_->FillImportLayer(
      layer, position,
      [&](int64_t l, const engine::RingLayerGeometry& geometry,
          const engine::MutableRingLayerBlocks& blocks) {
        return import->paged->LoadLayerRing(l, geometry, position, import->pages, blocks,
                                            options_.fill_pool);
      }));
  absl::Status enqueued;
  {
    ImportSection section(options_.lock);
    enqueued = options_.gpu->EnqueueStagedLayer(slot, layer, staging_.get());
  }
  if (!enqueued.ok()) {
    // The filled buffer is dropped, so the staging serves the next layer.
    const absl::Status discarded = staging_->Discard();
    if (!discarded.ok()) spdlog::error("GpuSlotImporter: {}", discarded.ToString());
  }
  return enqueued;
}

absl::Status GpuSlotImporter::ImportLayers(serving::RequestId id, std::span<const int64_t> layers) {
  PDSERVE_ASSIGN_OR_RETURN(const Import* const import, Running(id));
  if (import->device == nullptr || layers.size() < 2) return SlotImporter::ImportLayers(id, layers);
  ImportSection section(options_.lock);
  return import->device->LoadLayers(import->slot, layers, import->device_pages);
}

absl::StatusOr<bool> GpuSlotImporter::Copied(serving::RequestId id) {
  PDSERVE_ASSIGN_OR_RETURN(const int64_t slot, SlotOf(id));
  ImportSection section(options_.lock);
  return options_.gpu->StagedImportCopied(slot);
}

void GpuSlotImporter::Release(serving::RequestId id) { ReleaseImport(id, /*locked=*/false); }

void GpuSlotImporter::ReleaseWithLockHeld(serving::RequestId id) {
  ReleaseImport(id, /*locked=*/true);
}

bool GpuSlotImporter::ReleaseImport(serving::RequestId id, bool locked) {
  int64_t slot = -1;
  // Dropped at the end, after the cancel waited for its copies (device pages are read by them).
  Import released;
  {
    absl::MutexLock lock(&mu_);
    auto it = imports_.find(id);
    if (it == imports_.end()) return false;
    slot = it->second.slot;
    released = std::move(it->second);
    imports_.erase(it);
  }
  if (!locked) options_.lock->LockForImport();
  const absl::Status cancelled = options_.gpu->CancelStagedImport(slot);
  if (!locked) options_.lock->Unlock();
  if (!cancelled.ok()) {
    spdlog::error("GpuSlotImporter: sequence {} slot {}: {}", id, slot, cancelled.ToString());
  }
  options_.return_slot(id, slot);
  return true;
}

absl::StatusOr<int64_t> GpuSlotImporter::SlotOf(serving::RequestId id) const {
  absl::MutexLock lock(&mu_);
  auto it = imports_.find(id);
  if (it == imports_.end()) return NoImport(id);
  return it->second.slot;
}

absl::Status GpuSlotImporter::Finish(serving::RequestId id) {
  int64_t slot = -1;
  Import finished_import;  // dropped after the finish, which orders the next step after its copies
  {
    absl::MutexLock lock(&mu_);
    auto it = imports_.find(id);
    if (it == imports_.end()) return NoImport(id);
    slot = it->second.slot;
    finished_import = std::move(it->second);
    imports_.erase(it);
  }
  absl::Status finished = options_.gpu->FinishStagedImport(slot);
  if (finished.ok()) return finished;
  if (absl::Status cancelled = options_.gpu->CancelStagedImport(slot); !cancelled.ok()) {
    spdlog::error("GpuSlotImporter: sequence {} slot {}: {}", id, slot, cancelled.ToString());
  }
  return finished;
}

}  // namespace pdserve::runtime
