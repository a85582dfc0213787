// Glue kernels of the GPU engine (engine/gpu/gpu_model.h): casts, the embedding gather, the
// sliding-window ring append, the residual add and the expert-parallel MoE's bookkeeping (partial
// sums, local expert ids). The model's math lives in kernels/cuda; these
// only move and convert data. All asynchronous on `stream`, CUDA-graph safe (launch shapes from
// the size arguments only; per-segment values read from device memory), stateless, and return
// cudaErrorInvalidValue on negative sizes or missing pointers, else the launch status.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::engine::gpu {

// y[i] = bf16(x[i]) (round to nearest even), i < n.
cudaError_t CastToBf16(const float* x, int64_t n, __nv_bfloat16* y, cudaStream_t stream);

// streams[r, j, :] = float(embed[tokens[r], :]) for j < hc: the embedding copied into each of
// the hc hyper-connection streams. embed [vocab, hidden] bf16; streams [rows, hc, hidden] fp32.
// A token id outside [0, vocab) yields zeros (the engine validates ids before).
cudaError_t EmbedStreams(const int32_t* tokens, int64_t rows, const __nv_bfloat16* embed,
                         int64_t vocab, int64_t hidden, int64_t hc, float* streams,
                         cudaStream_t stream);

// Segments of one call (one per request), device int32 arrays of length `segments`.
struct SegmentArrays {
  const int32_t* first_position = nullptr;  // position of the segment's first new row
  const int32_t* n_tokens = nullptr;        // new rows of the segment
  const int32_t* row_offset = nullptr;      // its first row in the call's stacked rows
  const int32_t* slot = nullptr;            // the request's state slot
  int64_t segments = 0;
  int64_t max_tokens = 0;  // host bound on n_tokens (launch shape)
};

// Writes the new rows of positions max(p0, p0 + n - window) .. p0 + n - 1 of each segment into
// ring[slot][position % window]. new_rows [rows, dim] bf16; ring [slots, window, dim] bf16.
cudaError_t WindowAppend(const SegmentArrays& segments, const __nv_bfloat16* new_rows, int64_t dim,
                         int64_t window, __nv_bfloat16* ring, cudaStream_t stream);

// y[i] = float(x[i]), i < n.
cudaError_t CastToF32(const __nv_bfloat16* x, int64_t n, float* y, cudaStream_t stream);

// The paged views the fixed-shape decode kernels (kernels/cuda/sparse_decode_attention.cuh,
// indexer.cuh) take of the engine's per-slot pools, for one decode row per request: row r of
// slot s at position t gets window_len[r] = min(t + 1, window), n_compressed[r] =
// min((t + 1) / rate, capacity) and page_table[r][i] = slot_pages[s][i] for i < capacity /
// page_size (slot_pages: the engine's paged-state rows, int32 [slots + 1, capacity / page_size]
// device page ids, serving/slot_page_tables.h), or with slot_pages null s * (capacity /
// page_size) + i (a slot's entries are consecutive pages). capacity % page_size == 0.
cudaError_t DecodePageTables(const int32_t* slot, const int32_t* position, int64_t rows,
                             int64_t window, int64_t rate, int64_t capacity, int64_t page_size,
                             const int32_t* slot_pages, int32_t* window_len, int32_t* n_compressed,
                             int32_t* page_table, cudaStream_t stream);

// x[i] *= scale, i < n.
cudaError_t Scale(float* x, int64_t n, float scale, cudaStream_t stream);

// Rows of a fused projection group's output (engine/fused_projections.h) into the contiguous
// buffers the unfused path fills: x [rows, x_stride] fp32 (columns [0, cols) read), y [rows,
// cols]. Requires x_stride >= cols. CastRowsToBf16: y = bf16(x) (round to nearest even, as
// CastToBf16); ScaleRows: y = x * scale (fp32, as Scale).
cudaError_t CastRowsToBf16(const float* x, int64_t rows, int64_t cols, int64_t x_stride,
                           __nv_bfloat16* y, cudaStream_t stream);
cudaError_t ScaleRows(const float* x, int64_t rows, int64_t cols, int64_t x_stride, float scale,
                      float* y, cudaStream_t stream);

// TEST ONLY (GpuModelOptions::test_unmasked_indexer): picks[r, k] = k where it is -1 (or any
// negative), r < rows, k < topk; picks is int32 [rows, topk]. The bug class of a top-k that skips
// its "-1 past the visible entries" fill (engine/model_options.h, IndexerFault::kUnmaskedSlots).
cudaError_t UnmaskSlots(int32_t* picks, int64_t rows, int64_t topk, cudaStream_t stream);

// out[i] = parts[0 * n + i] + parts[1 * n + i] + ... + parts[(n_parts - 1) * n + i], summed in
// that order (fp32), i < n: the local communicator's reduce-scatter (engine/gpu/local_comm.h).
// out may alias parts' first block.
cudaError_t SumParts(const float* parts, int64_t n_parts, int64_t n, float* out,
                     cudaStream_t stream);

// y[i] += x[i], i < n (fp32).
cudaError_t AddInto(float* y, const float* x, int64_t n, cudaStream_t stream);

// local[i] = experts[i] - first when experts[i] is in [first, first + count), else -1, i < n
// (int32): a rank's view of global expert picks, whose -1 the routed experts kernel skips
// (kernels/cuda/moe.cuh). local may alias experts.
cudaError_t LocalExpertIds(const int32_t* experts, int64_t n, int64_t first, int64_t count,
                           int32_t* local, cudaStream_t stream);

}  // namespace pdserve::engine::gpu
