// Page-locked (pinned) host memory that one slot's state is copied into layer by layer, so the
// host can convert, store and send layer L while the device still copies later layers
// (GpuModel::ExportLayerAsync; docs/protocol.md, "Prefill on the CUDA engine").
//
// A staging holds `buffers` layer buffers, each sized for the largest layer of the model at
// GpuModel::max_context (window ring [W, hd] bf16, each compressor's rings [2m, width] fp32 and
// entries [capacity, dim] bf16), allocated once with cudaMallocHost; layer L uses buffer
// L % buffers. The protocol, per layer: GpuModel::ExportLayerAsync(slot, L, staging) enqueues the
// device-to-host copies of L's blocks on the model's stream (after every kernel already enqueued
// there, so the copy sees the state of the last Forward) and records the buffer's event;
// TakeLayer(L) waits for that event and returns L's state in the CPU engine's layout, freeing the
// buffer for layer L + buffers. Only the rows a CPU state holds are converted; of the entries only
// rows 0 .. position / m - 1 are copied.
//
// The same buffers carry states the other way: GpuModel::ImportState(slot, state, staging)
// converts layer by layer into them and copies each to the device while converting the next.
//
// Thread-safety: not thread-safe; one caller at a time, as the GpuModel that made it. The staging
// must not outlive that GpuModel. Its destructor waits for copies still in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/ring_state.h"
#include "engine/state.h"

namespace pdserve::engine::gpu {

class GpuModel;

// Writes layer `layer`'s blocks at the import's position into host memory (`blocks`, a pinned
// staging buffer laid out for `geometry`, the model's layer): the rows a forward reads of the
// window ring (bf16 bits) and both compressors' rings (fp32), and entry rows
// 0 .. position / m - 1 (bf16 bits). Every other ring row already holds the fresh pool's NaN
// and may be left alone. A non-OK status stops the import.
using LayerImageFill = std::function<absl::Status(int64_t layer, const RingLayerGeometry& geometry,
                                                  const MutableRingLayerBlocks& blocks)>;

class StateStaging {
 public:
  ~StateStaging();
  StateStaging(const StateStaging&) = delete;
  StateStaging& operator=(const StateStaging&) = delete;

  int64_t buffers() const;
  // Pinned bytes held (buffers() x the largest layer's blocks at max_context).
  size_t pinned_bytes() const;
  // Bytes enqueued since creation: device to host by ExportLayerAsync, host to device by
  // ImportState through this staging.
  size_t copied_bytes() const;
  // Whether layer `layer`'s copy was enqueued and not yet taken.
  bool Holds(int64_t layer) const;

  // Waits for layer `layer`'s copy (enqueued by ExportLayerAsync) and returns its state at the
  // slot's position when the copy was enqueued, in the CPU engine's layout (engine/state.h),
  // equal bit for bit to GpuModel::ExportState's layer at that point. Frees the layer's buffer.
  // FailedPrecondition when the layer is not held (never exported here, or already taken);
  // Internal for a CUDA error (the buffer is freed).
  absl::StatusOr<LayerState> TakeLayer(int64_t layer);

  // Layer `layer`'s blocks as the device stores them (bf16 window ring and entries, fp32
  // compressor rings), seen in the pinned buffer: what a caller that stores them as they are
  // (runtime::PagedState::StoreLayerRing, bf16 pages for the wire) reads instead of TakeLayer's
  // fp32 state. Waits for the layer's copy and frees its buffer: the pointers stay valid until
  // the next ExportLayerAsync into that buffer (layer + buffers()) or Discard. Errors as TakeLayer.
  struct LayerBlocks {
    const RingLayerGeometry* geometry = nullptr;  // the layer's, owned by the staging
    RingLayerBlocks blocks;
    int64_t position = 0;  // the slot's position when the copy was enqueued
  };
  absl::StatusOr<LayerBlocks> TakeLayerBlocks(int64_t layer);

  // Waits for every copy in flight and frees every buffer without converting: how a caller that
  // stops mid-way (an error, an abort) makes the staging ready for the next slot. Internal for a
  // CUDA error of a copy (every buffer is freed all the same). Also drops a layer filled by
  // FillImportLayer and not enqueued.
  absl::Status Discard();

  // A staged import's host half (GpuModel::BeginStagedImport): takes the next buffer in turn,
  // waits for the host-to-device copy it last carried, sets its rows to the fresh pool's NaN and
  // has `fill` write layer `layer` at `position` into it, for GpuModel::EnqueueStagedLayer of
  // the same layer. Layers may come in any order; `buffers()` of them may be filled ahead of
  // their copies. InvalidArgument for a bad layer or a negative position; FailedPrecondition
  // when the buffer in turn holds an exported layer or a filled layer not yet enqueued; `fill`'s
  // error (the buffer is free again); Internal for a CUDA error. Touches no GpuModel state:
  // may run on another thread than the model's calls (never two calls on one staging at once).
  absl::Status FillImportLayer(int64_t layer, int64_t position, const LayerImageFill& fill);

 private:
  friend class GpuModel;

  // Writes layer `layer`'s blocks at the import's position into host memory (`blocks`, a pinned
  // staging buffer laid out for `geometry`, the model's layer): the rows a forward reads of the
  // window ring (bf16 bits) and both compressors' rings (fp32), and entry rows
  // 0 .. position / m - 1 (bf16 bits). Every other ring row already holds the fresh pool's NaN
  // and may be left alone. A non-OK status stops the import.
  using LayerImageFill = std::function<absl::Status(
      int64_t layer, const RingLayerGeometry& geometry, const MutableRingLayerBlocks& blocks)>;
  struct Impl;
  explicit StateStaging(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve::engine::gpu
