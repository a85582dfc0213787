// The fixed-capacity ring layout of one request's decode state, as the CUDA engine's state slots
// hold it (engine/gpu/gpu_model.h), and its exact conversion to and from the CPU engine's
// ModelState (engine/state.h). Pure host logic with no CUDA dependency, so it is tested on the
// CPU; GpuModel::ExportState / ImportState copy a slot's blocks to and from a RingImage, and
// GpuModel::ExportLayerAsync copies one layer's blocks into pinned memory that
// LayerStateFromRingBlocks reads.
//
// Ring layout of one slot, per layer (W = sliding_window, hd = head_dim, m = the compressor's
// rate, width = 2 * dim when overlapping else dim, p = position):
//   window   [W, hd]            K=V row of position q at row q % W (the device stores bf16)
//   ring_kv  [2m, width]        raw kv_proj row of source position q at row q % (2m) (fp32)
//   ring_gate [2m, width]       the same for gate_proj (fp32)
//   entries  [capacity, dim]    compressed entry w at row w (the device stores bf16)
// for the attention compressor (CSA / HCA layers) and the indexer's compressor (CSA layers).
//
// What maps onto what (the CPU fields, engine/state.h):
//   window_kv [min(p, W-1), hd]  <-> window rows of positions p - rows .. p - 1
//   buffer_kv / buffer_gate [p % m, width] <-> ring rows of positions (p / m) * m .. p - 1
//   overlap_kv / overlap_gate [m, dim] (overlapping, p >= m; else [0, dim])
//                                <-> columns [0, dim) of the ring rows of positions
//                                    (p / m - 1) * m .. (p / m) * m - 1 (the Ca half)
//   entries [p / m, dim]         <-> entry rows 0 .. p / m - 1
// These are exactly the rows the next forward call reads (docs/engine.md "Semantics", and the
// read sets documented in kernels/cuda/compressor.cuh and engine/gpu/ops.cuh): the window row of
// position p - W, the Cb half of the previous window and older ring rows are never read again, so
// an image made from a state holds a fill value there and the round trip state -> image -> state is
// exact, as is image -> state -> image on every row that is read.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/state.h"

namespace pdserve::engine {

// One compressor's layout; rate 0 means the layer has no such compressor.
struct RingCompressorGeometry {
  int64_t rate = 0;  // m
  int64_t dim = 0;   // head_dim (attention compressor) or index_head_dim (indexer)
  bool overlapping = false;
  int64_t entry_capacity = 0;  // rows of the entries block
  int64_t width() const { return overlapping ? 2 * dim : dim; }
  bool present() const { return rate > 0; }
};

struct RingLayerGeometry {
  int64_t window = 0;    // W
  int64_t head_dim = 0;  // hd
  RingCompressorGeometry compressor;
  RingCompressorGeometry indexer;
};

struct RingGeometry {
  int64_t max_context = 0;  // tokens per request
  std::vector<RingLayerGeometry> layers;
};

// Entry rows a compressor of rate `rate` needs for `max_context` tokens, rounded up to whole
// pages of `page_size` entries (the CUDA engine's fixed-shape decode kernels read them as pages).
// REQUIRES rate >= 1, page_size >= 1.
int64_t RingEntryCapacity(int64_t max_context, int64_t rate, int64_t page_size);

// The CUDA engine's layout for `config` at `max_context` tokens with entry pages of `page_size`.
RingGeometry RingGeometryFor(const ModelConfig& config, int64_t max_context, int64_t page_size);

// Host copy of one compressor's ring blocks, every value as float (bf16 values exactly).
struct RingCompressorImage {
  std::vector<float> ring_kv;    // [2m, width]
  std::vector<float> ring_gate;  // [2m, width]
  std::vector<float> entries;    // [entry_capacity, dim]
};

struct RingLayerImage {
  std::vector<float> window;  // [W, hd]
  RingCompressorImage compressor;
  RingCompressorImage indexer;
};

struct RingImage {
  int64_t position = 0;
  std::vector<RingLayerImage> layers;
};

// An image of `geometry`'s sizes at position 0 with every value `fill` (absent compressors:
// empty vectors).
RingImage NewRingImage(const RingGeometry& geometry, float fill = 0.0f);

// InvalidArgument naming the layer and field when `state` does not have the shapes of a CPU
// engine state of this geometry's model at state.position (layer count, every tensor's rows and
// columns as in engine/state.h, empty compressor fields where the layer has none), or when its
// position exceeds max_context; OK otherwise. Values are not inspected.
absl::Status ValidateRingState(const RingGeometry& geometry, const ModelState& state);

// The image of `state`, with `unread` on every row (and the Cb half of every overlap row) the next
// forward does not read: the CUDA engine passes NaN, as its fresh pools hold, so a kernel that
// read such a row would show in the logits. Errors as ValidateRingState. Values are copied as
// they are: rounding to the device's bf16 is the caller's.
absl::StatusOr<RingImage> RingImageFromState(const RingGeometry& geometry, const ModelState& state,
                                             float unread = 0.0f);

// One layer of RingImageFromState(geometry, state, unread): layer `s` of a state at `position`
// that ValidateRingState accepted for the geometry `g` belongs to (not checked again here), so a
// caller can convert layer by layer (GpuModel::ImportState with a staging). With `entries` false
// both compressors' entry blocks stay empty: entry row w is the state's entries row w (w < p / m)
// and `unread` past them, which such a caller writes itself without a full-capacity copy.
RingLayerImage LayerRingImage(const RingLayerGeometry& g, const LayerState& s, int64_t position,
                              float unread, bool entries = true);

// The CPU-layout state of `image` at image.position. InvalidArgument when the image's vector
// sizes or position do not fit `geometry`.
absl::StatusOr<ModelState> StateFromRingImage(const RingGeometry& geometry, const RingImage& image);

// One layer's blocks as the device stores them, seen in host memory (a copy of a slot's blocks):
// bf16 values as their bit patterns (the upper 16 bits of the float32 of the same value), the
// compressor rings fp32. Not owning; pointers of an absent compressor are not read.
struct RingCompressorBlocks {
  const float* ring_kv = nullptr;     // [2m, width]
  const float* ring_gate = nullptr;   // [2m, width]
  const uint16_t* entries = nullptr;  // bf16 bits, rows 0 .. position / m - 1 at least, [*, dim]
};

struct RingLayerBlocks {
  const uint16_t* window = nullptr;  // bf16 bits [W, hd]
  RingCompressorBlocks compressor;
  RingCompressorBlocks indexer;
};

// The same blocks, writable: where a caller builds a layer's device image in host memory (a
// StateStaging buffer, GpuModel::ImportLayers) straight from state pages.
struct MutableRingCompressorBlocks {
  float* ring_kv = nullptr;     // [2m, width]
  float* ring_gate = nullptr;   // [2m, width]
  uint16_t* entries = nullptr;  // bf16 bits [entry_capacity, dim]; rows 0 .. position / m - 1 used
};

struct MutableRingLayerBlocks {
  uint16_t* window = nullptr;  // bf16 bits [W, hd]
  MutableRingCompressorBlocks compressor;
  MutableRingCompressorBlocks indexer;
};

// Layer state at `position` in the CPU engine's layout from that layer's blocks: exactly the
// layer StateFromRingImage gives for an image holding the same values (bf16 widened to float
// exactly, NaN payloads included). REQUIRES: 0 <= position <= geometry's max_context and every
// present block holds the sizes above (the caller copied them from a slot of this geometry).
// Thread-safe (pure function).
LayerState LayerStateFromRingBlocks(const RingLayerGeometry& geometry,
                                    const RingLayerBlocks& blocks, int64_t position);

}  // namespace pdserve::engine
