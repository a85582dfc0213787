// Incremental per-request state of the DeepSeek-V4 forward pass (CPU backend).
//
// Everything a later Model::Forward call needs to continue a sequence exactly as the one-shot
// forward over the whole sequence would: the sliding-window keys, each compressor's partial
// window and overlap, the compressed entries and the indexer keys. It is plain data (Tensors of
// float32 plus one counter), so the disaggregated path can ship it page by page from the prefill
// worker to the decode worker. All Tensors are row-major [rows, cols]; a Tensor with 0 rows still
// carries its column count. Not thread-safe: one request's state is advanced by one caller at a
// time. Shapes below use W = sliding_window, hd = head_dim, ihd = index_head_dim, m = the layer's
// compress rate, p = ModelState::position.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/tensor.h"

namespace pdserve::engine {

// State of one compressor: a layer's CSA or HCA compressor, or a CSA layer's indexer compressor.
// `dim` below is hd (attention compressors) or ihd (indexer); `width` is 2 * dim for the
// overlapping CSA / indexer compressors (Ca | Cb halves) and dim for HCA.
struct CompressorState {
  // kv_proj / gate_proj outputs of the source tokens of the window still being filled:
  // [p % m, width] each, raw (position bias not yet added).
  Tensor buffer_kv;
  Tensor buffer_gate;
  // Overlapping compressors only: the Ca half of the last complete window, [m, dim] each, raw; it
  // joins the next window's pooling. [0, dim] before the first window completes, and for HCA.
  Tensor overlap_kv;
  Tensor overlap_gate;
  // Compressed entries emitted so far, kv_norm'ed and rotated at position w * m:
  // [p / m, dim]. Entry w pools source positions [w * m, (w + 1) * m) (and the previous window's
  // Ca half when overlapping). For the indexer these are its keys.
  Tensor entries;
};

struct LayerState {
  // Keys (= values) of the last min(p, W - 1) positions, kv_norm'ed and rotated: [rows, hd].
  Tensor window_kv;
  CompressorState compressor;  // CSA and HCA layers; empty for sliding layers
  CompressorState indexer;     // CSA layers only
};

struct ModelState {
  int64_t position = 0;  // tokens consumed so far; the next token's position
  std::vector<LayerState> layers;
};

// Appends `rows` rows of t->shape[1] floats to a [n, cols] tensor.
void AppendRows(Tensor* t, const float* rows_data, int64_t rows);
// Removes the first `rows` rows (clamped to [0, row count]).
void DropFrontRows(Tensor* t, int64_t rows);

}  // namespace pdserve::engine
