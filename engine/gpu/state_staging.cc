// StateStaging and GpuModel::ExportLayerAsync / NewStateStaging / StagingLayerBytes: a slot's
// state copied layer by layer into pinned host memory, one event per layer buffer.
#include "engine/gpu/state_staging.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/gpu/gpu_model_impl.h"
#include "engine/ring_state.h"

namespace pdserve::engine::gpu {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of one compressor's blocks in a layer buffer.
struct CompressorOffsets {
  size_t ring_kv = 0;
  size_t ring_gate = 0;
  size_t entries = 0;
};

// Where a layer's blocks sit in its buffer (each block 256-byte aligned), and the bytes in all.
struct LayerOffsets {
  size_t window = 0;
  CompressorOffsets compressor;
  CompressorOffsets indexer;
  size_t end = 0;
};

void PlaceCompressor(const RingCompressorGeometry& g, size_t* at, CompressorOffsets* out) {
  if (!g.present()) return;
  const size_t ring = static_cast<size_t>(2 * g.rate * g.width()) * sizeof(float);
  out->ring_kv = *at;
  out->ring_gate = *at += AlignUp(ring);
  out->entries = *at += AlignUp(ring);
  *at += AlignUp(static_cast<size_t>(g.entry_capacity * g.dim) * sizeof(bf16));
}

LayerOffsets OffsetsOf(const RingLayerGeometry& g) {
  LayerOffsets o;
  size_t at = AlignUp(static_cast<size_t>(g.window * g.head_dim) * sizeof(bf16));
  PlaceCompressor(g.compressor, &at, &o.compressor);
  PlaceCompressor(g.indexer, &at, &o.indexer);
  o.end = at;
  return o;
}

size_t LargestLayerBytes(const RingGeometry& geometry) {
  size_t bytes = 0;
  for (const RingLayerGeometry& g : geometry.layers) bytes = std::max(bytes, OffsetsOf(g).end);
  return bytes;
}

// Every pool is [slots + 1, per-slot elements]: slot s's block starts at s * per-slot.
template <typename T>
const T* SlotBlock(const DeviceArray<T>& pool, int64_t slots, int64_t slot, size_t want,
                   absl::Status* status) {
  const size_t n = pool.size() / static_cast<size_t>(slots + 1);
  if (n != want && status->ok()) {
    *status = absl::InternalError(
        absl::StrCat("GpuModel: a device block of ", n, " values where the layout has ", want));
  }
  return pool.get() + static_cast<size_t>(slot) * n;
}

template <typename T>
T* MutableSlotBlock(DeviceArray<T>* pool, int64_t slots, int64_t slot, size_t want,
                    absl::Status* status) {
  return const_cast<T*>(SlotBlock(*pool, slots, slot, want, status));
}

// Rounds values[0, n) to bf16 (round to nearest even, as ImportState) into `out`.
void ToBf16(const float* values, size_t n, unsigned char* out) {
  bf16* to = reinterpret_cast<bf16*>(out);
  for (size_t i = 0; i < n; ++i) to[i] = __float2bfloat16_rn(values[i]);
}

// Layer `g`'s blocks in the pinned buffer at `base`, every ring row set to the fresh pool's NaN
// (the entry blocks are left: only their written rows are copied), for an import's fill.
MutableRingLayerBlocks PrepareImportBlocks(const RingLayerGeometry& g, unsigned char* base) {
  const float unread = std::numeric_limits<float>::quiet_NaN();
  uint16_t unread_bf16;
  ToBf16(&unread, 1, reinterpret_cast<unsigned char*>(&unread_bf16));
  const LayerOffsets o = OffsetsOf(g);
  auto blocks = [&](const RingCompressorGeometry& cg, const CompressorOffsets& c) {
    if (!cg.present()) return MutableRingCompressorBlocks{};
    const auto ring = static_cast<size_t>(2 * cg.rate * cg.width());
    auto* kv = reinterpret_cast<float*>(base + c.ring_kv);
    auto* gate = reinterpret_cast<float*>(base + c.ring_gate);
    std::fill_n(kv, ring, unread);
    std::fill_n(gate, ring, unread);
    return MutableRingCompressorBlocks{kv, gate, reinterpret_cast<uint16_t*>(base + c.entries)};
  };
  MutableRingLayerBlocks to;
  to.window = reinterpret_cast<uint16_t*>(base + o.window);
  std::fill_n(to.window, static_cast<size_t>(g.window * g.head_dim), unread_bf16);
  to.compressor = blocks(g.compressor, o.compressor);
  to.indexer = blocks(g.indexer, o.indexer);
  return to;
}

}  // namespace

struct StateStaging::Impl {
  // A layer buffer: which layer's copy it holds (-1: free) at which slot position.
  struct Buffer {
    cudaEvent_t event = nullptr;
    int64_t layer = -1;
    int64_t position = 0;
    int64_t import_layer = -1;  // FillImportLayer's layer until EnqueueStagedLayer copies it
  };

  const GpuModel* owner = nullptr;
  RingGeometry geometry;
  size_t buffer_bytes = 0;
  size_t copied_bytes = 0;
  PinnedArray<unsigned char> memory;  // [buffers, buffer_bytes]
  std::vector<Buffer> buffers;
  size_t next_import = 0;  // the buffer FillImportLayer takes next, modulo buffers

  ~Impl() {
    // Copies in flight either way (export or import) read or write the pinned memory.
    for (Buffer& b : buffers) {
      if (b.event != nullptr) cudaEventSynchronize(b.event);
      if (b.event != nullptr) cudaEventDestroy(b.event);
    }
  }
  Buffer& For(int64_t layer) { return buffers[static_cast<size_t>(layer) % buffers.size()]; }
  unsigned char* Base(int64_t layer) {
    return memory.get() + static_cast<size_t>(layer) % buffers.size() * buffer_bytes;
  }
};

StateStaging::StateStaging(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StateStaging::~StateStaging() = default;

int64_t StateStaging::buffers() const { return static_cast<int64_t>(impl_->buffers.size()); }
size_t StateStaging::pinned_bytes() const { return impl_->memory.size(); }
size_t StateStaging::copied_bytes() const { return impl_->copied_bytes; }

bool StateStaging::Holds(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(impl_->geometry.layers.size())) return false;
  return impl_->For(layer).layer == layer;
}

absl::StatusOr<LayerState> StateStaging::TakeLayer(int64_t layer) {
  PDSERVE_ASSIGN_OR_RETURN(const LayerBlocks taken, TakeLayerBlocks(layer));
  return LayerStateFromRingBlocks(*taken.geometry, taken.blocks, taken.position);
}

absl::StatusOr<StateStaging::LayerBlocks> StateStaging::TakeLayerBlocks(int64_t layer) {
  Impl& s = *impl_;
  if (!Holds(layer)) {
    return absl::FailedPreconditionError(
        absl::StrCat("StateStaging: layer ", layer, " is not held (not exported, or taken)"));
  }
  Impl::Buffer& buffer = s.For(layer);
  buffer.layer = -1;
  PDSERVE_CUDA_RETURN(cudaEventSynchronize(buffer.event));
  const RingLayerGeometry& g = s.geometry.layers[static_cast<size_t>(layer)];
  const LayerOffsets o = OffsetsOf(g);
  const unsigned char* base = s.Base(layer);
  auto compressor = [&](const CompressorOffsets& c) {
    return RingCompressorBlocks{reinterpret_cast<const float*>(base + c.ring_kv),
                                reinterpret_cast<const float*>(base + c.ring_gate),
                                reinterpret_cast<const uint16_t*>(base + c.entries)};
  };
  LayerBlocks taken;
  taken.geometry = &g;
  taken.blocks.window = reinterpret_cast<const uint16_t*>(base + o.window);
  taken.blocks.compressor = compressor(o.compressor);
  taken.blocks.indexer = compressor(o.indexer);
  taken.position = buffer.position;
  return taken;
}

absl::Status StateStaging::Discard() {
  absl::Status status;
  for (Impl::Buffer& b : impl_->buffers) {
    b.import_layer = -1;
    if (b.layer < 0) continue;
    b.layer = -1;
    const absl::Status s = CudaStatus(cudaEventSynchronize(b.event), "StateStaging::Discard");
    if (status.ok()) status = s;
  }
  return status;
}

size_t GpuModel::StagingLayerBytes() const { return LargestLayerBytes(impl_->geometry); }

absl::StatusOr<std::unique_ptr<StateStaging>> GpuModel::NewStateStaging(int64_t buffers) const {
  const auto layers = static_cast<int64_t>(impl_->layers.size());
  if (buffers < 1 || buffers > layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: ", buffers, " staging buffers outside [1, ", layers, " layers]"));
  }
  PDSERVE_RETURN_IF_ERROR(impl_->UseDevice());
  auto s = std::make_unique<StateStaging::Impl>();
  s->owner = this;
  s->geometry = impl_->geometry;
  s->buffer_bytes = LargestLayerBytes(s->geometry);
  s->buffers.resize(static_cast<size_t>(buffers));
  for (StateStaging::Impl::Buffer& b : s->buffers) {
    PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(&b.event, cudaEventDisableTiming));
  }
  PDSERVE_RETURN_IF_ERROR(s->memory.Allocate(static_cast<size_t>(buffers) * s->buffer_bytes));
  return std::unique_ptr<StateStaging>(new StateStaging(std::move(s)));
}

absl::Status GpuModel::ExportLayerAsync(int64_t slot, int64_t layer, StateStaging* staging) {
  Impl& m = *impl_;
  if (slot < 0 || slot >= m.options.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", m.options.slots, ")"));
  }
  // Between BeginForwardExporting and FinishForward a layer's copy need not wait for the whole
  // chunk: on the copy stream after that layer's attention (its state is final there).
  if (m.pending.has_value() && m.attended_slot == slot && layer >= 0 &&
      layer < static_cast<int64_t>(m.layer_attended.size())) {
    PDSERVE_RETURN_IF_ERROR(m.UseDevice());
    PDSERVE_CUDA_RETURN(
        cudaStreamWaitEvent(m.copy_stream, m.layer_attended[static_cast<size_t>(layer)], 0));
    return ExportLayer(slot, layer, staging, m.slot_positions[static_cast<size_t>(slot)],
                       /*on_copy_stream=*/true);
  }
  return ExportLayer(slot, layer, staging, m.slot_positions[static_cast<size_t>(slot)],
                     /*on_copy_stream=*/false);
}

absl::StatusOr<Tensor> GpuModel::ForwardExporting(int64_t slot, const std::vector<int32_t>& tokens,
                                                  StateStaging* staging, ChunkLogits rows) {
  PDSERVE_RETURN_IF_ERROR(BeginForwardExporting(slot, tokens, staging, rows));
  return FinishForward();
}

absl::Status GpuModel::BeginForwardExporting(int64_t slot, const std::vector<int32_t>& tokens,
                                             StateStaging* staging, ChunkLogits rows) {
  Impl& m = *impl_;
  if (staging == nullptr || staging->impl_->owner != this) {
    return absl::InvalidArgumentError("GpuModel: the staging was not made by this model");
  }
  if (slot < 0 || slot >= m.options.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", m.options.slots, ")"));
  }
  const auto layers = static_cast<int64_t>(m.layers.size());
  const int64_t count = std::min(staging->buffers(), layers);
  for (int64_t l = 0; l < count; ++l) {
    const int64_t held = staging->impl_->For(l).layer;
    if (held >= 0) {
      return absl::FailedPreconditionError(absl::StrCat("StateStaging: the buffer of layer ", l,
                                                        " still holds layer ", held,
                                                        " (take or discard it first)"));
    }
  }
  // The first `count` layers' copies are enqueued right after their attention.
  return BeginForwardMarked(slot, tokens, rows, [&](int64_t layer, int64_t position) {
    if (layer >= count) return absl::OkStatus();
    PDSERVE_CUDA_RETURN(
        cudaStreamWaitEvent(m.copy_stream, m.layer_attended[static_cast<size_t>(layer)], 0));
    return ExportLayer(slot, layer, staging, position, /*on_copy_stream=*/true);
  });
}

absl::Status GpuModel::BeginForwardMarked(
    int64_t slot, const std::vector<int32_t>& tokens, ChunkLogits rows,
    const std::function<absl::Status(int64_t layer, int64_t position)>& marked) {
  Impl& m = *impl_;
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  PDSERVE_RETURN_IF_ERROR(m.MakeLayerMarks());
  // The position the copies describe: the slot's after this call (Forward refuses before any
  // layer is enqueued if the chunk does not fit).
  const int64_t position =
      m.slot_positions[static_cast<size_t>(slot)] + static_cast<int64_t>(tokens.size());
  // Every layer's attention is marked (ExportLayerAsync of a later layer waits for its mark
  // until FinishForward).
  m.after_attention = [&](int64_t layer) -> absl::Status {
    PDSERVE_CUDA_RETURN(cudaEventRecord(m.layer_attended[static_cast<size_t>(layer)], m.stream));
    return marked(layer, position);
  };
  const absl::Status begun = BeginForward(slot, tokens, /*group_rows=*/0, rows);
  m.after_attention = nullptr;
  m.attended_slot = begun.ok() ? slot : -1;
  return begun;
}

absl::Status GpuModel::Impl::MakeLayerMarks() {
  if (copy_stream == nullptr) {
    PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(&copies_enqueued, cudaEventDisableTiming));
    PDSERVE_CUDA_RETURN(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  }
  while (layer_attended.size() < layers.size()) {
    cudaEvent_t event = nullptr;
    PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    layer_attended.push_back(event);
  }
  return absl::OkStatus();
}

absl::Status GpuModel::BeginForwardStoring(int64_t slot, const std::vector<int32_t>& tokens,
                                           const LayerFinal& layer_final, ChunkLogits rows) {
  Impl& m = *impl_;
  if (slot < 0 || slot >= m.options.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", m.options.slots, ")"));
  }
  return BeginForwardMarked(slot, tokens, rows, [&](int64_t layer, int64_t position) {
    PDSERVE_CUDA_RETURN(
        cudaStreamWaitEvent(m.copy_stream, m.layer_attended[static_cast<size_t>(layer)], 0));
    return layer_final(layer, position, m.copy_stream);
  });
}

absl::Status GpuModel::ExportLayer(int64_t slot, int64_t layer, StateStaging* staging,
                                   int64_t position, bool on_copy_stream) {
  Impl& m = *impl_;
  const int64_t slots = m.options.slots;
  if (layer < 0 || layer >= static_cast<int64_t>(m.layers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: layer ", layer, " outside [0, ", m.layers.size(), ")"));
  }
  if (staging == nullptr || staging->impl_->owner != this) {
    return absl::InvalidArgumentError("GpuModel: the staging was not made by this model");
  }
  StateStaging::Impl& s = *staging->impl_;
  StateStaging::Impl::Buffer& buffer = s.For(layer);
  if (buffer.layer >= 0) {
    return absl::FailedPreconditionError(absl::StrCat("StateStaging: the buffer of layer ", layer,
                                                      " still holds layer ", buffer.layer,
                                                      " (take or discard it first)"));
  }
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  const cudaStream_t on = on_copy_stream ? m.copy_stream : m.stream;
  const RingLayerGeometry& g = m.geometry.layers[static_cast<size_t>(layer)];
  const LayerOffsets o = OffsetsOf(g);
  Layer& device = m.layers[static_cast<size_t>(layer)];
  unsigned char* base = s.Base(layer);
  absl::Status layout;
  size_t bytes = 0;
  struct Copy {
    void* to;
    const void* from;
    size_t bytes;
  };
  std::vector<Copy> copies;  // every block's place is checked before the first copy
  auto add = [&](size_t offset, const void* from, size_t n) {
    if (n == 0) return;
    copies.push_back({base + offset, from, n});
    bytes += n;
  };
  add(o.window,
      SlotBlock(device.window_ring, slots, slot, static_cast<size_t>(g.window * g.head_dim),
                &layout),
      static_cast<size_t>(g.window * g.head_dim) * sizeof(bf16));
  for (auto [cg, cw, co] : {std::tuple{&g.compressor, &device.compressor, &o.compressor},
                            std::tuple{&g.indexer, &device.indexer_compressor, &o.indexer}}) {
    if (!cg->present()) continue;
    const auto ring = static_cast<size_t>(2 * cg->rate * cg->width());
    const auto capacity = static_cast<size_t>(cg->entry_capacity * cg->dim);
    add(co->ring_kv, SlotBlock(cw->ring_kv, slots, slot, ring, &layout), ring * sizeof(float));
    add(co->ring_gate, SlotBlock(cw->ring_gate, slots, slot, ring, &layout), ring * sizeof(float));
    // Only the entries emitted so far, from the slot's pages; the rest of the block is never read
    // from this state.
    if (cw->capacity * cw->dim != static_cast<int64_t>(capacity) && layout.ok()) {
      layout = absl::InternalError("GpuModel: an entry pool of another layout");
    }
    size_t at = co->entries;
    for (const auto& [from, n] :
         m.EntryRuns(*cw, slot, std::min(position / cg->rate, cg->entry_capacity))) {
      const auto run_bytes = static_cast<size_t>(n * cg->dim) * sizeof(bf16);
      add(at, from, run_bytes);
      at += run_bytes;
    }
  }
  PDSERVE_RETURN_IF_ERROR(layout);
  for (const Copy& c : copies) {
    PDSERVE_CUDA_RETURN(cudaMemcpyAsync(c.to, c.from, c.bytes, cudaMemcpyDeviceToHost, on));
  }
  PDSERVE_CUDA_RETURN(cudaEventRecord(buffer.event, on));
  buffer.layer = layer;
  buffer.position = position;
  s.copied_bytes += bytes;
  return absl::OkStatus();
}

absl::Status GpuModel::ImportState(int64_t slot, const ModelState& state, StateStaging* staging) {
  PDSERVE_RETURN_IF_ERROR(ValidateRingState(impl_->geometry, state));
  // Window and compressor rings through the layer's image; the entry blocks straight from the
  // state (only its p / m rows are converted).
  auto fill = [&state](int64_t layer, const RingLayerGeometry& g,
                       const MutableRingLayerBlocks& to) -> absl::Status {
    const LayerState& from = state.layers[static_cast<size_t>(layer)];
    const RingLayerImage image =
        LayerRingImage(g, from, state.position, std::numeric_limits<float>::quiet_NaN(),
                       /*entries=*/false);
    ToBf16(image.window.data(), image.window.size(), reinterpret_cast<unsigned char*>(to.window));
    for (auto [ci, cs, ct] : {std::tuple{&image.compressor, &from.compressor, &to.compressor},
                              std::tuple{&image.indexer, &from.indexer, &to.indexer}}) {
      if (ci->ring_kv.empty()) continue;
      std::memcpy(ct->ring_kv, ci->ring_kv.data(), ci->ring_kv.size() * sizeof(float));
      std::memcpy(ct->ring_gate, ci->ring_gate.data(), ci->ring_gate.size() * sizeof(float));
      ToBf16(cs->entries.data.data(), cs->entries.data.size(),
             reinterpret_cast<unsigned char*>(ct->entries));
    }
    return absl::OkStatus();
  };
  return ImportLayers(slot, state.position, staging, fill);
}

absl::Status GpuModel::CheckImport(int64_t slot, int64_t position) {
  Impl& m = *impl_;
  const int64_t slots = m.options.slots;
  if (slot < 0 || slot >= slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", slots, ")"));
  }
  if (position < 0 || position > m.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GpuModel: state at position ", position, " outside [0, max_context ", m.max_context, "]"));
  }
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  // Every device block's size is checked before the first copy, so a mismatch leaves the slot
  // untouched.
  absl::Status layout;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const RingLayerGeometry& g = m.geometry.layers[l];
    Layer& device = m.layers[l];
    SlotBlock(device.window_ring, slots, slot, static_cast<size_t>(g.window * g.head_dim), &layout);
    for (auto [cg, cw] : {std::pair{&g.compressor, &device.compressor},
                          std::pair{&g.indexer, &device.indexer_compressor}}) {
      if (!cg->present()) continue;
      const auto ring = static_cast<size_t>(2 * cg->rate * cg->width());
      SlotBlock(cw->ring_kv, slots, slot, ring, &layout);
      SlotBlock(cw->ring_gate, slots, slot, ring, &layout);
      if (cw->capacity != cg->entry_capacity || cw->dim != cg->dim) {
        return absl::InternalError("GpuModel: an entry pool of another layout");
      }
    }
  }
  PDSERVE_RETURN_IF_ERROR(layout);
  return absl::OkStatus();
}

absl::Status GpuModel::ImportLayers(int64_t slot, int64_t position, StateStaging* staging,
                                    const LayerImageFill& fill) {
  Impl& m = *impl_;
  const int64_t slots = m.options.slots;
  if (slot < 0 || slot >= slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", slots, ")"));
  }
  if (staging == nullptr || staging->impl_->owner != this) {
    return absl::InvalidArgumentError("GpuModel: the staging was not made by this model");
  }
  StateStaging::Impl& s = *staging->impl_;
  for (const StateStaging::Impl::Buffer& b : s.buffers) {
    if (b.layer >= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "StateStaging: a buffer still holds exported layer ", b.layer, " (take or discard it)"));
    }
  }
  PDSERVE_RETURN_IF_ERROR(CheckImport(slot, position));
  // The slot's old pages go back first, then it takes the pages of the imported position.
  PDSERVE_RETURN_IF_ERROR(ResetSlot(slot));
  PDSERVE_RETURN_IF_ERROR(m.GrowPages({{slot, position}}));
  absl::Status status;
  for (size_t l = 0; l < m.layers.size() && status.ok(); ++l) {
    const auto layer = static_cast<int64_t>(l);
    StateStaging::Impl::Buffer& buffer = s.For(layer);
    // The buffer's previous layer (layer - buffers) must have reached the device.
    status = CudaStatus(cudaEventSynchronize(buffer.event), "ImportLayers");
    if (!status.ok()) break;
    unsigned char* base = s.Base(layer);
    status = fill(layer, m.geometry.layers[l], PrepareImportBlocks(m.geometry.layers[l], base));
    if (!status.ok()) break;
    status = EnqueueImportCopies(slot, position, layer, base, m.stream, &s.copied_bytes);
    if (status.ok()) status = CudaStatus(cudaEventRecord(buffer.event, m.stream), "ImportLayers");
  }
  // Every copy has landed (or failed) before the buffers are reused or freed.
  const absl::Status synced = CudaStatus(cudaStreamSynchronize(m.stream), "ImportLayers");
  if (!status.ok() || !synced.ok()) {
    // A refused or failed fill leaves no partial state behind: the slot is cleared again.
    const absl::Status reset = ResetSlot(slot);
    PDSERVE_RETURN_IF_ERROR(status);
    PDSERVE_RETURN_IF_ERROR(synced);
    return reset;
  }
  m.slot_positions[static_cast<size_t>(slot)] = position;
  return absl::OkStatus();
}

absl::Status GpuModel::EnqueueImportCopies(int64_t slot, int64_t position, int64_t layer,
                                           const unsigned char* base, void* stream,
                                           size_t* copied) {
  Impl& m = *impl_;
  const auto on = static_cast<cudaStream_t>(stream);
  const int64_t slots = m.options.slots;
  const RingLayerGeometry& g = m.geometry.layers[static_cast<size_t>(layer)];
  const LayerOffsets o = OffsetsOf(g);
  Layer& device = m.layers[static_cast<size_t>(layer)];
  absl::Status status;
  absl::Status layout;
  auto copy = [&](void* dst, size_t offset, size_t bytes) {
    if (bytes == 0 || !status.ok()) return;
    status = CudaStatus(cudaMemcpyAsync(dst, base + offset, bytes, cudaMemcpyHostToDevice, on),
                        "ImportLayers");
    *copied += bytes;
  };
  const auto window = static_cast<size_t>(g.window * g.head_dim);
  copy(MutableSlotBlock(&device.window_ring, slots, slot, window, &layout), o.window,
       window * sizeof(bf16));
  for (auto [cg, cw, co] : {std::tuple{&g.compressor, &device.compressor, &o.compressor},
                            std::tuple{&g.indexer, &device.indexer_compressor, &o.indexer}}) {
    if (!cg->present()) continue;
    const auto ring = static_cast<size_t>(2 * cg->rate * cg->width());
    copy(MutableSlotBlock(&cw->ring_kv, slots, slot, ring, &layout), co->ring_kv,
         ring * sizeof(float));
    copy(MutableSlotBlock(&cw->ring_gate, slots, slot, ring, &layout), co->ring_gate,
         ring * sizeof(float));
    // Into the slot's pages; the unwritten rows of its last page get the fresh pool's NaN (all
    // bits set).
    const int64_t count = std::min(position / cg->rate, cg->entry_capacity);
    size_t at = co->entries;
    bf16* end = nullptr;
    for (const auto& [dst, n] : m.EntryRuns(*cw, slot, count)) {
      const auto run_bytes = static_cast<size_t>(n * cg->dim) * sizeof(bf16);
      copy(dst, at, run_bytes);
      at += run_bytes;
      end = dst + n * cg->dim;
    }
    const int64_t tail = (kPageSize - count % kPageSize) % kPageSize;
    if (status.ok() && end != nullptr && tail > 0) {
      status = CudaStatus(
          cudaMemsetAsync(end, 0xFF, static_cast<size_t>(tail * cg->dim) * sizeof(bf16), on),
          "ImportLayers");
    }
  }
  PDSERVE_RETURN_IF_ERROR(layout);
  return status;
}

// ---- The staged import (GpuModel::BeginStagedImport) ---------------------------------------

absl::Status StateStaging::FillImportLayer(int64_t layer, int64_t position,
                                           const LayerImageFill& fill) {
  Impl& s = *impl_;
  if (layer < 0 || layer >= static_cast<int64_t>(s.geometry.layers.size())) {
    return absl::InvalidArgumentError(absl::StrCat("StateStaging: layer ", layer, " outside [0, ",
                                                   s.geometry.layers.size(), ")"));
  }
  if (position < 0) {
    return absl::InvalidArgumentError(absl::StrCat("StateStaging: position ", position));
  }
  const size_t index = s.next_import % s.buffers.size();
  Impl::Buffer& buffer = s.buffers[index];
  if (buffer.layer >= 0 || buffer.import_layer >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "StateStaging: the next import buffer still holds layer ",
        std::max(buffer.layer, buffer.import_layer), " (enqueue, take or discard it first)"));
  }
  // Its last import copy (an earlier layer) must have reached the device.
  PDSERVE_CUDA_RETURN(cudaEventSynchronize(buffer.event));
  const RingLayerGeometry& g = s.geometry.layers[static_cast<size_t>(layer)];
  unsigned char* base = s.memory.get() + index * s.buffer_bytes;
  PDSERVE_RETURN_IF_ERROR(fill(layer, g, PrepareImportBlocks(g, base)));
  buffer.import_layer = layer;
  buffer.position = position;
  ++s.next_import;
  return absl::OkStatus();
}

namespace {

// Slot `slot`'s staged import in progress in model impl `m` (GpuModel::Impl): InvalidArgument
// for a bad slot, FailedPrecondition when none is in progress.
template <typename ModelImpl>
auto StagedImportOf(ModelImpl& m, int64_t slot) -> absl::StatusOr<decltype(&m.staged_imports[0])> {
  if (slot < 0 || slot >= m.options.slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: slot ", slot, " outside [0, ", m.options.slots, ")"));
  }
  if (m.staged_imports.empty() || !m.staged_imports[static_cast<size_t>(slot)].active) {
    return absl::FailedPreconditionError(
        absl::StrCat("GpuModel: slot ", slot, " has no staged import in progress"));
  }
  return &m.staged_imports[static_cast<size_t>(slot)];
}

}  // namespace

absl::Status GpuModel::BeginStagedImport(int64_t slot, int64_t position) {
  Impl& m = *impl_;
  PDSERVE_RETURN_IF_ERROR(CheckImport(slot, position));
  if (m.staged_imports.empty()) m.staged_imports.resize(static_cast<size_t>(m.options.slots));
  Impl::StagedImport& import = m.staged_imports[static_cast<size_t>(slot)];
  if (import.active) {
    return absl::FailedPreconditionError(
        absl::StrCat("GpuModel: slot ", slot, " is already importing"));
  }
  if (m.import_stream == nullptr) {
    PDSERVE_CUDA_RETURN(cudaStreamCreateWithFlags(&m.import_stream, cudaStreamNonBlocking));
  }
  for (cudaEvent_t* e : {&import.begun, &import.copied}) {
    if (*e == nullptr) PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  // The slot's old pages go back first, then it takes the pages of the imported position; the
  // copies wait for everything the model enqueued before (the pages' last readers included).
  PDSERVE_RETURN_IF_ERROR(ResetSlot(slot));
  PDSERVE_RETURN_IF_ERROR(m.GrowPages({{slot, position}}));
  absl::Status ordered = CudaStatus(cudaEventRecord(import.begun, m.stream), "BeginStagedImport");
  if (ordered.ok()) {
    ordered =
        CudaStatus(cudaStreamWaitEvent(m.import_stream, import.begun, 0), "BeginStagedImport");
  }
  if (!ordered.ok()) {
    PDSERVE_RETURN_IF_ERROR(ResetSlot(slot));
    return ordered;
  }
  import.active = true;
  import.position = position;
  import.enqueued.assign(m.layers.size(), 0);
  import.left = static_cast<int64_t>(m.layers.size());
  return absl::OkStatus();
}

absl::Status GpuModel::EnqueueStagedLayer(int64_t slot, int64_t layer, StateStaging* staging) {
  Impl& m = *impl_;
  PDSERVE_ASSIGN_OR_RETURN(Impl::StagedImport* const staged, StagedImportOf(m, slot));
  Impl::StagedImport& import = *staged;
  if (layer < 0 || layer >= static_cast<int64_t>(m.layers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: layer ", layer, " outside [0, ", m.layers.size(), ")"));
  }
  if (staging == nullptr || staging->impl_->owner != this) {
    return absl::InvalidArgumentError("GpuModel: the staging was not made by this model");
  }
  if (import.enqueued[static_cast<size_t>(layer)]) {
    return absl::FailedPreconditionError(
        absl::StrCat("GpuModel: layer ", layer, " of slot ", slot, "'s import was enqueued"));
  }
  StateStaging::Impl& s = *staging->impl_;
  size_t index = s.buffers.size();
  for (size_t b = 0; b < s.buffers.size(); ++b) {
    if (s.buffers[b].import_layer == layer && s.buffers[b].position == import.position) index = b;
  }
  if (index == s.buffers.size()) {
    return absl::FailedPreconditionError(absl::StrCat("GpuModel: layer ", layer, " at position ",
                                                      import.position, " was not filled"));
  }
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  StateStaging::Impl::Buffer& buffer = s.buffers[index];
  const unsigned char* base = s.memory.get() + index * s.buffer_bytes;
  PDSERVE_RETURN_IF_ERROR(
      EnqueueImportCopies(slot, import.position, layer, base, m.import_stream, &s.copied_bytes));
  PDSERVE_CUDA_RETURN(cudaEventRecord(buffer.event, m.import_stream));
  buffer.import_layer = -1;
  import.enqueued[static_cast<size_t>(layer)] = 1;
  if (--import.left == 0) PDSERVE_CUDA_RETURN(cudaEventRecord(import.copied, m.import_stream));
  return absl::OkStatus();
}

absl::Status GpuModel::EnqueueStagedLayerOnDevice(int64_t slot, int64_t layer,
                                                  const DeviceLayerEnqueue& enqueue) {
  Impl& m = *impl_;
  return EnqueueStagedLayerOnDeviceFills(
      slot, layer,
      [&](const DeviceLayerBlocks& blocks, int64_t position, const std::vector<DeviceFill>& fills,
          void* stream) -> absl::Status {
        for (const DeviceFill& fill : fills) {
          PDSERVE_RETURN_IF_ERROR(CudaStatus(
              cudaMemsetAsync(fill.to, 0xFF, static_cast<size_t>(fill.bytes), m.import_stream),
              "EnqueueStagedLayerOnDevice"));
        }
        return enqueue(blocks, position, stream);
      });
}

absl::Status GpuModel::EnqueueStagedLayerOnDeviceFills(int64_t slot, int64_t layer,
                                                       const DeviceLayerEnqueueFills& enqueue) {
  Impl& m = *impl_;
  PDSERVE_ASSIGN_OR_RETURN(Impl::StagedImport* const staged, StagedImportOf(m, slot));
  Impl::StagedImport& import = *staged;
  if (layer < 0 || layer >= static_cast<int64_t>(m.layers.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuModel: layer ", layer, " outside [0, ", m.layers.size(), ")"));
  }
  if (import.enqueued[static_cast<size_t>(layer)]) {
    return absl::FailedPreconditionError(
        absl::StrCat("GpuModel: layer ", layer, " of slot ", slot, "'s import was enqueued"));
  }
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  PDSERVE_ASSIGN_OR_RETURN(const DeviceLayerBlocks blocks,
                           SlotLayerBlocks(slot, layer, import.position));
  // The unread rows as a fresh pool's (ImportLayers' NaN, another payload): whole blocks first,
  // then the copies of the rows a forward reads land over them in stream order.
  const RingLayerGeometry& g = m.geometry.layers[static_cast<size_t>(layer)];
  std::vector<DeviceFill> fills;
  auto fill = [&](void* to, int64_t bytes) {
    if (to != nullptr && bytes > 0) fills.push_back({to, bytes});
  };
  fill(blocks.window, g.window * g.head_dim * static_cast<int64_t>(sizeof(bf16)));
  for (auto [cg, cb] :
       {std::pair{&g.compressor, &blocks.compressor}, std::pair{&g.indexer, &blocks.indexer}}) {
    if (!cg->present()) continue;
    const int64_t ring = 2 * cg->rate * cg->width() * static_cast<int64_t>(sizeof(float));
    fill(cb->ring_kv, ring);
    fill(cb->ring_gate, ring);
    fill(cb->tail, cb->tail_rows * cb->dim * static_cast<int64_t>(sizeof(bf16)));
  }
  PDSERVE_RETURN_IF_ERROR(enqueue(blocks, import.position, fills, m.import_stream));
  import.enqueued[static_cast<size_t>(layer)] = 1;
  if (--import.left == 0) PDSERVE_CUDA_RETURN(cudaEventRecord(import.copied, m.import_stream));
  return absl::OkStatus();
}

absl::StatusOr<bool> GpuModel::StagedImportCopied(int64_t slot) {
  Impl& m = *impl_;
  PDSERVE_ASSIGN_OR_RETURN(const Impl::StagedImport* const import, StagedImportOf(m, slot));
  if (import->left > 0) return false;
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  const cudaError_t done = cudaEventQuery(import->copied);
  if (done == cudaErrorNotReady) return false;
  PDSERVE_CUDA_RETURN(done);
  return true;
}

absl::Status GpuModel::FinishStagedImport(int64_t slot) {
  Impl& m = *impl_;
  PDSERVE_ASSIGN_OR_RETURN(Impl::StagedImport* const staged, StagedImportOf(m, slot));
  Impl::StagedImport& import = *staged;
  if (import.left > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("GpuModel: slot ", slot, "'s import still lacks ", import.left, " layers"));
  }
  PDSERVE_RETURN_IF_ERROR(m.UseDevice());
  // The next step reads the slot only after its copies, whether or not they are done yet.
  PDSERVE_CUDA_RETURN(cudaStreamWaitEvent(m.stream, import.copied, 0));
  import.active = false;
  m.slot_positions[static_cast<size_t>(slot)] = import.position;
  return absl::OkStatus();
}

absl::Status GpuModel::CancelStagedImport(int64_t slot) {
  Impl& m = *impl_;
  PDSERVE_ASSIGN_OR_RETURN(Impl::StagedImport* const import, StagedImportOf(m, slot));
  import->active = false;
  // Copies still landing write the slot's pages: they finish before the pages go back. The
  // pages go back whatever failed (a device that cannot be selected or synchronized lands no
  // more copies), as ResetSlot gives them back before its own device calls.
  absl::Status synced = m.UseDevice();
  if (synced.ok()) {
    synced = CudaStatus(cudaStreamSynchronize(m.import_stream), "CancelStagedImport");
  }
  const absl::Status reset = ResetSlot(slot);
  PDSERVE_RETURN_IF_ERROR(synced);
  return reset;
}

}  // namespace pdserve::engine::gpu
