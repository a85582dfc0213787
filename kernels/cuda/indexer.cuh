// Lightning indexer (DeepSeek-V4 compressed sparse attention) for decode: scores one query token
// per request against that request's paged indexer keys, then picks the top-k entries.
//
// score[b, s] = softmax_scale * sum_h w[b, h] * ReLU(q[b, h, :] . key[b, s, :])
// for s < visible[b] = min(n_keys[b], (positions[b] + 1) / rate) (an entry compresses `rate`
// tokens and becomes visible once all of them precede the query). Source: transformers 5.17
// modeling_deepseek_v4.py, DeepseekV4IndexerScorer / DeepseekV4Indexer.forward; CPU reference
// engine/indexer.cc (whose `w` already holds weights_proj(x) / sqrt(heads)).
// Top-k follows kernels/cuda/topk.cuh (the CPU tie rule: lower index first, -1 past visible).
//
// Layouts: q [batch, kIndexHeads, kIndexHeadDim] bf16 (RoPE already applied); w [batch,
// kIndexHeads] fp32; key_pool [pages, page_size, kIndexHeadDim] bf16; page_table [batch,
// page_table_stride] int32 (logical page -> pool page). Key s of request b lives in pool page
// page_table[b][s / page_size], slot s % page_size. Slots past n_keys[b] are never read, so stale
// or NaN page tails cannot leak.
//
// Method (indexer_scores): the visible keys of all requests, in 64-key tiles request by request,
// are split into equal contiguous ranges, one per block (two 128-thread blocks per SM, one wave),
// whatever the lengths; each block streams its range through a 5-stage cp.async pipeline (16
// consecutive threads copy one 256-byte key row) and scores each tile with bf16 m16n8k16
// tensor-core products against the request's queries held in registers, reloading them where its
// range enters the next request. Batches past 1024 requests run as several launches.
//
// Programmatic dependent launch: the scores kernels are launched with programmatic stream
// serialization, wait (griddepcontrol.wait) for the kernel before them before they touch memory,
// and let the kernel after them (top_k, launched the same way) start its launch at once, so the
// launches overlap the previous kernel's drain inside a CUDA graph.
//
// CUDA-graph safe: the launch shape depends only on (batch, max_keys); n_keys and positions are
// read from device memory when the kernels run. No allocation, no state besides one-time kernel
// attributes: make the first call outside graph capture. Concurrent calls on different outputs are
// safe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/topk.cuh"

namespace pdserve::kernels::cuda {

inline constexpr int64_t kIndexHeads = 64;
inline constexpr int64_t kIndexHeadDim = 128;

// Which kernel computes the scores (same contract, same results up to fp32 summation order):
// kWgmma (sm_90a, the default) stages the queries in shared memory once per request and runs
// Hopper's warpgroup MMA with the 64 heads as M and a 64-key tile as N; kMmaSync holds the
// queries in registers as mma.sync B fragments. Chosen by measurement (issue 30; H200,
// 2026-12-04, bench/cuda/results/2026-12-04-graph.md): the whole indexer (scores + top-k) with
// kWgmma 1.1-1.5x faster at every batch x context measured, e.g. 32 x 32K 39.6 vs 46.9 us, 128 x
// 128K 296.5 vs 331.8 us (1.27x the read floor).
// kWgmmaQueryRegisters (issue 30) holds the queries in registers as wgmma A fragments, which
// lets three blocks of 4 key stages share a multiprocessor (launches of up to ~850 requests)
// instead of two of 5.
enum class IndexerScoresVariant { kMmaSync, kWgmma, kWgmmaQueryRegisters };

struct IndexerParams {
  const __nv_bfloat16* q = nullptr;
  const float* weights = nullptr;
  const __nv_bfloat16* key_pool = nullptr;
  const int32_t* page_table = nullptr;
  int64_t page_table_stride = 0;
  int64_t page_size = 64;
  const int32_t* n_keys = nullptr;     // [batch], device
  const int32_t* positions = nullptr;  // [batch], device: the query token's position
  int64_t rate = 4;                    // tokens per compressed entry
  int64_t batch = 0;
  int64_t max_keys = 0;  // capacity bound: visible[b] is clamped to it; scores' row stride
  float softmax_scale = 1.0f;
  IndexerScoresVariant scores_variant = IndexerScoresVariant::kWgmma;
  TopKVariant topk_variant = kDefaultTopKVariant;  // lightning_indexer's top-k kernel
};

// Writes scores[b, 0 .. visible[b]) (fp32, row stride max_keys; entries past visible[b] are left
// untouched) and visible[b] (int32). Returns cudaErrorInvalidValue on bad arguments, else the
// launch status. Asynchronous on `stream`.
cudaError_t indexer_scores(const IndexerParams& params, float* scores, int32_t* visible,
                           cudaStream_t stream);

// indexer_scores followed by top_k: picks [batch, topk] int32, entry indices in descending score
// order, -1 after the min(visible, topk) valid ones. `scores` and `visible` are workspace of the
// sizes above.
cudaError_t lightning_indexer(const IndexerParams& params, int64_t topk, float* scores,
                              int32_t* visible, int32_t* picks, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
