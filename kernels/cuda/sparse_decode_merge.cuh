// The merge of sparse_decode_attention's splits (sparse_decode_attention.cuh), internal to
// kernels/cuda/sparse_decode_attention.cu: each split block of a request and 64-head group leaves
// its unnormalized output (bf16) with its fp32 reference maxima m_i and sums l_i (log2 domain);
//   out = sum_i w_i o_i / (sum_i w_i l_i + exp2(sink - top)), w_i = exp2(m_i - top),
// top the largest of the maxima and the sink; zeros when nothing is visible (top = -inf). Two
// ways to run it: SparseDecodeCombineKernel (kSplitCombine: a second kernel, one block per
// request and head) and MergeSplitsIfLast (kFusedCombine: the split block that writes the last
// partials of its request merges them all).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/sparse_decode_attention.cuh"

namespace pdserve::kernels::cuda::sparse_decode {
// Unnamed: each including .cu file gets its own copy.
namespace {

constexpr int kMergeDim = static_cast<int>(kSparseHeadDim);
constexpr int kMergeHeads = static_cast<int>(kSparseHeadsPerBlock);
constexpr int kMergeThreads = 256;  // the split kernel's two consumer warpgroups
constexpr float kMergeLog2e = 1.4426950408889634f;

// Where a split block's results go: the final output, or its partials (bf16 unnormalized output
// [batch, splits, heads, 512], fp32 maxima and sums [batch, splits, heads]) and, with
// kFusedCombine, the counters [batch, heads / 64] (zero between launches).
struct SplitOutputs {
  __nv_bfloat16* out = nullptr;
  __nv_bfloat16* part_out = nullptr;
  float* part_max = nullptr;
  float* part_sum = nullptr;
  uint32_t* counters = nullptr;
};

// Bytes of shared memory MergeSplitsIfLast needs as scratch: a flag, the weights [split][head]
// and 1 / denominator per head.
constexpr int kMergeScratchBytes = 16 + (kSparseMaxFusedSplits + 1) * kMergeHeads * 4;

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

// The split kernel's 256 consumer threads only (named barrier 1).
__device__ __forceinline__ void MergeBarrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kMergeThreads) : "memory");
}

// kFusedCombine, run by the 256 consumer threads of split block blockIdx.x of request b, heads
// head0 .. head0 + 63, after they stored its partials: counts the block on the (request, head
// group) counter; the block that counts last (every split's stores are fenced before its count:
// the CUDA programming guide's last-block pattern, so all partials are visible to it) merges the
// `active` splits (the formula above, in fp32) into `out` and puts the counter back to zero, so
// the next launch finds it zero. `scratch`: kMergeScratchBytes of shared memory nothing else uses.
__device__ __forceinline__ void MergeSplitsIfLast(const SparseDecodeParams& p, int64_t b, int head0,
                                                  int active, unsigned char* scratch,
                                                  const SplitOutputs& so) {
  const int tid = threadIdx.x;
  const int64_t splits = gridDim.x;
  uint32_t* const counter = so.counters + b * gridDim.z + blockIdx.z;
  volatile int* const last = reinterpret_cast<volatile int*>(scratch);
  float* const weights = reinterpret_cast<float*>(scratch + 16);  // [split][head]
  float* const inv_denom = weights + kSparseMaxFusedSplits * kMergeHeads;
  const auto row_of = [&](int sp, int head) { return (b * splits + sp) * p.heads + head0 + head; };
  __threadfence();
  MergeBarrier();
  if (tid == 0) *last = atomicAdd(counter, 1u) == static_cast<uint32_t>(active - 1) ? 1 : 0;
  MergeBarrier();
  if (*last == 0) return;
  __threadfence();
  if (tid == 0) *counter = 0u;
  {
    // Four threads per head, each over splits part, part + 4, ...: the top, each split's weight
    // and the denominator.
    const int head = tid >> 2;
    const int part = tid & 3;
    const float sink = p.sinks[head0 + head] * kMergeLog2e;  // a logit, not scaled
    float top = sink;
    for (int sp = part; sp < active; sp += 4) {
      top = fmaxf(top, __ldcg(so.part_max + row_of(sp, head)));
    }
    top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, 2));
    float denom = 0.0f;
    for (int sp = part; sp < active; sp += 4) {
      const int64_t row = row_of(sp, head);
      const float weight = MergeWeight(__ldcg(so.part_max + row), top);
      weights[sp * kMergeHeads + head] = weight;
      denom += weight * __ldcg(so.part_sum + row);
    }
    denom += __shfl_xor_sync(0xFFFFFFFFu, denom, 1);
    denom += __shfl_xor_sync(0xFFFFFFFFu, denom, 2);
    denom += MergeWeight(sink, top);
    if (part == 0) inv_denom[head] = denom > 0.0f ? 1.0f / denom : 0.0f;
  }
  MergeBarrier();
  // Each thread: 16 units of 8 dims (unit i = tid + 256 k, head i / 64), each split's partial of
  // all 16 loaded before any is added, so 16 loads are in flight per thread.
  constexpr int kUnits = kMergeHeads * kMergeDim / 8 / kMergeThreads;
  float acc[kUnits][8];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[k][j] = 0.0f;
  }
  for (int sp = 0; sp < active; ++sp) {
    uint4 raw[kUnits];
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const int i = tid + kMergeThreads * k;
      raw[k] = __ldcg(reinterpret_cast<const uint4*>(so.part_out + row_of(sp, i >> 6) * kMergeDim) +
                      (i & 63));
    }
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      const float weight = weights[sp * kMergeHeads + ((tid + kMergeThreads * k) >> 6)];
      const uint32_t words[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
        acc[k][2 * j] += weight * v.x;
        acc[k][2 * j + 1] += weight * v.y;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int i = tid + kMergeThreads * k;
    const float inv = inv_denom[i >> 6];
    uint4 packed;
    packed.x = PackBf16(acc[k][0] * inv, acc[k][1] * inv);
    packed.y = PackBf16(acc[k][2] * inv, acc[k][3] * inv);
    packed.z = PackBf16(acc[k][4] * inv, acc[k][5] * inv);
    packed.w = PackBf16(acc[k][6] * inv, acc[k][7] * inv);
    reinterpret_cast<uint4*>(so.out + (b * p.heads + head0 + (i >> 6)) * kMergeDim)[i & 63] =
        packed;
  }
}

// kSplitCombine's second kernel: one block of 128 threads per (request, head) merges the splits
// that had entries (sequentially, in split order) and the sink.
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

}  // namespace
}  // namespace pdserve::kernels::cuda::sparse_decode
