// DeepSeek-V4 KV compressor update on the GPU (CSA / HCA compressor and the CSA indexer's key
// compressor): consumes one call's new kv_proj / gate_proj rows of a batch of requests, emits every
// compressed entry whose window they complete, and keeps the last 2m raw rows per request in a
// ring.
//
// Math (DeepSeek-V4 paper §2.3.1 eqs. 9-12 (overlapping, CSA), §2.3.2 eqs. 20-23 (HCA);
// transformers 5.17 modeling_deepseek_v4.py, DeepseekV4CSACompressor / HCACompressor; CPU
// reference engine/compressor.cc (Compressor::EmitEntry), matched operation for operation):
// entry w of a request pools its slots, in this order:
//   overlapping and w >= 1: the m rows of window w-1, their Ca half (columns [0, dim)), with
//                           position_bias rows 0..m-1, columns [0, dim);
//   then the m rows of window w (source positions w*m .. w*m + m - 1): their Cb half (columns
//   [dim, 2 dim)) when overlapping, the whole row for HCA, with position_bias rows 0..m-1 at the
//   same columns.
// Per channel c: g_s = gate_s[c] + bias_s[c]; pooled[c] = sum_s softmax_s(g)[c] * kv_s[c] as
// kernels/cpu/gated_pool.h (max by fmax, exp(g - max), sums in slot order, acc / denom; an all
// -inf channel gives 0); then RMSNorm with norm_weight as kernels/cpu/rms_norm.h (fp64 sum of
// squares); then the interleaved RoPE of kernels/cpu/rope.h on the trailing rope_dim channels at
// position w*m, with engine/rope_table.cc's angles (fp32 angle = inv_freq[i] * float(w*m), fp64
// cos / sin rounded to fp32, times attention_scaling; same math as kernels/cuda/rope.cuh). All
// fp32; the entry is rounded to bf16 once, at the store.
//
// Layouts (width = overlapping ? 2 * dim : dim; all row-major, device memory):
//   kv, gate              [rows, width] fp32: segment b's new rows are rows row_offset[b] ..
//                         row_offset[b] + n[b] - 1 (positions p0[b] ..); other rows are not read.
//   ring_kv, ring_gate    [slots, 2 * rate, width] fp32: the raw row of source position q of the
//                         request in state slot s lives at [s][q % (2 * rate)].
//   entries               [slots, entry_capacity, dim] bf16: entry w at [s][w].
//   position_bias         [rate, width] fp32; norm_weight [dim] fp32; inv_freq [rope_dim / 2] fp32.
// A source row of position q is read from the new rows when q >= p0, else from the ring, which must
// hold the raw rows of positions [p0 - 2m, p0) (as the previous calls left it). Only the positions
// an emitted entry pools are read: ring rows of older positions and the entries of other windows
// may hold anything, NaN included.
//
// Writes: entries[slot[b]][w] for every window w with (w + 1) * m - 1 in [p0, p0 + n) and w <
// entry_capacity; then (a second kernel, stream-ordered after every read of the ring) the ring
// rows of positions max(p0, p0 + n - 2m) .. p0 + n - 1, copied bit-exactly. Nothing else.
//
// CUDA-graph safe: no allocation, no synchronization; the launch shape depends only on (segments,
// max_tokens, rate, dim); first_position, n_tokens, row_offset and slot are read when the kernels
// run. Deterministic (no atomics; fixed summation order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/paged_entries.cuh"

namespace pdserve::kernels::cuda {

inline constexpr int64_t kMaxCompressorRate = 512;
inline constexpr int64_t kMaxCompressorDim = 4096;
inline constexpr int64_t kMaxCompressorSegments = 65535;

struct CompressorParams {
  // This call's new source rows, stacked over segments: raw kv_proj / gate_proj outputs, fp32
  // [rows, width].
  const float* kv = nullptr;
  const float* gate = nullptr;
  // Row stride of kv and gate (elements); 0: width (contiguous rows). Larger when they are slices
  // of a wider GEMM output (the GPU engine's fused projections, engine/fused_projections.h).
  int64_t source_stride = 0;
  int64_t dim = 0;           // entry width (head_dim, or index_head_dim for the indexer compressor)
  bool overlapping = false;  // CSA and indexer: true (width = 2 * dim, Ca | Cb halves); HCA: false
  int64_t rate = 0;          // m: source tokens per entry
  // Segments (one per request in this call), device int32 arrays of length `segments`:
  const int32_t* first_position = nullptr;  // p0[b] >= 0: position of the segment's first new row
  const int32_t* n_tokens = nullptr;        // n[b] >= 0 new rows
  const int32_t* row_offset = nullptr;      // first row of segment b in kv / gate
  const int32_t* slot = nullptr;            // the request's state slot (distinct per segment)
  int64_t segments = 0;
  int64_t max_tokens = 0;  // host bound on every n[b] (fixes the launch shape)
  // State pools, indexed by slot:
  float* ring_kv = nullptr;          // [slots, 2 * rate, width] fp32
  float* ring_gate = nullptr;        // same layout
  __nv_bfloat16* entries = nullptr;  // [slots, entry_capacity, dim] bf16, or a paged pool
  int64_t entry_capacity = 0;        // entries per request at most
  // Paged entries (kernels/cuda/paged_entries.cuh): entry w of slot s at pool row
  // EntryRow(entry_pages, s, entry_capacity, w); a null table is the slot layout above. Every
  // entry a call writes must be on a page the slot holds.
  EntryPages entry_pages;
  // Weights (fp32, device): position_bias [rate, width], norm_weight [dim] (kv_norm)
  const float* position_bias = nullptr;
  const float* norm_weight = nullptr;
  float eps = 1e-6f;
  // RoPE of each entry at position w * rate (engine/rope_table.h semantics):
  const float* inv_freq = nullptr;  // [rope_dim / 2]
  float attention_scaling = 1.0f;
  int64_t rope_dim = 0;
};

// Requires 1 <= rate <= kMaxCompressorRate, 1 <= dim <= kMaxCompressorDim, rope_dim even in [0,
// dim], 0 <= segments <= kMaxCompressorSegments, max_tokens >= 0, entry_capacity >= 0,
// source_stride 0 or >= width, and
// non-null pointers (entries only when entry_capacity > 0, inv_freq only when rope_dim > 0) when
// segments and max_tokens are both positive; else nothing is launched and the call succeeds.
// Device values: n[b] is clamped to [0, max_tokens] (rows past max_tokens are ignored), a segment
// with p0[b] < 0 is skipped; slot[b] must index the pools and be distinct across segments, the
// rows of different segments must not overlap, and p0[b] + n[b] must fit int32. Returns
// cudaErrorInvalidValue on bad arguments, else the launch status. Asynchronous on `stream`;
// concurrent calls must not share state slots.
cudaError_t compressor_update(const CompressorParams& params, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
