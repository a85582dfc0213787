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
// Two variants (SparseDecodeParams::variant), the same two kernels and math:
// - kSplitCombine: plain launches (the only variant until 2026-12-04; kept as the bench's baseline
//   row and as a fallback).
// - kDependentLaunch (the default): both kernels launched as programmatic dependents (unless
//   programmatic_launch is false), so each launch begins while the kernel before it on the stream
//   drains; every thread waits (griddepcontrol.wait) for that kernel before it touches global
//   memory, and lets the next launch begin at once. Besides: the lookups' first cache lines
//   (page-table row, CSA indices) are prefetched while the lengths load, a request whose entries
//   fit in split 0 gets its final output from that block (the combine kernel skips it), and splits
//   past a request's entries write nothing; with query_cluster 2 (opt-in) pairs of splits load
//   the queries once, as a thread-block cluster, by TMA multicast. (Merging the splits in the split
//   block that finishes last, with no combine kernel, was measured slower: docs/perf.md,
//   2026-12-04.)
// - kClusterMerge (opt-in): the splits of one (request, 64-head group)
//   run as one thread-block cluster (at most kSparseMaxClusterSplits blocks) and merge through
//   distributed shared memory, with no combine kernel and no partials in global memory: each
//   block leaves its unnormalized bf16 output and fp32 maxima and sums in its own shared memory,
//   the cluster synchronizes, and block r merges heads [r * 64 / C, (r + 1) * 64 / C) from every
//   block's shared memory (the same arithmetic per element as kDependentLaunch's merge kernel)
//   into the final output. With multicast_queries the queries are loaded once per cluster (TMA
//   with the 128-byte swizzle, each block fetching 8 / C of the 64-dim regions for all blocks).
//   Launched as a programmatic dependent like kDependentLaunch. One split, or more splits than
//   kSparseMaxClusterSplits: runs exactly as kDependentLaunch. Use it with
//   SparseDecodeClusterEntriesPerSplit. Measured on an H200 (docs/perf.md, 2026-12-04): no
//   faster at batch 32 (clusters of 4 do not all fit at once, 3 splits cost what the merge kernel
//   saves), 0.6-1.0 us faster at batch 1.
//
// CUDA-graph safe: the launch shape depends only on (batch, heads, window_size, compressed_slots,
// entries_per_split); all lengths and indices are read from device memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// kSparseHeadDim, kSparseHeadsPerBlock, kSparseTile, kSparseMaxClusterSplits; the split rule and
// workspace as host arithmetic.
#include "kernels/cuda/sparse_decode_workspace.h"

namespace pdserve::kernels::cuda {

enum class SparseDecodeVariant { kSplitCombine, kDependentLaunch, kClusterMerge };

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
  SparseDecodeVariant variant = SparseDecodeVariant::kDependentLaunch;
  // kDependentLaunch, kClusterMerge: launch the kernels as programmatic dependents (false: plain
  // launches of the same kernels; griddepcontrol.wait is then a no-op).
  bool programmatic_launch = true;
  // kDependentLaunch, kClusterMerge: prefetch the first lookups' cache lines into L1 (see the .cu).
  bool prefetch_lookups = true;
  // kClusterMerge (and kDependentLaunch with query_cluster > 1): the queries loaded once per
  // cluster by TMA multicast (false: every block copies all 64 KB itself, as without clusters).
  // Where q is not 16-byte aligned every block copies its own.
  bool multicast_queries = true;
  // kDependentLaunch: the splits launched as clusters of this many consecutive splits of a
  // request (2 .. 8; 1: no clusters) that load the queries once by multicast; the partials and the
  // merge kernel as without, the same bits. Used only where it divides the split count and
  // multicast_queries is true. 2 was 0-0.7 us faster than 1 at batch 1 and 32 where the splits
  // are even, in one run on an H200 (docs/perf.md, 2026-12-04), but the engine's GPU tests have
  // not run with it, so the default stays 1 (no clusters); larger clusters may not all fit at
  // once (SparseDecodeMaxActiveClusters).
  int64_t query_cluster = 1;
};

// Splits of the KV axis for this launch: ceil((window_size + compressed_slots) /
// entries_per_split).
int64_t SparseDecodeSplits(const SparseDecodeParams& params);

// A split size (multiple of kSparseTile) for requests of up to `max_entries` entries: the one a
// cost model fitted to H200 measurements (see the definition) predicts fastest, within one wave of
// blocks (one per multiprocessor). Splitting shortens each block's list but adds partial outputs
// and the combine kernel, so small lists and batches that fill the wave stay whole. Host
// arithmetic.
int64_t SparseDecodeEntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries,
                                    int sm_count);

// kClusterMerge's split size: SparseDecodeEntriesPerSplit's pick, with fewer splits where its
// clusters would not all run at once (each block of a cluster needs a multiprocessor of the same
// GPC, so fewer clusters of 4 fit than 132 / 4) or would exceed kSparseMaxClusterSplits:
// the most splits s <= the pick with max_active_clusters[s] >= batch * heads / 64 (one cluster
// per request and head group). max_active_clusters: [kSparseMaxClusterSplits + 1], entry s the
// device's SparseDecodeMaxActiveClusters(s) (entries 0 and 1 unused). Host arithmetic.
int64_t SparseDecodeClusterEntriesPerSplit(int64_t batch, int64_t heads, int64_t max_entries,
                                           int sm_count, const int* max_active_clusters);

// kClusterMerge: how many clusters of `splits` split blocks (2 .. kSparseMaxClusterSplits) the
// current device runs at once (cudaOccupancyMaxActiveClusters; a cluster's blocks share a GPC,
// one block per multiprocessor); 0 for other sizes or on an error (cleared). Host call.
int SparseDecodeMaxActiveClusters(int64_t splits);

// Device workspace the launch needs: bf16 partial outputs and fp32 maxima and sums per split (the
// same for every variant, so a caller may switch variants on one workspace; kClusterMerge uses it
// only where it runs as kDependentLaunch).
size_t SparseDecodeWorkspaceBytes(const SparseDecodeParams& params);

// Runs the split kernel and, when there is more than one split and no cluster merges them, the
// combine kernel on `stream`. Returns cudaErrorInvalidValue on bad arguments (heads not a multiple
// of 64, entries_per_split not a multiple of kSparseTile, softmax_scale not > 0, unknown variant,
// query_cluster outside 1 .. kSparseMaxClusterSplits, workspace too small, missing pointers), else
// the launch status. No state besides one-time kernel attributes (make the first call outside
// graph capture: it sets them for every variant): concurrent calls with distinct workspaces are
// safe. The queries' tensor map (clusters) is encoded on the host at each call.
cudaError_t sparse_decode_attention(const SparseDecodeParams& params, void* workspace,
                                    size_t workspace_bytes, __nv_bfloat16* out,
                                    cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
