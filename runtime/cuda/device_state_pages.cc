#include "runtime/cuda/device_state_pages.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/gpu/device_memory.h"
#include "kernels/cuda/page_copy.cuh"
#include "kernels/cuda/xxh3.cuh"
#include "kernels/env_switch.h"

namespace pdserve::runtime {
namespace {

namespace kc = kernels::cuda;
using engine::gpu::CudaStatus;
using engine::gpu::DeviceArray;
using engine::gpu::PinnedArray;

// Bytes per value of the entry blocks (bf16).
constexpr int64_t kBf16 = 2;

}  // namespace

struct DeviceStatePages::Copy {
  const void* from = nullptr;
  void* to = nullptr;
  int64_t bytes = 0;
};

// One call's descriptors: [copies] PageCopy then [pages] Xxh3Page, pinned and (unless mapped) on
// the device; the event marks the end of the call's launches, after which the pinned half may be
// rewritten.
struct DevicePageDescriptors::Batch {
  PinnedArray<unsigned char> host;
  DeviceArray<unsigned char> device;
  unsigned char* mapped = nullptr;  // host's device address (mapped rings)
  cudaEvent_t event = nullptr;
  ~Batch() {
    if (event != nullptr) {
      cudaEventSynchronize(event);
      cudaEventDestroy(event);
    }
  }
};

DevicePageDescriptors::DevicePageDescriptors(bool mapped) : mapped_(mapped) {}
DevicePageDescriptors::~DevicePageDescriptors() = default;

absl::StatusOr<std::shared_ptr<DevicePageDescriptors>> DevicePageDescriptors::Create(size_t batches,
                                                                                     bool mapped) {
  if (batches < 1) return absl::InvalidArgumentError("DevicePageDescriptors: batches < 1");
  std::shared_ptr<DevicePageDescriptors> ring(new DevicePageDescriptors(mapped));
  absl::MutexLock lock(&ring->mu_);
  for (size_t i = 0; i < batches; ++i) {
    auto batch = std::make_unique<Batch>();
    PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(&batch->event, cudaEventDisableTiming));
    ring->batches_.push_back(std::move(batch));
  }
  return ring;
}

uint64_t DevicePageDescriptors::growths() const {
  absl::MutexLock lock(&mu_);
  return growths_;
}

bool KeepDevicePageBuffers() {
  return kernels::ReadSwitch("PDSERVE_DEVICE_PAGES", {{"kept", true}, {"fresh", false}}, true,
                             "the default, kept");
}

DeviceStatePages::DeviceStatePages(engine::gpu::GpuModel* model, const serving::StateLayout& layout,
                                   int64_t total_tokens,
                                   std::shared_ptr<DevicePageDescriptors> descriptors)
    : model_(model),
      layout_(layout),
      paged_(model->config(), layout, total_tokens),
      // The run plan reads the window and compressor geometry only, not the entry capacity (so
      // the entry page size passed here does not matter).
      geometry_(engine::RingGeometryFor(model->config(), model->max_context(), 64)),
      descriptors_(std::move(descriptors)) {}

DeviceStatePages::~DeviceStatePages() = default;

absl::StatusOr<std::unique_ptr<DeviceStatePages>> DeviceStatePages::Create(
    engine::gpu::GpuModel* model, const serving::StateLayout& layout, int64_t total_tokens,
    std::shared_ptr<DevicePageDescriptors> descriptors) {
  if (model == nullptr) return absl::InvalidArgumentError("DeviceStatePages: no model");
  if (layout.dims().element != serving::ElementType::kBfloat16) {
    return absl::InvalidArgumentError(
        "DeviceStatePages: device pages are copied as bytes, so they need a bf16 layout (the "
        "CUDA engine's storage)");
  }
  PDSERVE_ASSIGN_OR_RETURN(const serving::StateLayout own,
                           LayoutForModel(model->config(), layout.dims().entries_per_page,
                                          serving::ElementType::kBfloat16));
  const serving::StateDims& a = own.dims();
  const serving::StateDims& b = layout.dims();
  if (a.sliding_layers != b.sliding_layers || a.csa_layers != b.csa_layers ||
      a.hca_layers != b.hca_layers || a.head_dim != b.head_dim ||
      a.index_head_dim != b.index_head_dim || a.sliding_window != b.sliding_window ||
      a.compress_rate_csa != b.compress_rate_csa || a.compress_rate_hca != b.compress_rate_hca) {
    return absl::InvalidArgumentError("DeviceStatePages: the layout is not the model's");
  }
  if (total_tokens < 1 || total_tokens > model->max_context()) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceStatePages: total_tokens ", total_tokens,
                                                   " outside [1, max_context ",
                                                   model->max_context(), "]"));
  }
  if (descriptors == nullptr) {
    // One batch per layer: a whole state's layers are enqueued without waiting for an upload.
    PDSERVE_ASSIGN_OR_RETURN(
        descriptors,
        DevicePageDescriptors::Create(
            static_cast<size_t>(std::max(model->config().num_hidden_layers, int64_t{1})),
            /*mapped=*/false));
  }
  return std::unique_ptr<DeviceStatePages>(
      new DeviceStatePages(model, layout, total_tokens, std::move(descriptors)));
}

absl::StatusOr<std::byte*> DeviceStatePages::PageAddress(const DeviceSequencePages& pages,
                                                         serving::StateKind kind,
                                                         int64_t page) const {
  const std::optional<int32_t> k = layout_.KindIndex(kind);
  if (!k || static_cast<size_t>(*k) >= pages.pages.size() || page < 0 ||
      page >= static_cast<int64_t>(pages.pages[static_cast<size_t>(*k)].size()) ||
      pages.pages[static_cast<size_t>(*k)][static_cast<size_t>(page)] == nullptr) {
    return absl::OutOfRangeError(
        absl::StrCat("device pages: no ", serving::StateKindName(kind), " page ", page));
  }
  return pages.pages[static_cast<size_t>(*k)][static_cast<size_t>(page)];
}

absl::Status DeviceStatePages::Resolve(const std::vector<PagedState::PageRun>& runs,
                                       const DeviceSequencePages& pages,
                                       const engine::gpu::DeviceLayerBlocks& blocks, bool to_pages,
                                       std::vector<Copy>* copies) const {
  using Run = PagedState::PageRun;
  const std::array<void*, 7> flat = {blocks.window,
                                     nullptr,
                                     nullptr,
                                     blocks.compressor.ring_kv,
                                     blocks.compressor.ring_gate,
                                     blocks.indexer.ring_kv,
                                     blocks.indexer.ring_gate};
  // Byte offsets in the logical entries block where each device entry run starts, and the end.
  auto run_starts = [](const engine::gpu::DeviceCompressorBlocks& c) {
    std::vector<int64_t> starts = {0};
    for (const engine::gpu::DeviceEntryRun& d : c.entries) {
      starts.push_back(starts.back() + d.rows * c.dim * kBf16);
    }
    return starts;
  };
  const std::vector<int64_t> entry_starts = run_starts(blocks.compressor);
  const std::vector<int64_t> key_starts = run_starts(blocks.indexer);
  auto add = [&](std::byte* page, void* block, int64_t bytes) {
    copies->push_back(to_pages ? Copy{block, page, bytes} : Copy{page, block, bytes});
  };
  for (const Run& run : runs) {
    PDSERVE_ASSIGN_OR_RETURN(std::byte* const page_base, PageAddress(pages, run.kind, run.page));
    std::byte* page = page_base + run.page_offset;
    if (run.block != Run::kEntries && run.block != Run::kIndexerEntries) {
      add(page, static_cast<std::byte*>(flat[run.block]) + run.block_offset, run.bytes);
      continue;
    }
    // Entry rows live in the slot's entry pages: the run splits where a device run ends.
    const bool keys = run.block == Run::kIndexerEntries;
    const engine::gpu::DeviceCompressorBlocks& c = keys ? blocks.indexer : blocks.compressor;
    const std::vector<int64_t>& starts = keys ? key_starts : entry_starts;
    int64_t at = run.block_offset;  // bytes into the logical entries block
    int64_t left = run.bytes;
    // The device run holding byte `at`: the last one starting at or before it.
    auto d =
        static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), at) - starts.begin());
    for (d = d == 0 ? 0 : d - 1; left > 0 && d < c.entries.size(); ++d) {
      const int64_t end = starts[d + 1];
      if (at >= end) continue;
      const int64_t n = std::min(left, end - at);
      add(page, static_cast<std::byte*>(c.entries[d].data) + (at - starts[d]), n);
      page += n;
      at += n;
      left -= n;
    }
    if (left > 0) {
      return absl::InternalError(absl::StrCat("device pages: entry bytes ", at, " .. ", at + left,
                                              " past the slot's ", starts.back(), " entry bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceStatePages::Launch(const std::vector<Copy>& copies,
                                      const DeviceSequencePages& pages,
                                      const DevicePageChecksums& checksums, void* stream,
                                      bool fill) {
  const auto on = static_cast<cudaStream_t>(stream);
  if (!checksums.pages.empty() && checksums.out == nullptr) {
    return absl::InvalidArgumentError("DeviceStatePages: checksum pages without an output array");
  }
  std::vector<kc::Xxh3Page> hashes;
  for (const PagedState::PageId& id : checksums.pages) {
    PDSERVE_ASSIGN_OR_RETURN(std::byte* const page, PageAddress(pages, id.kind, id.page));
    hashes.push_back({page, static_cast<uint64_t>(layout_.Kind(id.kind).page_bytes())});
  }
  DevicePageDescriptors& ring = *descriptors_;
  absl::MutexLock lock(&ring.mu_);
  DevicePageDescriptors::Batch& batch = *ring.batches_[ring.next_];
  ring.next_ = (ring.next_ + 1) % ring.batches_.size();
  const size_t copy_bytes = copies.size() * sizeof(kc::PageCopy);
  // Xxh3Page is 16 bytes, PageCopy 24: the hash descriptors start 16-aligned after the copies.
  const size_t hash_at = (copy_bytes + 15) / 16 * 16;
  const size_t bytes = hash_at + hashes.size() * sizeof(kc::Xxh3Page);
  // The batch's previous launches have read its descriptors before they are rewritten.
  PDSERVE_CUDA_RETURN(cudaEventSynchronize(batch.event));
  if (batch.host.size() < bytes) {
    ++ring.growths_;
    const size_t grown = std::max(bytes, 2 * batch.host.size());
    batch.mapped = nullptr;
    PDSERVE_RETURN_IF_ERROR(batch.host.Allocate(grown));
    if (ring.mapped_) {
      void* device = nullptr;
      PDSERVE_CUDA_RETURN(cudaHostGetDevicePointer(&device, batch.host.get(), 0));
      batch.mapped = static_cast<unsigned char*>(device);
    } else {
      PDSERVE_RETURN_IF_ERROR(batch.device.Allocate(grown));
    }
  }
  const void* from_ones = nullptr;
  if (fill) {
    int64_t most = 0;
    for (const Copy& f : copies) most = std::max(most, f.bytes);
    if (static_cast<int64_t>(ring.ones_.size()) < most) {
      ++ring.growths_;
      PDSERVE_RETURN_IF_ERROR(ring.ones_.Allocate(static_cast<size_t>(most)));
      // Waited for: the buffer is shared by launches on other streams.
      PDSERVE_CUDA_RETURN(cudaMemsetAsync(ring.ones_.get(), 0xFF, static_cast<size_t>(most), on));
      PDSERVE_CUDA_RETURN(cudaStreamSynchronize(on));
    }
    from_ones = ring.ones_.get();
  }
  auto* descriptors = reinterpret_cast<kc::PageCopy*>(batch.host.get());
  last_copied_bytes_ = 0;
  for (size_t i = 0; i < copies.size(); ++i) {
    descriptors[i] = {fill ? from_ones : copies[i].from, copies[i].to,
                      static_cast<uint64_t>(copies[i].bytes)};
    last_copied_bytes_ += copies[i].bytes;
  }
  if (!hashes.empty()) {
    std::memcpy(batch.host.get() + hash_at, hashes.data(), hashes.size() * sizeof(kc::Xxh3Page));
  }
  unsigned char* read_from = batch.mapped;
  if (!ring.mapped_) {
    read_from = batch.device.get();
    if (bytes > 0) {
      PDSERVE_CUDA_RETURN(
          cudaMemcpyAsync(batch.device.get(), batch.host.get(), bytes, cudaMemcpyHostToDevice, on));
    }
  }
  absl::Status launched =
      CudaStatus(kc::copy_pages(reinterpret_cast<const kc::PageCopy*>(read_from),
                                static_cast<int64_t>(copies.size()), on),
                 "copy_pages");
  if (launched.ok() && !hashes.empty()) {
    launched =
        CudaStatus(kc::xxh3_64_pages(reinterpret_cast<const kc::Xxh3Page*>(read_from + hash_at),
                                     static_cast<int64_t>(hashes.size()), checksums.out, on),
                   "xxh3_64_pages");
  }
  // Recorded whatever failed: the upload (and a copy) enqueued above read the batch's buffers,
  // which its next use rewrites only once this event passed.
  const absl::Status recorded = CudaStatus(cudaEventRecord(batch.event, on), "cudaEventRecord");
  PDSERVE_RETURN_IF_ERROR(launched);
  return recorded;
}

absl::Status DeviceStatePages::StoreLayer(int64_t slot, int64_t layer, int64_t position,
                                          const DeviceSequencePages& pages,
                                          const DevicePageChecksums& checksums, void* stream) {
  PDSERVE_ASSIGN_OR_RETURN(const engine::gpu::DeviceLayerBlocks blocks,
                           model_->SlotLayerBlocks(slot, layer, position));
  PDSERVE_ASSIGN_OR_RETURN(
      const std::vector<PagedState::PageRun> runs,
      paged_.PlanPageRuns(layer, geometry_.layers[static_cast<size_t>(layer)], position));
  std::vector<Copy> copies;
  PDSERVE_RETURN_IF_ERROR(Resolve(runs, pages, blocks, /*to_pages=*/true, &copies));
  return Launch(copies, pages, checksums, stream != nullptr ? stream : model_->cuda_stream());
}

absl::Status DeviceStatePages::StoreLayers(int64_t slot, int64_t position,
                                           const DeviceSequencePages& pages,
                                           const DevicePageChecksums& checksums, void* stream) {
  std::vector<Copy> copies;
  for (size_t l = 0; l < geometry_.layers.size(); ++l) {
    const auto layer = static_cast<int64_t>(l);
    PDSERVE_ASSIGN_OR_RETURN(const engine::gpu::DeviceLayerBlocks blocks,
                             model_->SlotLayerBlocks(slot, layer, position));
    PDSERVE_ASSIGN_OR_RETURN(const std::vector<PagedState::PageRun> runs,
                             paged_.PlanPageRuns(layer, geometry_.layers[l], position));
    PDSERVE_RETURN_IF_ERROR(Resolve(runs, pages, blocks, /*to_pages=*/true, &copies));
  }
  return Launch(copies, pages, checksums, stream != nullptr ? stream : model_->cuda_stream());
}

absl::Status DeviceStatePages::LoadLayer(int64_t slot, int64_t layer,
                                         const DeviceSequencePages& pages,
                                         const DevicePageChecksums& checksums) {
  if (layer < 0 || layer >= static_cast<int64_t>(geometry_.layers.size())) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceStatePages: layer ", layer,
                                                   " outside [0, ", geometry_.layers.size(), ")"));
  }
  return model_->EnqueueStagedLayerOnDevice(
      slot, layer,
      [&](const engine::gpu::DeviceLayerBlocks& blocks, int64_t position,
          void* stream) -> absl::Status {
        PDSERVE_ASSIGN_OR_RETURN(
            const std::vector<PagedState::PageRun> runs,
            paged_.PlanPageRuns(layer, geometry_.layers[static_cast<size_t>(layer)], position));
        std::vector<Copy> copies;
        PDSERVE_RETURN_IF_ERROR(Resolve(runs, pages, blocks, /*to_pages=*/false, &copies));
        return Launch(copies, pages, checksums, stream);
      });
}

absl::Status DeviceStatePages::ImportSlot(int64_t slot, int64_t position,
                                          const DeviceSequencePages& pages) {
  PDSERVE_RETURN_IF_ERROR(model_->BeginStagedImport(slot, position));
  absl::Status status;
  for (size_t l = 0; l < geometry_.layers.size() && status.ok(); ++l) {
    status = LoadLayer(slot, static_cast<int64_t>(l), pages);
  }
  if (status.ok()) status = model_->FinishStagedImport(slot);
  if (!status.ok()) model_->CancelStagedImport(slot).IgnoreError();
  return status;
}

absl::Status DeviceStatePages::LoadLayers(int64_t slot, std::span<const int64_t> layers,
                                          const DeviceSequencePages& pages) {
  std::vector<Copy> fills;
  std::vector<Copy> copies;
  for (size_t i = 0; i < layers.size(); ++i) {
    const int64_t layer = layers[i];
    if (layer < 0 || layer >= static_cast<int64_t>(geometry_.layers.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DeviceStatePages: layer ", layer, " outside [0, ", geometry_.layers.size(), ")"));
    }
    const absl::Status enqueued = model_->EnqueueStagedLayerOnDeviceFills(
        slot, layer,
        [&](const engine::gpu::DeviceLayerBlocks& blocks, int64_t at,
            const std::vector<engine::gpu::GpuModel::DeviceFill>& layer_fills,
            void* stream) -> absl::Status {
          PDSERVE_ASSIGN_OR_RETURN(
              const std::vector<PagedState::PageRun> runs,
              paged_.PlanPageRuns(layer, geometry_.layers[static_cast<size_t>(layer)], at));
          PDSERVE_RETURN_IF_ERROR(Resolve(runs, pages, blocks, /*to_pages=*/false, &copies));
          for (const engine::gpu::GpuModel::DeviceFill& f : layer_fills)
            fills.push_back({nullptr, f.to, f.bytes});
          if (i + 1 < layers.size()) return absl::OkStatus();
          // The last layer: every layer's fills, then every layer's copies over them.
          PDSERVE_RETURN_IF_ERROR(Launch(fills, pages, {}, stream, /*fill=*/true));
          return Launch(copies, pages, {}, stream);
        });
    PDSERVE_RETURN_IF_ERROR(enqueued);
  }
  return absl::OkStatus();
}

absl::Status DeviceStatePages::ImportSlotBatched(int64_t slot, int64_t position,
                                                 const DeviceSequencePages& pages) {
  PDSERVE_RETURN_IF_ERROR(model_->BeginStagedImport(slot, position));
  std::vector<int64_t> every(geometry_.layers.size());
  for (size_t l = 0; l < every.size(); ++l) every[l] = static_cast<int64_t>(l);
  absl::Status status = LoadLayers(slot, every, pages);
  if (status.ok()) status = model_->FinishStagedImport(slot);
  if (!status.ok()) model_->CancelStagedImport(slot).IgnoreError();
  return status;
}

}  // namespace pdserve::runtime
