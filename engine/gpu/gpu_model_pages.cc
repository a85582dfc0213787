// GpuModel's paged state: the page tables of the compressed entries and indexer keys
// (serving/slot_page_tables.h), their device rows, growth before a step, release, the paranoid
// check and the slot copy.
#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/gpu/gpu_model_impl.h"

namespace pdserve::engine::gpu {

absl::Status GpuModel::Impl::MakePages() {
  const ModelConfig& c = config;
  const int64_t slots = options.slots;
  serving::SlotPageTablesOptions o;
  o.slots = slots;
  o.page_entries = kPageSize;
  o.fixed = !options.paged_state;
  for (LayerType type : c.layer_types) {
    const int64_t rate = c.CompressRate(type);
    if (rate <= 0 || kind_of_rate.contains(rate)) continue;
    kind_of_rate[rate] = static_cast<int64_t>(o.kinds.size());
    const int64_t capacity = RingEntryCapacity(max_context, rate, kPageSize);
    const int64_t per_slot = capacity / kPageSize;
    int64_t pool = slots * per_slot;
    if (options.state_tokens > 0) {
      const int64_t want = (options.state_tokens / rate + kPageSize - 1) / kPageSize + slots;
      pool = std::min(pool, want);
    }
    o.kinds.push_back({absl::StrCat("rate", rate), rate, capacity, std::max<int64_t>(pool, 1)});
  }
  if (o.kinds.empty()) return absl::OkStatus();  // sliding layers only: nothing grows
  PDSERVE_ASSIGN_OR_RETURN(pages, serving::SlotPageTables::Create(std::move(o)));
  for (int64_t k = 0; k < pages->num_kinds(); ++k) {
    const size_t n = std::max<size_t>(pages->Rows(k).size(), 1);
    slot_pages.push_back(std::make_unique<DeviceArray<int32_t>>());
    slot_pages_host.push_back(std::make_unique<PinnedArray<int32_t>>());
    PDSERVE_RETURN_IF_ERROR(slot_pages.back()->Allocate(n));
    PDSERVE_RETURN_IF_ERROR(slot_pages_host.back()->Allocate(n));
  }
  PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(&pages_uploaded, cudaEventDisableTiming));
  return UploadPageRows();
}

absl::Status GpuModel::Impl::UploadPageRows() {
  if (pages == nullptr) return absl::OkStatus();
  const std::vector<int64_t> dirty = pages->TakeDirty();
  if (dirty.empty()) return absl::OkStatus();
  // The pinned rows of the last upload may still be in flight.
  PDSERVE_CUDA_RETURN(cudaEventSynchronize(pages_uploaded));
  for (int64_t k = 0; k < pages->num_kinds(); ++k) {
    const int64_t stride = pages->stride(k);
    if (stride == 0) continue;
    int32_t* host = slot_pages_host[static_cast<size_t>(k)]->get();
    int32_t* device = slot_pages[static_cast<size_t>(k)]->get();
    for (int64_t s : dirty) {
      std::span<const int32_t> row = pages->Row(k, s);
      std::memcpy(host + s * stride, row.data(), row.size() * sizeof(int32_t));
      PDSERVE_CUDA_RETURN(cudaMemcpyAsync(device + s * stride, host + s * stride,
                                          row.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                          stream));
    }
  }
  PDSERVE_CUDA_RETURN(cudaEventRecord(pages_uploaded, stream));
  return absl::OkStatus();
}

absl::Status GpuModel::Impl::GrowPages(const std::vector<std::pair<int64_t, int64_t>>& targets) {
  if (pages == nullptr) return absl::OkStatus();
  PDSERVE_RETURN_IF_ERROR(pages->Grow(targets));
  return UploadPageRows();
}

std::vector<std::pair<bf16*, int64_t>> GpuModel::Impl::EntryRuns(CompressorWeights& cw,
                                                                 int64_t slot,
                                                                 int64_t count) const {
  std::vector<std::pair<bf16*, int64_t>> runs;
  if (count <= 0 || cw.kind < 0) return runs;
  std::span<const int32_t> row = pages->Row(cw.kind, slot);
  int64_t next_row = -1;  // the device row just past the last run
  for (int64_t e = 0; e < count; e += kPageSize) {
    const int64_t n = std::min<int64_t>(kPageSize, count - e);
    const int64_t first = int64_t{row[static_cast<size_t>(e / kPageSize)]} * kPageSize;
    if (!runs.empty() && first == next_row) {
      runs.back().second += n;
    } else {
      runs.push_back({cw.entries.get() + first * cw.dim, n});
    }
    next_row = first + n;
  }
  return runs;
}

absl::StatusOr<DeviceLayerBlocks> GpuModel::SlotLayerBlocks(int64_t slot, int64_t layer,
                                                            int64_t position) {
  Impl& m = *impl_;
  const int64_t slots = m.options.slots;
  if (slot < 0 || slot >= slots || layer < 0 || layer >= static_cast<int64_t>(m.layers.size()) ||
      position < 0 || position > m.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GpuModel: slot ", slot, " / layer ", layer, " / position ", position, " outside [0, ",
        slots, ") / [0, ", m.layers.size(), ") / [0, max_context ", m.max_context, "]"));
  }
  // The caller's copies run on this device (its current one after this call).
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  const RingLayerGeometry& g = m.geometry.layers[static_cast<size_t>(layer)];
  Layer& device = m.layers[static_cast<size_t>(layer)];
  // Every pool is [slots + 1, per-slot elements]: slot s's block starts at s * per-slot.
  auto block = [&](auto& pool, int64_t want) -> absl::StatusOr<decltype(pool.get())> {
    const auto n = static_cast<int64_t>(pool.size()) / (slots + 1);
    if (n != want) {
      return absl::InternalError(
          absl::StrCat("GpuModel: a device block of ", n, " values where the layout has ", want));
    }
    return pool.get() + slot * n;
  };
  DeviceLayerBlocks out;
  PDSERVE_ASSIGN_OR_RETURN(out.window, block(device.window_ring, g.window * g.head_dim));
  for (auto [cg, cw, to] : {std::tuple{&g.compressor, &device.compressor, &out.compressor},
                            std::tuple{&g.indexer, &device.indexer_compressor, &out.indexer}}) {
    if (!cg->present()) continue;
    const int64_t ring = 2 * cg->rate * cg->width();
    PDSERVE_ASSIGN_OR_RETURN(to->ring_kv, block(cw->ring_kv, ring));
    PDSERVE_ASSIGN_OR_RETURN(to->ring_gate, block(cw->ring_gate, ring));
    to->dim = cg->dim;
    const int64_t count = std::min(position / cg->rate, cg->entry_capacity);
    if (count == 0 || cw->kind < 0) continue;
    if (m.pages->held(cw->kind, slot) * kPageSize < count) {
      return absl::InvalidArgumentError(
          absl::StrCat("GpuModel: slot ", slot, " holds ", m.pages->held(cw->kind, slot),
                       " entry pages of rate ", cg->rate, ", position ", position, " needs ",
                       (count + kPageSize - 1) / kPageSize));
    }
    bf16* end = nullptr;
    for (const auto& [data, rows] : m.EntryRuns(*cw, slot, count)) {
      to->entries.push_back({data, rows});
      end = data + rows * cw->dim;
    }
    to->tail_rows = (kPageSize - count % kPageSize) % kPageSize;
    to->tail = to->tail_rows > 0 ? end : nullptr;
  }
  return out;
}

bool GpuModel::CanHold(const std::vector<std::pair<int64_t, int64_t>>& slot_positions) const {
  const Impl& m = *impl_;
  for (const auto& [slot, position] : slot_positions) {
    if (slot < 0 || slot >= m.options.slots || position < 0 || position > m.max_context) {
      return false;
    }
  }
  return m.pages == nullptr || m.pages->CanGrow(slot_positions);
}

std::vector<StatePageKind> GpuModel::StatePages() const {
  const Impl& m = *impl_;
  std::vector<StatePageKind> out;
  if (m.pages == nullptr) return out;
  for (int64_t k = 0; k < m.pages->num_kinds(); ++k) {
    StatePageKind kind;
    kind.rate = m.pages->kind(k).rate;
    kind.page_entries = kPageSize;
    kind.pages_total = m.pages->device_pages(k) - 1;
    kind.pages_free = m.pages->pages_free(k);
    for (const Layer& layer : m.layers) {
      for (const CompressorWeights* cw : {&layer.compressor, &layer.indexer_compressor}) {
        if (cw->kind == k) kind.bytes_per_page += kPageSize * cw->dim * int64_t{sizeof(bf16)};
      }
    }
    out.push_back(kind);
  }
  return out;
}

absl::Status GpuModel::VerifySlotPages(int64_t slot) const {
  const Impl& m = *impl_;
  if (slot < 0 || slot >= m.options.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", m.options.slots, ")"));
  }
  return m.pages == nullptr ? absl::OkStatus() : m.pages->Verify(slot);
}

absl::Status GpuModel::InjectForeignPageForTest(int64_t victim, int64_t donor) {
  Impl& m = *impl_;
  if (m.pages == nullptr) return absl::FailedPreconditionError("GpuModel: no paged state");
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  PDSERVE_RETURN_IF_ERROR(m.pages->InjectForeignPageForTest(victim, donor));
  return m.UploadPageRows();
}

absl::Status GpuModel::ResetSlot(int64_t slot) {
  Impl& m = *impl_;
  if (slot < 0 || slot >= m.options.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", m.options.slots, ")"));
  }
  m.slot_positions[static_cast<size_t>(slot)] = 0;
  if (m.pages == nullptr) return absl::OkStatus();
  // The pages go back before any device call: a device error leaves the slot's row dirty (the
  // next upload writes it), never its pages held by an empty slot.
  PDSERVE_RETURN_IF_ERROR(m.pages->Release(slot));
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  return m.UploadPageRows();
}

void GpuModel::FailDeviceSelectionForTest(int64_t calls) { impl_->use_device_faults = calls; }

absl::Status GpuModel::CopySlot(int64_t from, int64_t to) {
  Impl& m = *impl_;
  const int64_t n = m.options.slots;
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  if (from < 0 || from >= n || to < 0 || to >= n || from == to) {
    return absl::InvalidArgumentError(absl::StrCat("GpuModel: CopySlot(", from, ", ", to,
                                                   ") needs two distinct slots in [0, ", n, ")"));
  }
  const int64_t position = m.slot_positions[static_cast<size_t>(from)];
  PDSERVE_RETURN_IF_ERROR(ResetSlot(to));
  PDSERVE_RETURN_IF_ERROR(m.GrowPages({{to, position}}));
  // The per-slot pools are [slots + 1, per-slot rows...]: one contiguous block per slot.
  auto copy = [&](auto& pool) -> absl::Status {
    if (pool.size() == 0) return absl::OkStatus();
    const size_t per_slot = pool.size() / static_cast<size_t>(n + 1) * sizeof(*pool.get());
    auto* base = reinterpret_cast<unsigned char*>(pool.get());
    return CudaStatus(cudaMemcpyAsync(base + static_cast<size_t>(to) * per_slot,
                                      base + static_cast<size_t>(from) * per_slot, per_slot,
                                      cudaMemcpyDeviceToDevice, m.stream),
                      "CopySlot");
  };
  for (Layer& layer : m.layers) {
    PDSERVE_RETURN_IF_ERROR(copy(layer.window_ring));
    for (CompressorWeights* cw : {&layer.compressor, &layer.indexer_compressor}) {
      PDSERVE_RETURN_IF_ERROR(copy(cw->ring_kv));
      PDSERVE_RETURN_IF_ERROR(copy(cw->ring_gate));
      if (cw->kind < 0) continue;
      // The entries written so far, page by page (the two slots' pages differ).
      const int64_t count = std::min(position / cw->rate, cw->capacity);
      std::span<const int32_t> src = m.pages->Row(cw->kind, from);
      std::span<const int32_t> dst = m.pages->Row(cw->kind, to);
      for (int64_t e = 0; e < count; e += kPageSize) {
        const auto i = static_cast<size_t>(e / kPageSize);
        const int64_t rows = std::min<int64_t>(kPageSize, count - e);
        PDSERVE_CUDA_RETURN(
            cudaMemcpyAsync(cw->entries.get() + int64_t{dst[i]} * kPageSize * cw->dim,
                            cw->entries.get() + int64_t{src[i]} * kPageSize * cw->dim,
                            static_cast<size_t>(rows * cw->dim) * sizeof(bf16),
                            cudaMemcpyDeviceToDevice, m.stream));
      }
    }
  }
  PDSERVE_CUDA_RETURN(cudaStreamSynchronize(m.stream));
  m.slot_positions[static_cast<size_t>(to)] = position;
  return absl::OkStatus();
}

}  // namespace pdserve::engine::gpu
