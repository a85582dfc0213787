// The merge of sparse_decode_attention's splits (sparse_decode_attention.cuh), internal to
// kernels/cuda/sparse_decode_attention.cu: each split block of a request and 64-head group leaves
// its unnormalized output (bf16) with its fp32 reference maxima m_i and sums l_i (log2 domain);
//   out = sum_i w_i o_i / (sum_i w_i l_i + exp2(sink - top)), w_i = exp2(m_i - top),
// top the largest of the maxima and the sink; zeros when nothing is visible (top = -inf). Two
// kernels compute it: SparseDecodeCombineKernel (kSplitCombine) and SparseDecodeMergeKernel
// (kDependentLaunch); kClusterMerge's split blocks compute it themselves (MergeInCluster).
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/block_trace.h"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"

namespace pdserve::kernels::cuda::sparse_decode {
// Unnamed: each including .cu file gets its own copy.
namespace {

constexpr int kMergeDim = static_cast<int>(kSparseHeadDim);
constexpr float kMergeLog2e = 1.4426950408889634f;

// Where a split block's results go: the final output, or its partials (bf16 unnormalized output
// [batch, splits, heads, 512], fp32 maxima and sums [batch, splits, heads]).
struct SplitOutputs {
  __nv_bfloat16* out = nullptr;
  __nv_bfloat16* part_out = nullptr;
  float* part_max = nullptr;
  float* part_sum = nullptr;
  BlockTrace trace;  // the split kernel's block timeline (block_trace.h): a benchmark's, else empty
};

__device__ __forceinline__ int WindowRows(const SparseDecodeParams& p, int window_len) {
  return static_cast<int>(min(max(int64_t{window_len}, int64_t{0}), p.window_size));
}

// Entries of a request's list: its window rows, then the CSA slots or the HCA entries written.
__device__ __forceinline__ int RequestEntries(const SparseDecodeParams& p, int window_len,
                                              int n_compressed) {
  int64_t compressed = p.compressed_slots;
  if (p.indices == nullptr) {
    compressed = min(max(int64_t{n_compressed}, int64_t{0}), p.compressed_slots);
  }
  return WindowRows(p, window_len) + static_cast<int>(compressed);
}

__device__ __forceinline__ float MergeWeight(float m, float top) {
  return top == -INFINITY ? 0.0f : exp2f(m - top);
}

// acc[0 .. 7] += weight * the 8 bf16 of `raw` (one split's 16-byte unit of unnormalized output).
__device__ __forceinline__ void AddWeighted(float (&acc)[8], float weight, const uint4& raw) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[k]));
    acc[2 * k] += weight * v.x;
    acc[2 * k + 1] += weight * v.y;
  }
}

// acc / denom as 8 bf16 (zeros when denom is 0: nothing visible).
__device__ __forceinline__ uint4 Normalized(const float (&acc)[8], float denom) {
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  uint32_t packed[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(acc[2 * k] * inv, acc[2 * k + 1] * inv);
    packed[k] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// kSplitCombine's combine kernel: one block of 128 threads per (request, head) merges the splits
// that had entries (in split order) and the sink.
__global__ void __launch_bounds__(kMergeDim / 4)
    SparseDecodeCombineKernel(SparseDecodeParams p, int splits, const __nv_bfloat16* part_out,
                              const float* part_max, const float* part_sum, __nv_bfloat16* out) {
  const int64_t b = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int entries = RequestEntries(p, p.window_len[b], p.n_compressed[b]);
  const int per_split = static_cast<int>(p.entries_per_split);
  const int active = min(splits, (entries + per_split - 1) / per_split);
  const float sink = p.sinks[h] * kMergeLog2e;  // a logit, not scaled by softmax_scale
  float top = sink;
  for (int sp = 0; sp < active; ++sp) top = fmaxf(top, part_max[(b * splits + sp) * p.heads + h]);
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float denom = 0.0f;
  if (top != -INFINITY) {
    denom = exp2f(sink - top);
    for (int sp = 0; sp < active; ++sp) {
      const int64_t row = (b * splits + sp) * p.heads + h;
      const float weight = exp2f(part_max[row] - top);
      denom += weight * part_sum[row];
      const uint2 raw = reinterpret_cast<const uint2*>(part_out + row * kMergeDim)[threadIdx.x];
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      acc.x += weight * lo.x;
      acc.y += weight * lo.y;
      acc.z += weight * hi.x;
      acc.w += weight * hi.y;
    }
  }
  const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
  __nv_bfloat16* o = out + (b * p.heads + h) * kMergeDim + 4 * threadIdx.x;
  reinterpret_cast<__nv_bfloat162*>(o)[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  reinterpret_cast<__nv_bfloat162*>(o)[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
}

// kDependentLaunch's combine kernel: the same arithmetic per output element (so the same bits),
// laid out for fewer, fuller threads: one block of 256 threads per (request, 4 heads), each
// thread 8 dims (16-byte loads and stores), at most 64 registers so that batch 32's 512 blocks
// run in one wave. Launched as a programmatic dependent of the split kernel (it waits for it
// before reading anything). Requests with at most one split that had entries are skipped (the
// split kernel wrote their output). The loads go out four splits at a time before any is used,
// through L2 (__ldcg), the first four together with the request's lengths (splits past the
// request's entries are loaded and not used), so up to four splits cost one round trip.
constexpr int kMergeHeadsPerBlock = 4;
constexpr int kMergeThreads = kMergeHeadsPerBlock * kMergeDim / 8;
__global__ void __launch_bounds__(kMergeThreads, 4)
    SparseDecodeMergeKernel(SparseDecodeParams p, int splits, const __nv_bfloat16* part_out,
                            const float* part_max, const float* part_sum, __nv_bfloat16* out) {
  hopper::GridDependencyWait();
  hopper::GridDependencyTrigger();
  const int64_t b = blockIdx.x;
  const int64_t h = int64_t{blockIdx.y} * kMergeHeadsPerBlock + (threadIdx.x >> 6);
  const int unit = static_cast<int>(threadIdx.x & 63);
  const float sink = p.sinks[h] * kMergeLog2e;  // a logit, not scaled by softmax_scale
  const auto row_of = [&](int sp) { return (b * splits + sp) * p.heads + h; };
  constexpr int kChunk = 4;
  float m[kChunk];
  float l[kChunk];
  uint4 raw[kChunk];
  const auto load = [&](int first, int bound) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const bool ok = first + j < bound;
      const int64_t row = row_of(ok ? first + j : 0);
      m[j] = ok ? __ldcg(part_max + row) : -INFINITY;
      l[j] = ok ? __ldcg(part_sum + row) : 0.0f;
      raw[j] = ok ? __ldcg(reinterpret_cast<const uint4*>(part_out + row * kMergeDim) + unit)
                  : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  load(0, splits);
  const int entries = RequestEntries(p, p.window_len[b], p.n_compressed[b]);
  const int per_split = static_cast<int>(p.entries_per_split);
  const int active = min(splits, (entries + per_split - 1) / per_split);
  if (active <= 1) return;
  float top = sink;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) top = fmaxf(top, j < active ? m[j] : -INFINITY);
  for (int first = kChunk; first < active; first += kChunk) {
#pragma unroll
    for (int j = 0; j < kChunk && first + j < active; ++j) {
      top = fmaxf(top, __ldcg(part_max + row_of(first + j)));
    }
  }
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  float denom = 0.0f;
  if (top != -INFINITY) {
    denom = exp2f(sink - top);
    for (int first = 0; first < active; first += kChunk) {
      if (first > 0) load(first, active);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (first + j >= active) break;
        const float weight = exp2f(m[j] - top);
        denom += weight * l[j];
        AddWeighted(acc, weight, raw[j]);
      }
    }
  }
  reinterpret_cast<uint4*>(out + (b * p.heads + h) * kMergeDim)[unit] = Normalized(acc, denom);
}

// Byte offset of (head, 16-byte unit u) in a block's bf16 output staged in shared memory: rows of
// 1 KB, the unit XOR-ed with head % 8 so the 8 heads a warp writes at once fall in different banks.
__device__ __forceinline__ int StagedOutputOffset(int head, int unit) {
  return head * kMergeDim * 2 + ((unit ^ (head & 7)) << 4);
}

// kClusterMerge's merge, run by `threads` threads (indices 0 .. threads - 1 in `thread`) of every
// block of a cluster of `splits` blocks (one per split, rank = split), after a cluster barrier
// that follows the splits' staging: every block b < `active` holds its unnormalized bf16 output
// at `staged` (StagedOutputOffset layout, kMergeHeads heads) and its maxima and sums at
// `stats` [kMergeHeads] float2 (log2 domain), at the same offsets in each block. This block
// writes the final rows of heads [rank * 64 / splits, (rank + 1) * 64 / splits) of its group to
// out_rows ([64 heads, 512] bf16) with the arithmetic of SparseDecodeMergeKernel per element (the
// same splits in the same order, so the same bits). One 16-byte item of every block per pass (a
// round trip of distributed shared memory each): a merge that issued all of a thread's loads
// before using any, unrolled per cluster size, was 3 us slower at batch 32 (docs/perf.md,
// 2026-12-04 round 2). sinks: the group's 64 sinks. The caller keeps every block's shared memory
// alive (a second cluster barrier) until all have read it.
template <int MAX_SPLITS>
__device__ __forceinline__ void MergeInCluster(const unsigned char* staged, const float2* stats,
                                               int active, const float* sinks,
                                               __nv_bfloat16* out_rows, int thread, int threads) {
  namespace cg = cooperative_groups;
  constexpr int kMergeHeads = 64;
  constexpr int kUnits = kMergeDim / 8;  // 16-byte units per head
  cg::cluster_group cluster = cg::this_cluster();
  const int splits = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int head_begin = kMergeHeads * rank / splits;
  const int head_end = kMergeHeads * (rank + 1) / splits;
  for (int i = head_begin * kUnits + thread; i < head_end * kUnits; i += threads) {
    const int head = i / kUnits;
    const int unit = i % kUnits;
    const float sink = sinks[head] * kMergeLog2e;  // a logit, not scaled by softmax_scale
    const auto* const my_row =
        reinterpret_cast<const uint4*>(staged + StagedOutputOffset(head, unit));
    float m[MAX_SPLITS];
    float l[MAX_SPLITS];
    uint4 raw[MAX_SPLITS];
#pragma unroll
    for (int sp = 0; sp < MAX_SPLITS; ++sp) {
      m[sp] = -INFINITY;
      l[sp] = 0.0f;
      raw[sp] = make_uint4(0u, 0u, 0u, 0u);
      if (sp < active) {
        const float2 ml = *cluster.map_shared_rank(stats + head, sp);
        m[sp] = ml.x;
        l[sp] = ml.y;
        raw[sp] = *cluster.map_shared_rank(my_row, sp);
      }
    }
    float top = sink;
#pragma unroll
    for (int sp = 0; sp < MAX_SPLITS; ++sp) top = fmaxf(top, sp < active ? m[sp] : -INFINITY);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float denom = 0.0f;
    if (top != -INFINITY) {
      denom = exp2f(sink - top);
#pragma unroll
      for (int sp = 0; sp < MAX_SPLITS; ++sp) {
        if (sp >= active) break;
        const float weight = exp2f(m[sp] - top);
        denom += weight * l[sp];
        AddWeighted(acc, weight, raw[sp]);
      }
    }
    reinterpret_cast<uint4*>(out_rows + head * kMergeDim)[unit] = Normalized(acc, denom);
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda::sparse_decode
