// Sparse attention with sinks for any head count and head_dim: the GPU engine's prefill path
// and its decode path for shapes the fixed-shape decode kernel (sparse_decode_attention.cuh:
// head_dim 512, heads a multiple of 64) does not take. One shared K=V head per layer.
//
// Query row r (position t = position_of_row[r], request state slot s = slot_of_row[r]) attends,
// per head h, over
//   window:      the keys of positions max(0, t - window + 1) .. t, then
//   compressed:  CSA (indices != nullptr): indices[r, 0 .. compressed_slots), each an entry index
//                or -1 (skipped, as is any index >= min(entry_capacity, (t + 1) / rate));
//                HCA (indices == nullptr): entries 0 .. min(entry_capacity, (t + 1) / rate).
// out[r, h] = sum_j p_j row_j, p = softmax([s_0 .. s_{n-1}, sinks[h]]) without its last element,
// s_j = softmax_scale * q[r, h] . row_j; no key -> zeros. Source: transformers 5.17
// modeling_deepseek_v4.py, DeepseekV4Attention / eager_attention_forward; CPU reference
// engine/attention.cc with kernels/cpu/sink_attention.h (SoftmaxWithSink: max includes the sink).
//
// Where the rows live. This call's new rows (kv_norm'ed, rotated, bf16) are new_kv [rows,
// head_dim], row r holding position position_of_row[r]; a segment (one request's rows of the
// call) starts at row first_row[r] with position first_position[r]. Window key of position q:
// q >= first_position[r] -> new_kv[first_row[r] + q - first_position[r]]; else the ring
// window_ring[s][q % window] ([slots, window, head_dim] bf16), which holds the last `window`
// positions before the segment. Compressed entry e: entries[s][e] ([slots, entry_capacity,
// head_dim] bf16), or through entry_pages' page table. Rows not attended are never read, so stale
// or NaN slots cannot leak.
//
// Layouts: q [rows, heads, head_dim] fp32 (RoPE applied), sinks [heads] fp32, out [rows, heads,
// head_dim] fp32; all per-row arrays int32 [rows] in device memory.
//
// CUDA-graph safe: the launch shape depends only on (rows, heads, head_dim, window,
// compressed_slots or the HCA bound max_entries); positions, slots and indices are read when the
// kernel runs. Speed: one block per (row, head) reading its keys twice (scores, then the weighted
// sum): meant for small heads and prefill, not for V4-Flash decode. Deterministic; stateless.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/paged_entries.cuh"

namespace pdserve::kernels::cuda {

struct SinkAttentionParams {
  const float* q = nullptr;
  int64_t rows = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  const int32_t* slot_of_row = nullptr;
  const int32_t* position_of_row = nullptr;
  const int32_t* first_position = nullptr;
  const int32_t* first_row = nullptr;
  const __nv_bfloat16* new_kv = nullptr;
  const __nv_bfloat16* window_ring = nullptr;
  int64_t window = 0;  // sliding window W >= 1 (keys of the last W positions, current included)
  const __nv_bfloat16* entries = nullptr;  // nullptr: sliding layer (no compressed entries)
  int64_t entry_capacity = 0;
  // Paged entries (kernels/cuda/paged_entries.cuh); a null table is the [slots, entry_capacity]
  // layout above.
  EntryPages entry_pages;
  int64_t rate = 1;                  // tokens per compressed entry
  const int32_t* indices = nullptr;  // CSA picks [rows, compressed_slots]; nullptr: HCA
  int64_t compressed_slots = 0;      // CSA: top-k; HCA: bound on the entries any row sees
  const float* sinks = nullptr;
  float softmax_scale = 1.0f;
};

// Writes out [rows, heads, head_dim]. cudaErrorInvalidValue on bad arguments (missing pointers,
// non-positive sizes, head_dim > 1024, a window or entry bound whose scores do not fit in shared
// memory), else the launch status. rows == 0 launches nothing.
cudaError_t sink_attention(const SinkAttentionParams& params, float* out, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
