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

// Shared memory MergeSplitsIfLast needs: `scratch` (a flag, the weights [split][head] and 1 /
// denominator per head) and `buffers` (two splits' partials, 64 KB each).
constexpr int kMergeScratchBytes = 16 + (kSparseMaxFusedSplits + 1) * kMergeHeads * 4;
constexpr int kMergePartialBytes = kMergeHeads * kMergeDim * 2;
constexpr int kMergeBufferBytes = 2 * kMergePartialBytes;

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

// 16 bytes global -> shared through L2 (coherent with other blocks' fenced stores), and the wait
// for every such copy of this thread; the memory clobbers keep shared-memory reads after it.
__device__ __forceinline__ void MergeCopy16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void MergeCopyWait() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// kFusedCombine, run by the 256 consumer threads of split block blockIdx.x of request b, heads
// head0 .. head0 + 63, after they stored its partials (own_staged: the same bf16 values in shared
// memory, head h's 16-byte unit u at staged_offset(h, u)): counts the block on the (request,
// head group) counter; the block that counts last (every split's stores are fenced before its
// count: the CUDA programming guide's last-block pattern, so all partials are visible to it)
// merges the `active` splits (the formula above, in fp32, split by split in split order, so the
// bits do not depend on which block came last) into `out` and puts the counter back to zero, so
// the next launch finds it zero. The other splits' partials come through `buffers`, two splits
// per round trip (cp.async: each thread copies and then reads only its own units). `scratch` and
// `buffers`: kMergeScratchBytes and kMergeBufferBytes of shared memory nothing else uses now.
template <typename StagedOffset>
__device__ __forceinline__ void MergeSplitsIfLast(const SparseDecodeParams& p, int64_t b, int head0,
                                                  int active, const unsigned char* own_staged,
                                                  StagedOffset staged_offset,
                                                  unsigned char* scratch, unsigned char* buffers,
                                                  const SplitOutputs& so) {
  const int tid = threadIdx.x;
  const int own = static_cast<int>(blockIdx.x);
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
  // Each thread's 16 units of 8 dims: unit i = tid + 256 k, head i / 64.
  constexpr int kUnits = kMergeHeads * kMergeDim / 8 / kMergeThreads;
  // Splits sp .. end - 1 of a round: at most two that are not this block's own.
  const auto round_end = [&](int sp) {
    int others = 0;
    int end = sp;
    while (end < active && (end == own || others < 2)) others += end++ != own;
    return end;
  };
  const auto issue_round = [&](int sp, int end) {
    for (int s = sp, buffer = 0; s < end; ++s) {
      if (s == own) continue;
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        const int i = tid + kMergeThreads * k;
        MergeCopy16(buffers + buffer * kMergePartialBytes + i * 16,
                    so.part_out + row_of(s, i >> 6) * kMergeDim + (i & 63) * 8);
      }
      ++buffer;
    }
  };
  // The first round's copies fly while the weights are worked out: four threads per head, each
  // over splits part, part + 4, ... (all loads of a thread issued before any is used).
  int end = round_end(0);
  issue_round(0, end);
  {
    const int head = tid >> 2;
    const int part = tid & 3;
    constexpr int kPer = kSparseMaxFusedSplits / 4;
    float m[kPer];
    float l[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int sp = part + 4 * j;
      m[j] = sp < active ? __ldcg(so.part_max + row_of(sp, head)) : -INFINITY;
      l[j] = sp < active ? __ldcg(so.part_sum + row_of(sp, head)) : 0.0f;
    }
    const float sink = p.sinks[head0 + head] * kMergeLog2e;  // a logit, not scaled
    float top = sink;
#pragma unroll
    for (int j = 0; j < kPer; ++j) top = fmaxf(top, m[j]);
    top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, 1));
    top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, 2));
    float denom = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int sp = part + 4 * j;
      if (sp >= active) continue;
      const float weight = MergeWeight(m[j], top);
      weights[sp * kMergeHeads + head] = weight;
      denom += weight * l[j];
    }
    denom += __shfl_xor_sync(0xFFFFFFFFu, denom, 1);
    denom += __shfl_xor_sync(0xFFFFFFFFu, denom, 2);
    denom += MergeWeight(sink, top);
    if (part == 0) inv_denom[head] = denom > 0.0f ? 1.0f / denom : 0.0f;
  }
  MergeBarrier();
  float acc[kUnits][8];
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[k][j] = 0.0f;
  }
  for (int sp = 0; sp < active;) {
    MergeCopyWait();
    for (int buffer = 0; sp < end; ++sp) {
#pragma unroll
      for (int k = 0; k < kUnits; ++k) {
        const int i = tid + kMergeThreads * k;
        const uint4 raw =
            sp == own
                ? *reinterpret_cast<const uint4*>(own_staged + staged_offset(i >> 6, i & 63))
                : *reinterpret_cast<const uint4*>(buffers + buffer * kMergePartialBytes + i * 16);
        const float weight = weights[sp * kMergeHeads + (i >> 6)];
        const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
          acc[k][2 * j] += weight * v.x;
          acc[k][2 * j + 1] += weight * v.y;
        }
      }
      buffer += sp != own;
    }
    // This thread's reads of the buffers are done: the next round may overwrite its units.
    if (sp < active) {
      end = round_end(sp);
      issue_round(sp, end);
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
