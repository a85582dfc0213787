#include "engine/ring_state.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::engine {
namespace {

size_t Size(int64_t rows, int64_t cols) { return static_cast<size_t>(rows * cols); }

int64_t WindowRows(const RingLayerGeometry& g, int64_t position) {
  return std::min(position, std::max<int64_t>(g.window - 1, 0));
}

int64_t OverlapRows(const RingCompressorGeometry& g, int64_t position) {
  return g.overlapping && position >= g.rate ? g.rate : 0;
}

absl::Status CheckShape(const Tensor& t, int64_t rows, int64_t cols, int64_t layer,
                        const std::string& field) {
  if (t.rank() == 2 && t.dim(0) == rows && t.dim(1) == cols) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("state layer ", layer, " ", field, " is ",
                                                 t.ShapeString(), ", expected [", rows, ", ", cols,
                                                 "]"));
}

absl::Status CheckEmpty(const CompressorState& s, int64_t layer, const std::string& name) {
  for (const Tensor* t :
       {&s.buffer_kv, &s.buffer_gate, &s.overlap_kv, &s.overlap_gate, &s.entries}) {
    if (t->numel() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("state layer ", layer, " has ", name, " rows but the layer has no ", name));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCompressor(const RingCompressorGeometry& g, const CompressorState& s,
                             int64_t position, int64_t layer, const std::string& name) {
  if (!g.present()) return CheckEmpty(s, layer, name);
  const int64_t buffered = position % g.rate;
  PDSERVE_RETURN_IF_ERROR(CheckShape(s.buffer_kv, buffered, g.width(), layer, name + ".buffer_kv"));
  PDSERVE_RETURN_IF_ERROR(
      CheckShape(s.buffer_gate, buffered, g.width(), layer, name + ".buffer_gate"));
  const int64_t overlap = OverlapRows(g, position);
  PDSERVE_RETURN_IF_ERROR(CheckShape(s.overlap_kv, overlap, g.dim, layer, name + ".overlap_kv"));
  PDSERVE_RETURN_IF_ERROR(
      CheckShape(s.overlap_gate, overlap, g.dim, layer, name + ".overlap_gate"));
  const int64_t entries = position / g.rate;
  if (entries > g.entry_capacity) {
    return absl::InvalidArgumentError(absl::StrCat("state layer ", layer, " ", name, " has ",
                                                   entries, " entries, capacity ",
                                                   g.entry_capacity));
  }
  return CheckShape(s.entries, entries, g.dim, layer, name + ".entries");
}

void CompressorToImage(const RingCompressorGeometry& g, const CompressorState& s, int64_t position,
                       RingCompressorImage* image) {
  if (!g.present()) return;
  const int64_t width = g.width();
  const int64_t ring_rows = 2 * g.rate;
  const int64_t window_start = position / g.rate * g.rate;
  for (int64_t q = window_start; q < position; ++q) {
    const int64_t from = (q - window_start) * width;
    const int64_t to = q % ring_rows * width;
    std::copy_n(s.buffer_kv.ptr() + from, width, image->ring_kv.data() + to);
    std::copy_n(s.buffer_gate.ptr() + from, width, image->ring_gate.data() + to);
  }
  const int64_t overlap = OverlapRows(g, position);
  for (int64_t r = 0; r < overlap; ++r) {
    const int64_t to = (window_start - g.rate + r) % ring_rows * width;
    std::copy_n(s.overlap_kv.ptr() + r * g.dim, g.dim, image->ring_kv.data() + to);
    std::copy_n(s.overlap_gate.ptr() + r * g.dim, g.dim, image->ring_gate.data() + to);
  }
  if (!image->entries.empty()) {
    std::copy(s.entries.data.begin(), s.entries.data.end(), image->entries.begin());
  }
}

// A device value on the host: fp32 as it is, bf16 (its bit pattern) widened exactly.
inline float Widen(float v) { return v; }
inline float Widen(uint16_t bf16_bits) {
  const uint32_t bits = static_cast<uint32_t>(bf16_bits) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

template <typename E>
void WidenRows(const E* from, int64_t n, float* to) {
  for (int64_t i = 0; i < n; ++i) to[i] = Widen(from[i]);
}

// The CPU fields of one compressor from its ring rows (fp32) and entries (E: float or bf16 bits).
template <typename E>
void CompressorFromBlocks(const RingCompressorGeometry& g, const float* ring_kv,
                          const float* ring_gate, const E* entries_block, int64_t position,
                          CompressorState* s) {
  if (!g.present()) return;
  const int64_t width = g.width();
  const int64_t ring_rows = 2 * g.rate;
  const int64_t window_start = position / g.rate * g.rate;
  s->buffer_kv = Tensor({position - window_start, width});
  s->buffer_gate = Tensor({position - window_start, width});
  for (int64_t q = window_start; q < position; ++q) {
    const int64_t from = q % ring_rows * width;
    const int64_t to = (q - window_start) * width;
    std::copy_n(ring_kv + from, width, s->buffer_kv.ptr() + to);
    std::copy_n(ring_gate + from, width, s->buffer_gate.ptr() + to);
  }
  const int64_t overlap = OverlapRows(g, position);
  s->overlap_kv = Tensor({overlap, g.dim});
  s->overlap_gate = Tensor({overlap, g.dim});
  for (int64_t r = 0; r < overlap; ++r) {
    const int64_t from = (window_start - g.rate + r) % ring_rows * width;
    std::copy_n(ring_kv + from, g.dim, s->overlap_kv.ptr() + r * g.dim);
    std::copy_n(ring_gate + from, g.dim, s->overlap_gate.ptr() + r * g.dim);
  }
  const int64_t entries = position / g.rate;
  s->entries = Tensor({entries, g.dim});
  WidenRows(entries_block, entries * g.dim, s->entries.ptr());
}

// One layer's CPU fields from its window ring (E: float or bf16 bits) and compressor blocks.
template <typename E, typename C>
LayerState LayerFromBlocks(const RingLayerGeometry& g, const E* window, const C& compressor,
                           const C& indexer, int64_t position) {
  LayerState s;
  const int64_t rows = WindowRows(g, position);
  s.window_kv = Tensor({rows, g.head_dim});
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q = position - rows + r;
    WidenRows(window + q % g.window * g.head_dim, g.head_dim, s.window_kv.ptr() + r * g.head_dim);
  }
  CompressorFromBlocks(g.compressor, compressor.ring_kv, compressor.ring_gate, compressor.entries,
                       position, &s.compressor);
  CompressorFromBlocks(g.indexer, indexer.ring_kv, indexer.ring_gate, indexer.entries, position,
                       &s.indexer);
  return s;
}

// RingCompressorImage seen as the pointers LayerFromBlocks reads.
struct ImageBlocks {
  const float* ring_kv;
  const float* ring_gate;
  const float* entries;
  explicit ImageBlocks(const RingCompressorImage& image)
      : ring_kv(image.ring_kv.data()),
        ring_gate(image.ring_gate.data()),
        entries(image.entries.data()) {}
};

bool ImageFits(const RingCompressorGeometry& g, const RingCompressorImage& image) {
  if (!g.present())
    return image.ring_kv.empty() && image.ring_gate.empty() && image.entries.empty();
  return image.ring_kv.size() == Size(2 * g.rate, g.width()) &&
         image.ring_gate.size() == Size(2 * g.rate, g.width()) &&
         image.entries.size() == Size(g.entry_capacity, g.dim);
}

absl::Status CheckLayersAndPosition(const RingGeometry& geometry, size_t layers, int64_t position,
                                    const char* what) {
  if (layers != geometry.layers.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", layers, " layers, the model has ", geometry.layers.size()));
  }
  if (position < 0 || position > geometry.max_context) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " position ", position, " outside [0, max_context ", geometry.max_context, "]"));
  }
  return absl::OkStatus();
}

// `entries` false: the entry block is left empty (LayerRingImage without entries).
RingCompressorImage NewCompressorImage(const RingCompressorGeometry& g, float fill,
                                       bool entries = true) {
  RingCompressorImage image;
  if (!g.present()) return image;
  image.ring_kv.assign(Size(2 * g.rate, g.width()), fill);
  image.ring_gate.assign(Size(2 * g.rate, g.width()), fill);
  if (entries) image.entries.assign(Size(g.entry_capacity, g.dim), fill);
  return image;
}

}  // namespace

int64_t RingEntryCapacity(int64_t max_context, int64_t rate, int64_t page_size) {
  const int64_t entries = std::max<int64_t>(1, max_context / rate);
  return (entries + page_size - 1) / page_size * page_size;
}

RingGeometry RingGeometryFor(const ModelConfig& config, int64_t max_context, int64_t page_size) {
  RingGeometry g;
  g.max_context = max_context;
  for (LayerType type : config.layer_types) {
    RingLayerGeometry layer;
    layer.window = config.sliding_window;
    layer.head_dim = config.head_dim;
    if (type != LayerType::kSlidingAttention) {
      const int64_t rate = config.CompressRate(type);
      const bool csa = type == LayerType::kCompressedSparseAttention;
      const int64_t capacity = RingEntryCapacity(max_context, rate, page_size);
      layer.compressor = {rate, config.head_dim, csa, capacity};
      if (csa) layer.indexer = {rate, config.index_head_dim, true, capacity};
    }
    g.layers.push_back(layer);
  }
  return g;
}

namespace {
RingLayerImage NewLayerImage(const RingLayerGeometry& g, float fill, bool entries = true) {
  RingLayerImage layer;
  layer.window.assign(Size(g.window, g.head_dim), fill);
  layer.compressor = NewCompressorImage(g.compressor, fill, entries);
  layer.indexer = NewCompressorImage(g.indexer, fill, entries);
  return layer;
}
}  // namespace

RingImage NewRingImage(const RingGeometry& geometry, float fill) {
  RingImage image;
  for (const RingLayerGeometry& g : geometry.layers) image.layers.push_back(NewLayerImage(g, fill));
  return image;
}

absl::Status ValidateRingState(const RingGeometry& geometry, const ModelState& state) {
  PDSERVE_RETURN_IF_ERROR(
      CheckLayersAndPosition(geometry, state.layers.size(), state.position, "state"));
  const int64_t p = state.position;
  for (size_t l = 0; l < geometry.layers.size(); ++l) {
    const RingLayerGeometry& g = geometry.layers[l];
    const LayerState& s = state.layers[l];
    const auto layer = static_cast<int64_t>(l);
    PDSERVE_RETURN_IF_ERROR(
        CheckShape(s.window_kv, WindowRows(g, p), g.head_dim, layer, "window_kv"));
    PDSERVE_RETURN_IF_ERROR(CheckCompressor(g.compressor, s.compressor, p, layer, "compressor"));
    PDSERVE_RETURN_IF_ERROR(CheckCompressor(g.indexer, s.indexer, p, layer, "indexer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RingImage> RingImageFromState(const RingGeometry& geometry, const ModelState& state,
                                             float unread) {
  PDSERVE_RETURN_IF_ERROR(ValidateRingState(geometry, state));
  RingImage image;
  image.position = state.position;
  for (size_t l = 0; l < geometry.layers.size(); ++l) {
    image.layers.push_back(
        LayerRingImage(geometry.layers[l], state.layers[l], state.position, unread));
  }
  return image;
}

RingLayerImage LayerRingImage(const RingLayerGeometry& g, const LayerState& s, int64_t position,
                              float unread, bool entries) {
  RingLayerImage out = NewLayerImage(g, unread, entries);
  const int64_t p = position;
  const int64_t rows = WindowRows(g, p);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q = p - rows + r;
    std::copy_n(s.window_kv.ptr() + r * g.head_dim, g.head_dim,
                out.window.data() + q % g.window * g.head_dim);
  }
  CompressorToImage(g.compressor, s.compressor, p, &out.compressor);
  CompressorToImage(g.indexer, s.indexer, p, &out.indexer);
  return out;
}

absl::StatusOr<ModelState> StateFromRingImage(const RingGeometry& geometry,
                                              const RingImage& image) {
  PDSERVE_RETURN_IF_ERROR(
      CheckLayersAndPosition(geometry, image.layers.size(), image.position, "ring image"));
  const int64_t p = image.position;
  ModelState state;
  state.position = p;
  for (size_t l = 0; l < geometry.layers.size(); ++l) {
    const RingLayerGeometry& g = geometry.layers[l];
    const RingLayerImage& in = image.layers[l];
    if (in.window.size() != Size(g.window, g.head_dim) || !ImageFits(g.compressor, in.compressor) ||
        !ImageFits(g.indexer, in.indexer) ||
        (g.compressor.present() && p / g.compressor.rate > g.compressor.entry_capacity)) {
      return absl::InvalidArgumentError(
          absl::StrCat("ring image layer ", l, " does not have the geometry's sizes"));
    }
    state.layers.push_back(LayerFromBlocks(g, in.window.data(), ImageBlocks(in.compressor),
                                           ImageBlocks(in.indexer), p));
  }
  return state;
}

LayerState LayerStateFromRingBlocks(const RingLayerGeometry& geometry,
                                    const RingLayerBlocks& blocks, int64_t position) {
  return LayerFromBlocks(geometry, blocks.window, blocks.compressor, blocks.indexer, position);
}

}  // namespace pdserve::engine
