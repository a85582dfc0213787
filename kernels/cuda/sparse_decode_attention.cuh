// Sparse multi-query attention for decode (DeepSeek-V4 sliding-window + CSA / HCA layers), bf16
// state, fp32 accumulation, attention sinks, split along the KV axis with a combine kernel.
//
// Each request has one query token with `heads` query heads of kSparseHeadDim (the RoPE slice,
// the last 64 dims, is already rotated in q and in the stored entries; the caller undoes it on
// the output). Every head attends over the same list of shared K=V rows:
//   entries 0 .. window_len[b)              the request's sliding-window rows, then
//   CSA (indices != nullptr): indices[b, 0 .. compressed_slots), each a compressed entry index or
//                             -1 (skipped, as are indices >= n_compressed[b]);
//   HCA (indices == nullptr): compressed entries 0 .. min(n_compressed[b], compressed_slots).
// out[b, h] = sum_j p_j row_j with p = softmax([s_0 .. s_{n-1}, sink_h]) without its last element,
// s_j = softmax_scale * q[b, h] . row_j; no rows -> zeros. Source: transformers 5.17
// modeling_deepseek_v4.py, eager_attention_forward; CPU reference kernels/cpu/sink_attention.h.
//
// Layouts: q [batch, heads, 512] bf16; window_pool [window pages, window_size, 512] bf16 with the
// request's page window_page[b]; kv_pool [pages, page_size, 512] bf16 with page_table [batch,
// page_table_stride] (compressed entry c of request b: page page_table[b][c / page_size], slot
// c % page_size); sinks [heads] fp32; out [batch, heads, 512] bf16. Rows that are not attended
// (past a length, index -1) are never read, so stale or NaN slots cannot leak.
//
// Method (sm_90a): per (split, request, 64 heads) one block of a producer warpgroup that copies
// the attended rows 32 at a time (kSparseTile) into a four-stage ring in shared memory and two
// consumer warpgroups running Hopper's warpgroup MMA with the 64 heads as M. The consumers take
// turns over the tiles (FlashMLA's "seesaw" schedule): each computes the full scores and softmax
// of every other tile, hands P to the other, and accumulates its half of the output columns over
// every tile (see the .cu for the data flow); with several splits their partial outputs (bf16,
// unnormalized, with fp32 maxima and sums) are merged in fp32 (sparse_decode_merge.cuh). Scores
// and the output accumulate in fp32; the probabilities are rounded to bf16 for the P V product.
//
// Two variants (SparseDecodeParams::variant), the same split kernel and math:
// - kSplitCombine: a second kernel merges the splits (the only one until 2026-12-04; kept as the
//   bench's baseline row and as a fallback).
// - kFusedCombine (the default): no second kernel. Each split block writes its partials, then
//   counts itself on a per-(request, head group) counter in the workspace; the block that arrives
//   last merges the splits (the combine kernel's formula in fp32, splits added in split order, so
//   the bits do not depend on which block came last) and resets the counter to zero. At most
//   kSparseMaxFusedSplits splits. Splits past a request's entries exit without writing, a request
//   whose entries fit one split is finished by that block alone. Launched with programmatic
//   stream serialization (unless programmatic_launch is false): the launch may begin while the
//   kernel before it on the stream drains; every thread waits (griddepcontrol.wait) for that
//   kernel before it reads or writes global memory, and the kernel lets the next one's launch
//   begin at once. Needs the workspace's counters zero before its first launch
//   (SparseDecodeInitWorkspace); every launch leaves them zero.
//
// CUDA-graph safe: the launch shape depends only on (batch, heads, window_size, compressed_slots,
// entries_per_split); all lengths and indices are read from device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kSparseHeadDim = 512;
inline constexpr int64_t kSparseHeadsPerBlock = 64;  // heads must be a multiple of this
inline constexpr int64_t kSparseTile = 32;           // entries_per_split must be a multiple
// Counters of kFusedCombine: one per (request, head group), at the start of every workspace.
inline constexpr int64_t kSparseCounterSlots = 65536;  // batch * heads / 64 must not exceed it
inline constexpr int kSparseMaxFusedSplits = 32;       // kFusedCombine merges at most this many

enum class SparseDecodeVariant { kSplitCombine, kFusedCombine };

struct SparseDecodeParams {
  const __nv_bfloat16* q = nullptr;
  int64_t batch = 0;
  int64_t heads = 64;
  const __nv_bfloat16* window_pool = nullptr;
  const int32_t* window_page = nullptr;  // [batch], device
  const int32_t* window_len = nullptr;   // [batch], device, clamped to [0, window_size]
  int64_t window_size = 128;
  const __nv_bfloat16* kv_pool = nullptr;
  const int32_t* page_table = nullptr;
  int64_t page_table_stride = 0;
  int64_t page_size = 64;
  const int32_t* n_compressed = nullptr;  // [batch], device: compressed entries written
  const int32_t* indices = nullptr;       // CSA: [batch, compressed_slots]; HCA: nullptr
  int64_t compressed_slots = 0;           // CSA: top-k; HCA: bound on n_compressed
  const float* sinks = nullptr;
  float softmax_scale = 1.0f;  // > 0
  int64_t entries_per_split = 256;
  SparseDecodeVariant variant = SparseDecodeVariant::kFusedCombine;
  // kFusedCombine: launch as a programmatic dependent of the kernel before it on the stream
  // (false: a plain launch; the kernel is the same, griddepcontrol.wait is then a no-op).
  bool programmatic_launch = true;
};

// Splits of the KV axis for this launch: ceil((window_size + compressed_slots) /
// entries_per_split).
int64_t SparseDecodeSplits(const SparseDecodeParams& params);

// A split size (multiple of kSparseTile) for requests of up to `max_entries` entries: the one a
// cost model fitted to H200 measurements of `variant` (see the definition) predicts fastest,
// within one wave of blocks (one per multiprocessor). Splitting shortens each block's list but
// adds partial outputs and their merge, so small lists and batches that fill the wave stay whole.
// Host arithmetic.
int64_t SparseDecodeEntriesPerSplit(
    int64_t batch, int64_t heads, int64_t max_entries, int sm_count,
    SparseDecodeVariant variant = SparseDecodeVariant::kFusedCombine);

// Device workspace the launch needs: kSparseCounterSlots uint32 counters (both variants keep the
// area, so one workspace serves both), then bf16 partial outputs and fp32 maxima and sums per
// split.
size_t SparseDecodeWorkspaceBytes(const SparseDecodeParams& params);

// Zeroes the counters at the start of `workspace` (asynchronously on `stream`): once after the
// workspace is allocated, and again if its memory was used for anything else. Returns
// cudaErrorInvalidValue when workspace_bytes is smaller than the counter area.
cudaError_t SparseDecodeInitWorkspace(void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Runs the split kernel and, with kSplitCombine and more than one split, the combine kernel on
// `stream`. Returns cudaErrorInvalidValue on bad arguments (heads not a multiple of 64,
// entries_per_split not a multiple of kSparseTile, softmax_scale not > 0, batch * heads / 64 over
// kSparseCounterSlots, kFusedCombine with more than kSparseMaxFusedSplits splits, workspace too
// small, missing pointers), else the launch status. No state
// besides one-time kernel attributes (make the first call of each variant outside graph
// capture): concurrent calls with distinct workspaces are safe; calls sharing a workspace must
// be ordered (one stream).
cudaError_t sparse_decode_attention(const SparseDecodeParams& params, void* workspace,
                                    size_t workspace_bytes, __nv_bfloat16* out,
                                    cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
