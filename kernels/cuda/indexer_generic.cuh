// Lightning-indexer scores (DeepSeek-V4 compressed sparse attention) for any head count and head
// width, fp32 queries against bf16 keys, for prefill and decode rows alike. The fixed-shape decode
// kernel (kernels/cuda/indexer.cuh, 64 heads x 128, bf16 queries, tensor cores) is the fast path
// of the full model; this one serves every shape, small test models included. Top-k over these
// scores is kernels/cuda/topk.cuh's top_k (with `visible` as its lengths).
//
// Math (transformers 5.17 modeling_deepseek_v4.py, DeepseekV4IndexerScorer / DeepseekV4Indexer;
// CPU reference engine/indexer.cc, Indexer::Select, whose order of operations this keeps):
//   visible[r] = clamp(min((position_of_row[r] + 1) / rate, key_capacity, max_keys), 0, .)
//   scores[r, s] = sum_h (max(q[r, h] . key[s], 0) * score_scale) * head_weights[r, h]
// for s < visible[r]: an entry compresses `rate` tokens and is visible once all of them precede
// the query. The sum over h runs in index order from 0.0f, each term rounded as the CPU rounds it
// (no fused multiply-add), so keys whose ReLU terms are all zero score exactly 0 and identical
// keys score identically: the top-k tie rule (lower index first) then orders them as the CPU
// does. The dot products are fp32 fused multiply-adds over the head dimension in index order (the
// CPU uses a GEMM: they agree to fp32 rounding). max(x, 0) keeps a NaN x, as std::max does.
//
// Layouts: q [rows, heads, head_dim] fp32 (RoPE applied); head_weights [rows, heads] fp32 (=
// weights_proj(x) / sqrt(heads)); keys [slots, key_capacity, head_dim] bf16, one slot per request:
// row r reads keys[slot_of_row[r], 0 .. visible[r]) only, so NaN or stale keys past a row's
// visible length or in other slots never reach its scores; slot_of_row, position_of_row [rows]
// int32 in device memory. scores [rows, max_keys] fp32: entries at or past visible[r] are left
// untouched; visible [rows] int32. key_pages (kernels/cuda/paged_entries.cuh): keys is a paged
// pool, key s of row r at pool row EntryRow(key_pages, slot_of_row[r], key_capacity, s).
//
// Errors: cudaErrorInvalidValue on bad arguments (negative sizes; heads, head_dim or rate < 1;
// heads or head_dim past 4096; max_keys past INT32_MAX - 64; a shared-memory footprint past 200
// KiB, about (heads + 64) x head_dim + 68 x heads floats: 64 x 128 takes 84 KiB, 64 x 512 is
// refused; null pointers when rows > 0), else the launch status. rows == 0 launches nothing.
//
// Asynchronous on `stream`; no state besides a one-time kernel attribute, so concurrent calls on
// different outputs are safe. CUDA-graph safe: no allocation, no synchronization; the launch shape
// depends only on (rows, heads, head_dim, max_keys); slots and positions are read from device
// memory when the kernel runs, and blocks past a row's visible length exit at once. Make the first
// call outside graph capture (it sets the kernel's shared-memory limit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/paged_entries.cuh"

namespace pdserve::kernels::cuda {

cudaError_t indexer_scores_generic(const float* q, const float* head_weights, int64_t rows,
                                   int64_t heads, int64_t head_dim, const __nv_bfloat16* keys,
                                   int64_t key_capacity, const int32_t* slot_of_row,
                                   const int32_t* position_of_row, int64_t rate, float score_scale,
                                   int64_t max_keys, float* scores, int32_t* visible,
                                   cudaStream_t stream, EntryPages key_pages = {});

}  // namespace pdserve::kernels::cuda
