// A CUDA engine slot's state to and from state pages in device memory (issue 27, docs/protocol.md
// "Same-host device-to-device pages (CUDA IPC), design"): the data movement of the same-host
// device-to-device path, without the protocol around it.
//
// The pages are laid out byte for byte as runtime::PagedState::StoreLayerRing lays out host pages
// of a bf16 layout (LayoutForModel(config, entries_per_page, kBfloat16): window rows and entries
// bf16, compressor rows fp32; docs/serving.md "Page format"), so a page's payload and its XXH3-64
// are the same whichever path wrote it. The byte plan is PagedState::PlanPageRuns; each layer's
// runs go in one kernels/cuda copy_pages launch (descriptors uploaded in one small copy, or read
// from mapped pinned buffers: DevicePageDescriptors), and the prefill side's page checksums in
// one xxh3_64_pages launch into a device array, so no host thread reads or writes the state
// bytes.
//
//   P (prefill): StoreLayer(slot, layer, position, pages, checksums, stream) after the forward that
//     made the layer final is enqueued (the model's stream, or a stream ordered after it):
//     device slot -> device pages (an IpcPageArena's), then their checksums. For the prompt's
//     last chunk, GpuModel::BeginForwardStoring calls it per layer on the copy stream right after
//     that layer's attention, so the gathers overlap the later layers' compute.
//   D (decode): inside a staged import of the slot (GpuModel::BeginStagedImport(slot, position)
//     .. FinishStagedImport(slot)), LoadLayer(slot, layer, pages) per layer, in any order, from
//     device pages (a peer's mapped arena): the slot then holds, bit for bit on every row a
//     forward reads, what the host path (PagedState::LoadLayerRing into a staging, then
//     EnqueueStagedLayer) gives from the same page bytes; ImportSlot does the whole sequence.
//
// Thread-safety: one thread at a time per object, serialized with the model's other calls (as
// every GpuModel call). The device memory of the pages is the caller's; it must stay valid until
// the work enqueued here has run (P: the stream; D: FinishStagedImport's ordering, or
// StagedImportCopied).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "runtime/paged_state.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

// Device addresses of one sequence's state pages: pages[k][i] is the payload of
// PageTable::pages[k][i] (k in the layout's kind order, as SequencePages), page_bytes() of its
// kind, in memory the model's device can access (its own, or a peer's CUDA IPC mapping on the
// same device). A page need not be aligned; 16-byte aligned pages copy with 16-byte accesses.
struct DeviceSequencePages {
  std::vector<std::vector<std::byte*>> pages;
};

// Page checksums to compute on the GPU after the copies: out[i] = XXH3_64bits (seed 0) of the
// whole payload of pages[i] (page_bytes() of its kind; libxxhash's value, as
// kv::PayloadChecksum of the same bytes). `out`: device memory of pages.size() uint64 values.
// The protocol chooses the pages and their order (e.g. kv::PlanTransfer's pages of the layer,
// in slot order); empty: none.
struct DevicePageChecksums {
  std::span<const PagedState::PageId> pages;
  uint64_t* out = nullptr;
};

// The descriptor buffers DeviceStatePages' launches read (a ring of pinned / device pairs, each
// with the event of its last use) and the all-ones fill source of ImportSlotBatched, kept across
// DeviceStatePages objects. The workers make a DeviceStatePages per request (its total_tokens
// fixes the page plan); without shared buffers each of them allocated a pinned and a device
// buffer per layer on first use and freed them at its end (cudaFree waits for the whole device),
// a per-request cost the benchmark, which kept one object per length, never saw (docs/perf.md,
// "The fixed cost of a small transfer"). `mapped`: the kernels read the descriptors from the
// pinned buffers (unified addressing), so a launch enqueues no upload copy before it.
// Thread-safe: each launch holds the ring's mutex while it fills and enqueues its batch.
class DevicePageDescriptors {
 public:
  // `batches` >= 1: launches enqueued before one waits for a batch's previous use (the ring's
  // size; the models' layer count times two keeps a whole state's per-layer launches from
  // waiting). Internal for a CUDA error (an event).
  static absl::StatusOr<std::shared_ptr<DevicePageDescriptors>> Create(size_t batches, bool mapped);
  ~DevicePageDescriptors();
  DevicePageDescriptors(const DevicePageDescriptors&) = delete;
  DevicePageDescriptors& operator=(const DevicePageDescriptors&) = delete;

  bool mapped() const { return mapped_; }
  // Launches so far that had to grow a batch's buffers (allocations): after a warm-up of each
  // size, none (for tests and logs).
  uint64_t growths() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class DeviceStatePages;
  struct Batch;
  explicit DevicePageDescriptors(bool mapped);
  const bool mapped_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Batch>> batches_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t growths_ ABSL_GUARDED_BY(mu_) = 0;
  engine::gpu::DeviceArray<std::byte> ones_ ABSL_GUARDED_BY(mu_);
};

// Whether the workers keep their DevicePageDescriptors across requests (and the prefill engine
// its checksum buffers, storing all layers in one StoreLayers when not overlapping): true unless
// PDSERVE_DEVICE_PAGES=fresh, the A/B switch that restores a DeviceStatePages of its own buffers
// per request and a StoreLayer per layer (=kept or unset: true; another value is warned about and
// ignored, kernels/env_switch.h).
bool KeepDevicePageBuffers();

class DeviceStatePages {
 public:
  // For slots of `model` holding sequences of `total_tokens` tokens (prompt + max_tokens, which
  // fixes the entry pages of each layer, as PagedState) in pages of `layout`, which must be a
  // bf16 layout of the model's config (LayoutForModel(model->config(), E, kBfloat16)). `model`
  // and `layout` must outlive this object. InvalidArgument for an fp32 layout, a layout of other
  // dimensions or total_tokens outside [1, max_context]; Internal for a CUDA error (an event).
  // `descriptors`: the launches' buffers, shared with other objects (null: a ring of its own,
  // unmapped, one batch a layer).
  static absl::StatusOr<std::unique_ptr<DeviceStatePages>> Create(
      engine::gpu::GpuModel* model, const serving::StateLayout& layout, int64_t total_tokens,
      std::shared_ptr<DevicePageDescriptors> descriptors = nullptr);
  // Waits for the descriptor uploads still in flight when the buffers are its own (not for the
  // copies' streams otherwise).
  ~DeviceStatePages();
  DeviceStatePages(const DeviceStatePages&) = delete;
  DeviceStatePages& operator=(const DeviceStatePages&) = delete;

  const PagedState& paged() const { return paged_; }
  const serving::StateLayout& layout() const { return layout_; }
  // Every page of layer `layer` (PagedState::LayerPages: kind order, then page order), e.g. for
  // DevicePageChecksums::pages.
  std::vector<PagedState::PageId> LayerPages(int64_t layer) const {
    return paged_.LayerPages(layer);
  }

  // P's side: enqueues on `stream` (a cudaStream_t; null: the model's stream) the copies of layer
  // `layer` of slot `slot` at `position` into `pages` (exactly StoreLayerRing's bytes: the other
  // bytes of the pages are left as they were; one copy_pages launch), then `checksums` of those
  // pages (one xxh3_64_pages launch), and returns without waiting. REQUIRES: when `stream`
  // reaches the copies, the slot holds its state at `position` (e.g. Position(slot), or a
  // Forward to it enqueued before on the model's stream; a stream of the caller's waits for that
  // itself). InvalidArgument for a bad slot, layer or position (GpuModel::SlotLayerBlocks',
  // PagedState's) or checksum pages without `out`; OutOfRange when `pages` lacks a page the
  // layer's rows or a checksum name; Internal for a CUDA error. Nothing is enqueued on an error
  // found before the launches.
  absl::Status StoreLayer(int64_t slot, int64_t layer, int64_t position,
                          const DeviceSequencePages& pages,
                          const DevicePageChecksums& checksums = {}, void* stream = nullptr);

  // StoreLayer of every layer in one descriptor upload, one copy_pages and one xxh3_64_pages
  // launch (instead of one each a layer: docs/perf.md, "Device-to-device pages through the
  // protocol classes"); `checksums` may name pages of any layers, in any order. Same bytes and
  // checksums as StoreLayer of each layer; same errors (nothing enqueued on one).
  absl::Status StoreLayers(int64_t slot, int64_t position, const DeviceSequencePages& pages,
                           const DevicePageChecksums& checksums = {}, void* stream = nullptr);

  // D's side: layer `layer` of the staged import in progress on slot `slot` (at the position
  // BeginStagedImport gave) from `pages`, through GpuModel::EnqueueStagedLayerOnDevice: on the
  // model's import stream, the layer's unread rows set to NaN, then one copy_pages launch of
  // exactly LoadLayerRing's rows (window rows of the last min(p, W - 1) positions, the rings'
  // open-window rows and, for an overlapping compressor at p >= m, columns [0, dim) of the
  // previous window's rows, entry rows 0 .. p / m - 1), then `checksums` of the source pages
  // (what D compares with the page headers' checksums; the copies read the same bytes). Returns
  // without waiting; the caller finishes (or cancels) the import. Errors:
  // EnqueueStagedLayerOnDevice's (FailedPrecondition without a Begin or for a layer enqueued
  // twice), StoreLayer's for the pages and checksums (the caller cancels).
  absl::Status LoadLayer(int64_t slot, int64_t layer, const DeviceSequencePages& pages,
                         const DevicePageChecksums& checksums = {});

  // LoadLayer of each of `layers` (distinct, in range, none enqueued before) with their fills of
  // the unread rows in one copy_pages launch (from a buffer of all-ones bytes) and their copies in
  // one more, made in the last layer's GpuModel::EnqueueStagedLayerOnDeviceFills call (LoadLayer
  // enqueues seven fills and a copy launch a layer). The same rows, bit for bit. Errors:
  // LoadLayer's; on one, layers of the call may be marked enqueued without their copies, so the
  // caller cancels the import.
  absl::Status LoadLayers(int64_t slot, std::span<const int64_t> layers,
                          const DeviceSequencePages& pages);

  // BeginStagedImport(slot, position), LoadLayer of every layer, FinishStagedImport: slot `slot`
  // continues at `position` from `pages`. Does not wait for the copies (the model's next step
  // is ordered after them). On an error the import is cancelled (the slot reset) and the first
  // error returned.
  absl::Status ImportSlot(int64_t slot, int64_t position, const DeviceSequencePages& pages);
  // ImportSlot with LoadLayers of every layer (two launches for the whole state). The same slot,
  // bit for bit; the same errors.
  absl::Status ImportSlotBatched(int64_t slot, int64_t position, const DeviceSequencePages& pages);

  // Page bytes the runs of the last StoreLayer / LoadLayer copied (the state bytes of that layer
  // at its position, page tails and unused rows not counted).
  int64_t last_copied_bytes() const { return last_copied_bytes_; }

 private:
  DeviceStatePages(engine::gpu::GpuModel* model, const serving::StateLayout& layout,
                   int64_t total_tokens, std::shared_ptr<DevicePageDescriptors> descriptors);
  // The device copies of `runs` between `pages` and `blocks`, to_pages: block -> page, else
  // page -> block. OutOfRange for a missing page; Internal when an entry run falls outside the
  // slot's entry rows.
  struct Copy;
  absl::Status Resolve(const std::vector<PagedState::PageRun>& runs,
                       const DeviceSequencePages& pages,
                       const engine::gpu::DeviceLayerBlocks& blocks, bool to_pages,
                       std::vector<Copy>* copies) const;
  // Uploads the descriptors of `copies` and of `checksums`' pages (in `pages`) in one copy (none
  // with mapped descriptors), then launches copy_pages and xxh3_64_pages on `stream`. `fill`:
  // every copy's source is the all-ones buffer instead (its `from` ignored).
  absl::Status Launch(const std::vector<Copy>& copies, const DeviceSequencePages& pages,
                      const DevicePageChecksums& checksums, void* stream, bool fill = false);
  absl::StatusOr<std::byte*> PageAddress(const DeviceSequencePages& pages, serving::StateKind kind,
                                         int64_t page) const;

  engine::gpu::GpuModel* model_;
  const serving::StateLayout& layout_;
  PagedState paged_;
  engine::RingGeometry geometry_;
  std::shared_ptr<DevicePageDescriptors> descriptors_;
  int64_t last_copied_bytes_ = 0;
};

}  // namespace pdserve::runtime
