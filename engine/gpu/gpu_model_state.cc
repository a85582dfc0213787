// GpuModel::ExportState / ImportState: a slot's device blocks to and from the CPU engine's state
// layout, through the host ring image of engine/ring_state.h.
#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/gpu/gpu_model_impl.h"

namespace pdserve::engine::gpu {
namespace {

// Every pool is [slots + 1, per-slot elements]: slot s's block starts at s * per-slot.
template <typename T>
size_t PerSlot(const DeviceArray<T>& pool, int64_t slots) {
  return pool.size() / static_cast<size_t>(slots + 1);
}

template <typename T>
absl::Status Download(const DeviceArray<T>& pool, int64_t slots, int64_t slot, T* host,
                      cudaStream_t stream) {
  const size_t n = PerSlot(pool, slots);
  if (n == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(host, pool.get() + static_cast<size_t>(slot) * n, n * sizeof(T),
                                    cudaMemcpyDeviceToHost, stream),
                    "ExportState");
}

template <typename T>
absl::Status Upload(const T* host, int64_t slots, int64_t slot, DeviceArray<T>* pool,
                    cudaStream_t stream) {
  const size_t n = PerSlot(*pool, slots);
  if (n == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(pool->get() + static_cast<size_t>(slot) * n, host,
                                    n * sizeof(T), cudaMemcpyHostToDevice, stream),
                    "ImportState");
}

absl::Status CheckSlot(int64_t slot, int64_t slots) {
  if (slot >= 0 && slot < slots) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("GpuModel: slot ", slot, " outside [0, ", slots, ")"));
}

absl::Status CheckSize(size_t image, size_t device) {
  if (image == device) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("GpuModel: ring image of ", image, " values for a device block of ", device));
}

}  // namespace

ModelState GpuModel::NewState() const {
  // An image at position 0 always fits its own geometry.
  return *StateFromRingImage(impl_->geometry, NewRingImage(impl_->geometry));
}

absl::StatusOr<ModelState> GpuModel::ExportState(int64_t slot) {
  Impl& m = *impl_;
  const int64_t slots = m.options.slots;
  PDSERVE_RETURN_IF_ERROR(CheckSlot(slot, slots));
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  RingImage image = NewRingImage(m.geometry);
  image.position = m.slot_positions[static_cast<size_t>(slot)];
  std::vector<std::vector<bf16>> staged;  // bf16 blocks, converted after the copies land
  std::vector<std::vector<float>*> targets;
  // The window ring: the slot's block. The entries: the p / m written rows from the slot's pages
  // (the rest of the image is the fresh pool's NaN, all bits set).
  auto stage = [&](const DeviceArray<bf16>& pool, std::vector<float>* target) -> absl::Status {
    PDSERVE_RETURN_IF_ERROR(CheckSize(target->size(), PerSlot(pool, slots)));
    staged.emplace_back(target->size());
    targets.push_back(target);
    return Download(pool, slots, slot, staged.back().data(), m.stream);
  };
  auto stage_entries = [&](CompressorWeights& cw, std::vector<float>* target) -> absl::Status {
    PDSERVE_RETURN_IF_ERROR(CheckSize(target->size(), static_cast<size_t>(cw.capacity * cw.dim)));
    bf16 nan;  // the fresh pool's NaN: all bits set
    std::memset(static_cast<void*>(&nan), 0xFF, sizeof(nan));
    staged.emplace_back(target->size(), nan);
    targets.push_back(target);
    bf16* host = staged.back().data();
    const int64_t count = std::min(image.position / std::max<int64_t>(cw.rate, 1), cw.capacity);
    for (const auto& [from, n] : m.EntryRuns(cw, slot, count)) {
      const auto bytes = static_cast<size_t>(n * cw.dim) * sizeof(bf16);
      PDSERVE_CUDA_RETURN(cudaMemcpyAsync(host, from, bytes, cudaMemcpyDeviceToHost, m.stream));
      host += n * cw.dim;
    }
    return absl::OkStatus();
  };
  for (size_t l = 0; l < m.layers.size(); ++l) {
    Layer& layer = m.layers[l];
    RingLayerImage& out = image.layers[l];
    PDSERVE_RETURN_IF_ERROR(stage(layer.window_ring, &out.window));
    for (auto [cw, ci] : {std::pair{&layer.compressor, &out.compressor},
                          {&layer.indexer_compressor, &out.indexer}}) {
      PDSERVE_RETURN_IF_ERROR(CheckSize(ci->ring_kv.size(), PerSlot(cw->ring_kv, slots)));
      PDSERVE_RETURN_IF_ERROR(CheckSize(ci->ring_gate.size(), PerSlot(cw->ring_gate, slots)));
      PDSERVE_RETURN_IF_ERROR(Download(cw->ring_kv, slots, slot, ci->ring_kv.data(), m.stream));
      PDSERVE_RETURN_IF_ERROR(Download(cw->ring_gate, slots, slot, ci->ring_gate.data(), m.stream));
      PDSERVE_RETURN_IF_ERROR(stage_entries(*cw, &ci->entries));
    }
  }
  PDSERVE_CUDA_RETURN(cudaStreamSynchronize(m.stream));
  for (size_t i = 0; i < staged.size(); ++i) {
    std::vector<float>& target = *targets[i];
    for (size_t j = 0; j < target.size(); ++j) target[j] = __bfloat162float(staged[i][j]);
  }
  return StateFromRingImage(m.geometry, image);
}

absl::Status GpuModel::ImportState(int64_t slot, const ModelState& state) {
  Impl& m = *impl_;
  const int64_t slots = m.options.slots;
  PDSERVE_RETURN_IF_ERROR(CheckSlot(slot, slots));
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  PDSERVE_ASSIGN_OR_RETURN(
      RingImage image,
      RingImageFromState(m.geometry, state, std::numeric_limits<float>::quiet_NaN()));
  // Every size is checked before the first copy, so a mismatch leaves the slot untouched.
  for (size_t l = 0; l < m.layers.size(); ++l) {
    Layer& layer = m.layers[l];
    const RingLayerImage& in = image.layers[l];
    PDSERVE_RETURN_IF_ERROR(CheckSize(in.window.size(), PerSlot(layer.window_ring, slots)));
    for (auto [cw, ci] :
         {std::pair{&layer.compressor, &in.compressor}, {&layer.indexer_compressor, &in.indexer}}) {
      PDSERVE_RETURN_IF_ERROR(CheckSize(ci->ring_kv.size(), PerSlot(cw->ring_kv, slots)));
      PDSERVE_RETURN_IF_ERROR(CheckSize(ci->ring_gate.size(), PerSlot(cw->ring_gate, slots)));
      PDSERVE_RETURN_IF_ERROR(
          CheckSize(ci->entries.size(), static_cast<size_t>(cw->capacity * cw->dim)));
    }
  }
  if (state.position > m.max_context) {
    return absl::InvalidArgumentError(absl::StrCat("GpuModel: state at position ", state.position,
                                                   " past max_context ", m.max_context));
  }
  // The slot's old pages go back first, then it takes the pages of the imported position.
  PDSERVE_RETURN_IF_ERROR(ResetSlot(slot));
  PDSERVE_RETURN_IF_ERROR(m.GrowPages({{slot, state.position}}));
  std::vector<std::vector<bf16>> staged;  // alive until the copies are done
  auto to_bf16 = [&](const std::vector<float>& values) -> const bf16* {
    staged.emplace_back(values.size());
    for (size_t j = 0; j < values.size(); ++j) staged.back()[j] = __float2bfloat16_rn(values[j]);
    return staged.back().data();
  };
  for (size_t l = 0; l < m.layers.size(); ++l) {
    Layer& layer = m.layers[l];
    const RingLayerImage& in = image.layers[l];
    PDSERVE_RETURN_IF_ERROR(Upload(to_bf16(in.window), slots, slot, &layer.window_ring, m.stream));
    for (auto [cw, ci] :
         {std::pair{&layer.compressor, &in.compressor}, {&layer.indexer_compressor, &in.indexer}}) {
      PDSERVE_RETURN_IF_ERROR(Upload(ci->ring_kv.data(), slots, slot, &cw->ring_kv, m.stream));
      PDSERVE_RETURN_IF_ERROR(Upload(ci->ring_gate.data(), slots, slot, &cw->ring_gate, m.stream));
      if (cw->kind < 0) continue;
      const bf16* host = to_bf16(ci->entries);
      const int64_t count = std::min(state.position / cw->rate, cw->capacity);
      for (const auto& [to, n] : m.EntryRuns(*cw, slot, count)) {
        const auto bytes = static_cast<size_t>(n * cw->dim) * sizeof(bf16);
        PDSERVE_CUDA_RETURN(cudaMemcpyAsync(to, host, bytes, cudaMemcpyHostToDevice, m.stream));
        host += n * cw->dim;
      }
    }
  }
  PDSERVE_CUDA_RETURN(cudaStreamSynchronize(m.stream));
  m.slot_positions[static_cast<size_t>(slot)] = state.position;
  return absl::OkStatus();
}

}  // namespace pdserve::engine::gpu
