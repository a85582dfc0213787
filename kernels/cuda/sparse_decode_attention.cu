#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/block_trace.cuh"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/sparse_decode_attention.cuh"
#include "kernels/cuda/sparse_decode_layout.cuh"
#include "kernels/cuda/sparse_decode_merge.cuh"
#include "kernels/cuda/sparse_decode_producer.cuh"
#include "kernels/cuda/tensor_map.cuh"

namespace pdserve::kernels::cuda {
namespace {

using hopper::ClusterArrive;
using hopper::ClusterWait;
using hopper::FenceBarrierInit;
using hopper::FenceProxyAsync;
using hopper::FenceRegisters;
using hopper::GridDependencyTrigger;
using hopper::GridDependencyWait;
using hopper::MbarrierArrive;
using hopper::MbarrierArriveExpectTx;
using hopper::MbarrierInit;
using hopper::MbarrierWait;
using hopper::SmemDescriptor;
using hopper::TmaLoad2dMulticast;
using hopper::WgmmaCommit;
using hopper::WgmmaFence;
using hopper::WgmmaM64N256K16Bf16RegA;
using hopper::WgmmaM64N32K16Bf16;
using hopper::WgmmaWait;
using sparse_decode::MergeInCluster;
using sparse_decode::MergeWeight;
using sparse_decode::RequestEntries;
using sparse_decode::SparseDecodeCombineKernel;
using sparse_decode::SparseDecodeMergeKernel;
using sparse_decode::SplitOutputs;
using sparse_decode::StagedOutputOffset;
using sparse_decode::WindowRows;

// Design (sm_90a). One block per (split, request, 64-head group), 3 warpgroups:
// - Producer (warpgroup 2, 4 warps at 56 registers after setmaxnreg): copies the queries, then
//   resolves each 32-row tile's rows (window row, or CSA index -> pool page: dependent loads it
//   runs one and two blocks of four tiles ahead) and copies them with cp.async into a ring of
//   kStages stages, each completing on an mbarrier, so up to four tiles are in flight.
// - Consumers (warpgroups 0 and 1, 224 registers): Hopper's warpgroup MMA (wgmma) with the 64
//   query heads as M, taking turns over the tiles (see Consume): warpgroup w computes the full
//   scores S = Q K^T of tiles w, w + 2, ... (both operands from shared memory) and their softmax,
//   and hands P (bf16) with the reference maxima to the other warpgroup; each accumulates its
//   half of the output columns, O[:, half w] += P V[:, half w] over every tile. One warpgroup's
//   softmax runs while the other's products occupy the tensor cores. The softmax rescales o
//   lazily (only when the maximum moves by more than kRescaleSlack).
// The output leaves through shared memory in whole 16-byte stores, in bf16: final with one split,
// else each split's unnormalized output (with its fp32 reference maxima and sums) that a combine
// kernel merges, in fp32, with the sink (kClusterMerge: that the cluster's blocks merge from each
// other's shared memory). Measured figures and what limits them: docs/perf.md. Shapes and the
// shared-memory layout: sparse_decode_layout.cuh; the producer: sparse_decode_producer.cuh.

__device__ __forceinline__ void FenceFragment(uint32_t (&a)[2][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) asm volatile("" : "+r"(a[i / 4][i % 4])::"memory");
}
// The two consumer warpgroups only (barrier 0 is __syncthreads, which the producer would need).
__device__ __forceinline__ void ConsumerBarrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
}

// Accumulators of one consumer thread: output o for heads (head_lo, head_lo + 8) and columns
// 256 * warpgroup + 8n + 2t (+1); per head the reference maximum of the scaled scores (log2
// domain; the same sequence of values in both warpgroups, see Consume) and the sum of
// exp2(score - reference) over this warpgroup's own tiles.
struct ConsumerState {
  float o[128];
  float running_max[2];
  float running_sum[2];
};

__device__ __forceinline__ uint32_t StageAddress(uint32_t base, int it) {
  return base + kTileOffset + (it % kStages) * kTileBytes;
}

// Waits until tile `it`'s rows have landed; then they are visible to wgmma.
__device__ __forceinline__ void WaitFull(uint32_t base, int it) {
  MbarrierWait(base + kBarrierOffset + (kFullBarrier + it % kStages) * 8, (it / kStages) & 1);
  FenceProxyAsync();
}

// One arrival per warp on the stage of tile `it`: this warpgroup's products that read it are done.
__device__ __forceinline__ void ReleaseStage(uint32_t base, int it) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    MbarrierArrive(base + kBarrierOffset + (kEmptyBarrier + it % kStages) * 8);
  }
}

// P handed from warpgroup `from` to the other (kPOffset: [from][k][thread] uint4, its
// reference maxima at kRefOffset: [from][thread] float2). Thread k of either warpgroup holds the
// same heads and columns of a wgmma fragment, so a hand-over is thread to thread.
__device__ __forceinline__ void NamedArrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kConsumerThreads) : "memory");
}
__device__ __forceinline__ void NamedSync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kConsumerThreads) : "memory");
}

// True when `value` is true in every thread of consumer warpgroup WG (its own named barrier, 4 +
// WG: a warpgroup-uniform answer, as issuing a wgmma or not must be).
template <int WG>
__device__ __forceinline__ bool WarpgroupAll(bool value) {
  uint32_t all;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.and.pred q, %2, 128, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(all)
      : "r"(value ? 1u : 0u), "n"(4 + WG)
      : "memory");
  return all != 0;
}

// Issues S = Q K^T over all 512 dims of the stage at `tile` (32 wgmma, one commit group).
__device__ __forceinline__ void IssueScores(float (&s)[16], uint32_t base, uint32_t tile) {
  WgmmaFence();
#pragma unroll
  for (int ks = 0; ks < kDim / 16; ++ks) {
    const int region = ks / 4;
    const int column_bytes = (ks % 4) * 32;
    WgmmaM64N32K16Bf16(
        s, SmemDescriptor(base + kQOffset + region * kQRegionBytes + column_bytes, 16, 1024),
        SmemDescriptor(tile + region * kTileRegionBytes + column_bytes, 16, 1024), ks > 0);
  }
  WgmmaCommit();
}

// Issues O[:, half WG] += P V[:, half WG] over the stage at `tile` (2 wgmma, one commit group).
// B = rows 16kk .. 16kk + 15 of the stage, dims 256 * WG ..: MN-major (dims contiguous), leading
// byte offset = one region (64 dims), stride byte offset = 8 rows.
template <int WG>
__device__ __forceinline__ void IssueValues(float (&o)[128], const uint32_t (&a)[2][4],
                                            uint32_t tile) {
  WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    WgmmaM64N256K16Bf16RegA(
        o, a[kk],
        SmemDescriptor(tile + 4 * WG * kTileRegionBytes + kk * 16 * 128, kTileRegionBytes, 1024));
  }
  WgmmaCommit();
}

// Moves this thread's reference maxima up to `to` (never down): o and the sums follow. Only while
// no wgmma writes o. A reference that moved nowhere in the warp leaves o as it is (a real branch).
__device__ __forceinline__ void RaiseReference(ConsumerState& st, float to0, float to1) {
  const float to[2] = {to0, to1};
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    alpha[r] = 1.0f;
    if (to[r] > st.running_max[r]) {
      alpha[r] = exp2f(st.running_max[r] - to[r]);  // 0 while nothing was visible
      st.running_max[r] = to[r];
      st.running_sum[r] *= alpha[r];
    }
  }
  if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      st.o[4 * n] *= alpha[0];
      st.o[4 * n + 1] *= alpha[0];
      st.o[4 * n + 2] *= alpha[1];
      st.o[4 * n + 3] *= alpha[1];
    }
  }
}

// The softmax of tile `it` (scores complete in `s`, no wgmma in flight). The reference maxima
// first take the other warpgroup's (ref_{it-1}, `other_ref`), then rise when a score exceeds them
// by more than kRescaleSlack (lazy rescaling: probabilities relative to the reference stay below
// 2^kRescaleSlack and o is rescaled rarely; the final normalization uses the same reference, so
// the result is the softmax up to rounding: the idea of FlashAttention-4's conditional
// rescaling). Then P = exp2(scaled score - reference), its sum, and P packed to bf16 in the
// A-operand layout of the P V product.
__device__ __forceinline__ void Softmax(const SparseDecodeParams& p, const unsigned char* smem,
                                        int it, const float (&s)[16], float2 other_ref,
                                        ConsumerState& st, uint32_t (&a)[2][4]) {
  const int t = threadIdx.x & 3;
  const uint32_t attended =
      reinterpret_cast<const uint32_t*>(smem + kValidOffset)[it % kStages] >> (2 * t);
  const float scale = p.softmax_scale * kLog2e;  // > 0: the order of raw scores is kept
  // The scores stay as the tensor cores left them (ptxas serializes wgmma when other
  // instructions define its accumulator registers); the probabilities get registers of their own.
  float prob[16];
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    // s[i] is (head row (i & 3) >> 1, column 8 (i / 4) + 2t + (i & 1)) of the tile.
    const bool ok = ((attended >> (8 * (i >> 2) + (i & 1))) & 1u) != 0;
    prob[i] = ok ? s[i] : -INFINITY;
    tile_max[(i & 3) >> 1] = fmaxf(tile_max[(i & 3) >> 1], prob[i]);
  }
  float top[2];
  const float before[2] = {other_ref.x, other_ref.y};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xFFFFFFFFu, tile_max[r], 2));
    const float base = fmaxf(st.running_max[r], before[r]);
    top[r] = tile_max[r] * scale;
    top[r] = top[r] > base + kRescaleSlack ? top[r] : base;
  }
  RaiseReference(st, top[0], top[1]);
  float shift[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // With nothing visible yet the reference is -inf; subtracting 0 keeps exp2 at 0, not NaN.
    shift[r] = st.running_max[r] == -INFINITY ? 0.0f : st.running_max[r];
  }
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    prob[i] = exp2f(fmaf(prob[i], scale, -shift[(i & 3) >> 1]));
    st.running_sum[(i & 3) >> 1] += prob[i];
  }
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      a[kk][r] = PackBf16(prob[8 * kk + 2 * r], prob[8 * kk + 2 * r + 1]);
    }
  }
}

// Brings P of the other warpgroup's tile, made against its reference `made_at`, to this
// thread's reference (at least as high): a factor <= 1 per head, applied only when one moved.
__device__ __forceinline__ void Rebase(uint32_t (&a)[2][4], float2 made_at,
                                       const ConsumerState& st) {
  const float from[2] = {made_at.x, made_at.y};
  float factor[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    factor[r] = st.running_max[r] > from[r] ? exp2f(from[r] - st.running_max[r]) : 1.0f;
  }
  if (factor[0] == 1.0f && factor[1] == 1.0f) return;
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      // a[kk][r] holds head row g for even r, g + 8 for odd r (the A fragment layout).
      const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&a[kk][r]);
      const float2 f = __bfloat1622float2(v);
      a[kk][r] = PackBf16(f.x * factor[r & 1], f.y * factor[r & 1]);
    }
  }
}

// The consumer warpgroups take turns (FlashMLA's "seesaw" schedule): warpgroup w owns the tiles
// i = w, w + 2, ...: it computes their full 512-dim scores and softmax, and hands P (bf16) and the
// reference maxima to the other warpgroup; each warpgroup accumulates its half of the output
// columns over every tile, its own P from registers and the other's as received. One iteration
// of warpgroup w (its tile i):
//   wait for its products of the last iteration and release their stages; issue S_i = Q K_i^T;
//   receive P_{i-1} and ref_{i-1}; when ref_{i-1} is this warpgroup's reference for every head
//   (the usual case), issue P_{i-1} V_{i-1} at once; wait (and release tile i - 1's stage);
//   softmax of tile i from ref_{i-1} (raising o to ref_i); hand P_i, ref_i over; issue
//   P_{i-1} V_{i-1} now if it waited (P_{i-1} brought down to ref_i), and P_i V_i.
// So one warpgroup's softmax runs while the other's products occupy the tensor cores, a tile's
// stage goes back to the producer as soon as both have read it, and the reference maxima form
// one sequence over the tiles in order (ref_i from ref_{i-1}), the same in both warpgroups
// (o is only rescaled while no wgmma writes it: ptxas serializes every wgmma of the kernel
// otherwise). The warpgroup that does not own the last tile adds it after its loop. Named
// barriers: 2 + w for P handed over by warpgroup w, 4 + w for warpgroup w's votes.
template <int WG>
__device__ __forceinline__ void Consume(const SparseDecodeParams& p, int n_tiles, uint32_t base,
                                        unsigned char* smem, ConsumerState& st,
                                        const trace::BlockTraceScope& traced) {
  const int tid_wg = threadIdx.x & 127;
#pragma unroll
  for (int i = 0; i < 128; ++i) st.o[i] = 0.0f;
  st.running_max[0] = st.running_max[1] = -INFINITY;
  st.running_sum[0] = st.running_sum[1] = 0.0f;
  uint4* const p_mine = reinterpret_cast<uint4*>(smem + kPOffset) + WG * 2 * 128 + tid_wg;
  const uint4* const p_other =
      reinterpret_cast<const uint4*>(smem + kPOffset) + (WG ^ 1) * 2 * 128 + tid_wg;
  float2* const ref_mine = reinterpret_cast<float2*>(smem + kRefOffset) + WG * 128 + tid_wg;
  const float2* const ref_other =
      reinterpret_cast<const float2*>(smem + kRefOffset) + (WG ^ 1) * 128 + tid_wg;
  // P of this warpgroup's tile and of the other's: registers a wgmma reads while it runs, kept
  // alive (FenceFragment) until a wait says it is done.
  uint32_t a_own[2][4];
  uint32_t a_other[2][4];
  const auto receive = [&]() {
    NamedSync(2 + (WG ^ 1));
    const uint4 lo = p_other[0];
    const uint4 hi = p_other[128];
    a_other[0][0] = lo.x, a_other[0][1] = lo.y, a_other[0][2] = lo.z, a_other[0][3] = lo.w;
    a_other[1][0] = hi.x, a_other[1][1] = hi.y, a_other[1][2] = hi.z, a_other[1][3] = hi.w;
    return *ref_other;
  };
  if (n_tiles > 0) MbarrierWait(base + kBarrierOffset + kQBarrier * 8, 0);
  const bool marks = WG == 0 && tid_wg == 0;  // block_trace.h's marks
  if (marks) traced.Mark(kTraceSetup);
  float s[16];
  bool other_released = true;  // the stage of the other's tile it - 3 went back early
  for (int it = WG; it < n_tiles; it += 2) {
    // This warpgroup's P V products of its last iteration are done: their stages go back to the
    // producer before anything here waits for a tile (a later release would hold back the
    // copies of the tiles after this one).
    WgmmaWait<0>();
    FenceRegisters(st.o);
    FenceFragment(a_own);
    FenceFragment(a_other);
    if (it >= 2) ReleaseStage(base, it - 2);
    if (it >= 3 && !other_released) ReleaseStage(base, it - 3);
    // The scores go out before the hand-over is awaited: they need only the tile, and the other
    // warpgroup's softmax is what the two wait on in turn.
    WaitFull(base, it);
    if (marks) {
      if (it == WG) traced.Mark(kTraceFirstData);
      if (it + 2 >= n_tiles) traced.Mark(kTraceLastData);
    }
    IssueScores(s, base, StageAddress(base, it));
    float2 other_ref = make_float2(-INFINITY, -INFINITY);
    // P_{i-1} goes to the tensor cores at once when it was made against this warpgroup's
    // reference (every head of the warpgroup: the usual case once the maxima settle), so its
    // stage is released before the softmax; else after the softmax, brought down to ref_i.
    bool early = false;
    if (it >= 1) {
      other_ref = receive();
      early =
          WarpgroupAll<WG>(other_ref.x <= st.running_max[0] && other_ref.y <= st.running_max[1]);
      if (early) {
        WaitFull(base, it - 1);  // complete already (the other warpgroup waited for it)
        IssueValues<WG>(st.o, a_other, StageAddress(base, it - 1));
      }
    }
    WgmmaWait<0>();
    FenceRegisters(s);
    FenceRegisters(st.o);
    FenceFragment(a_other);
    other_released = early;
    if (early) ReleaseStage(base, it - 1);
    Softmax(p, smem, it, s, other_ref, st, a_own);
    p_mine[0] = make_uint4(a_own[0][0], a_own[0][1], a_own[0][2], a_own[0][3]);
    p_mine[128] = make_uint4(a_own[1][0], a_own[1][1], a_own[1][2], a_own[1][3]);
    *ref_mine = make_float2(st.running_max[0], st.running_max[1]);
    NamedArrive(2 + WG);
    if (it >= 1 && !early) {
      Rebase(a_other, other_ref, st);
      WaitFull(base, it - 1);
      IssueValues<WG>(st.o, a_other, StageAddress(base, it - 1));
    }
    IssueValues<WG>(st.o, a_own, StageAddress(base, it));
  }
  WgmmaWait<0>();
  FenceRegisters(st.o);
  FenceFragment(a_own);
  FenceFragment(a_other);
  if (n_tiles > 0 && ((n_tiles - 1) & 1) != WG) {
    // The other's last tile: o rises to its reference, then its P V.
    const float2 last_ref = receive();
    RaiseReference(st, last_ref.x, last_ref.y);
    WaitFull(base, n_tiles - 1);
    IssueValues<WG>(st.o, a_other, StageAddress(base, n_tiles - 1));
    WgmmaWait<0>();
    FenceRegisters(st.o);
    FenceFragment(a_other);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.running_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, st.running_sum[r], 1);
    st.running_sum[r] += __shfl_xor_sync(0xFFFFFFFFu, st.running_sum[r], 2);
  }
  // Both warpgroups end on the last tile's reference; the sums of their own tiles are added in
  // one fixed order, so both hold the same bits. The hand-over area is free once both are here.
  ConsumerBarrier();
  *ref_mine = make_float2(st.running_sum[0], st.running_sum[1]);
  ConsumerBarrier();
  const float2 theirs = *ref_other;
  st.running_sum[0] = WG == 0 ? st.running_sum[0] + theirs.x : theirs.x + st.running_sum[0];
  st.running_sum[1] = WG == 0 ? st.running_sum[1] + theirs.y : theirs.y + st.running_sum[1];
}

// How the split kernel is launched: plainly (kNoCluster), in clusters whose blocks load the
// queries once by multicast (kQueryCluster: kDependentLaunch with query_cluster > 1), or in
// clusters of all splits of a request that also merge them (kMergeCluster: kClusterMerge).
constexpr int kNoCluster = 0;
constexpr int kQueryCluster = 1;
constexpr int kMergeCluster = 2;

// The consumer warpgroups: every tile, then the output (one split) or the partials;
// kMergeCluster: the partials stay in shared memory and the cluster merges them.
template <int WG, bool DEPENDENT, int CLUSTER>
__device__ __forceinline__ void ConsumeAndFinish(const SparseDecodeParams& p, const BlockWork& w,
                                                 uint32_t base, unsigned char* smem,
                                                 const SplitOutputs& so,
                                                 const trace::BlockTraceScope& traced) {
  static_assert(DEPENDENT || CLUSTER == kNoCluster, "clusters are launched as kDependentLaunch is");
  constexpr bool kMerge = CLUSTER == kMergeCluster;
  const int tid = threadIdx.x;
  const int splits = static_cast<int>(gridDim.x);
  // DEPENDENT: a request whose entries fit in split 0 is finished there (the combine kernel skips
  // it, the cluster does not merge); the splits past a request's entries write nothing.
  const bool final_output = splits == 1 || (DEPENDENT && w.active == 1);
  const bool writes = !DEPENDENT || static_cast<int>(blockIdx.x) < w.active;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int head_lo = 16 * ((tid & 127) >> 5) + g;  // this thread's heads: head_lo, head_lo + 8
  // Loaded now, used at the end: the sinks of this thread's heads.
  const float sink_lo = p.sinks[w.head0 + head_lo] * kLog2e;
  const float sink_hi = p.sinks[w.head0 + head_lo + 8] * kLog2e;
  ConsumerState st;
  Consume<WG>(p, w.n_tiles, base, smem, st, traced);
  if (WG == 0 && tid == 0) traced.Mark(kTraceLoopDone);
  // The query area is reused below: with no tile, its copies were never waited for.
  if (w.n_tiles == 0) MbarrierWait(base + kBarrierOffset + kQBarrier * 8, 0);
  float2* const stats = reinterpret_cast<float2*>(smem + kStatsOffset);
  if (writes) {
    // One split: the final output (sink and normalization applied). Several: this split's
    // unnormalized output in bf16, and its maxima and sums in fp32, for the merge. The bf16 rows
    // are staged in the query area (free: both warpgroups are past their last score product).
    ConsumerBarrier();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int head = head_lo + 8 * r;
      float scale = 1.0f;
      if (final_output) {
        const float sink = r == 0 ? sink_lo : sink_hi;
        const float top = fmaxf(st.running_max[r], sink);
        const float weight = MergeWeight(st.running_max[r], top);
        const float denom = st.running_sum[r] * weight + MergeWeight(sink, top);
        scale = denom > 0.0f ? weight / denom : 0.0f;
      } else if (WG == 0 && t == 0) {
        if constexpr (kMerge) {
          stats[head] = make_float2(st.running_max[r], st.running_sum[r]);
        } else {
          const int64_t row = ((w.b * splits + blockIdx.x) * p.heads + w.head0 + head);
          so.part_max[row] = st.running_max[r];
          so.part_sum[row] = st.running_sum[r];
        }
      }
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int unit = (WG * kHalf + 8 * n) / 8;  // 8 bf16 per unit; this thread's 4 bytes at 4t
        *reinterpret_cast<__nv_bfloat162*>(smem + kQOffset + StagedOutputOffset(head, unit) +
                                           4 * t) =
            __floats2bfloat162_rn(st.o[4 * n + 2 * r] * scale, st.o[4 * n + 2 * r + 1] * scale);
      }
    }
    ConsumerBarrier();
    if (!kMerge || final_output) {
      // Whole 16-byte stores, consecutive threads on consecutive bytes.
      __nv_bfloat16* const dst =
          final_output ? so.out + (w.b * p.heads + w.head0) * kDim
                       : so.part_out + ((w.b * splits + blockIdx.x) * p.heads + w.head0) * kDim;
#pragma unroll 4
      for (int i = tid; i < kHeads * kDim / 8; i += kConsumerThreads) {
        const int head = i >> 6;
        const int unit = i & 63;
        reinterpret_cast<uint4*>(dst)[i] =
            *reinterpret_cast<const uint4*>(smem + kQOffset + StagedOutputOffset(head, unit));
      }
    }
  }
  if constexpr (kMerge) {
    // Every block's partials are staged (and every multicast of the queries has landed: each
    // block waited for its own); then each block merges its slice of the heads from all of them,
    // and none leaves while another may still read its shared memory.
    ClusterArrive();
    ClusterWait();
    if (!final_output) {
      MergeInCluster<static_cast<int>(kSparseMaxClusterSplits)>(
          smem + kQOffset, stats, w.active, p.sinks + w.head0,
          so.out + (w.b * p.heads + w.head0) * kDim, tid, kConsumerThreads);
    }
  }
  // Every cluster: no block leaves while a multicast it issued may still be writing another's
  // shared memory, or (kMergeCluster) another may still read its own.
  if constexpr (CLUSTER != kNoCluster) {
    ClusterArrive();
    ClusterWait();
  }
}

// DEPENDENT: SparseDecodeVariant::kDependentLaunch (launched as a programmatic dependent: nothing
// global is touched before griddepcontrol.wait). CLUSTER (DEPENDENT too): kMergeCluster for
// kClusterMerge (clusters of gridDim.x blocks, the splits of one request and head group), or
// kQueryCluster (clusters of consecutive splits of one request). q_map: the queries
// [batch * heads, 512] in 64 x 64 boxes, used only in clusters with p.multicast_queries.
template <bool DEPENDENT, int CLUSTER>
__global__ void __launch_bounds__(kThreads, 1)
    SparseDecodeSplitKernel(SparseDecodeParams p, SplitOutputs so,
                            const __grid_constant__ CUtensorMap q_map) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const trace::BlockTraceScope traced(so.trace);
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const int tid = threadIdx.x;
  const bool multicast = CLUSTER != kNoCluster && p.multicast_queries;
  const uint32_t q_full = base + kBarrierOffset + kQBarrier * 8;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // An arrive and an arrive-on-copies from every producer thread.
      MbarrierInit(base + kBarrierOffset + (kFullBarrier + s) * 8, 2 * 32 * kProducerWarps);
      MbarrierInit(base + kBarrierOffset + (kEmptyBarrier + s) * 8, kConsumerThreads / 32);
    }
    // Multicast: this one arrival and the 64 KB the cluster's copies deliver; else an
    // arrive-on-copies from every producer thread.
    MbarrierInit(q_full, multicast ? 1 : 32 * kProducerWarps);
    if (multicast) {
      MbarrierArriveExpectTx(q_full, kQBytes);
      FenceBarrierInit();  // before any block of the cluster may copy into this one
    }
  }
  __syncthreads();
  // CLUSTER: the cluster's blocks have all started and initialized their barriers (waited for
  // below, after the dependency) before any multicast or shared-memory access between them.
  if constexpr (CLUSTER != kNoCluster) ClusterArrive();
  if constexpr (DEPENDENT) {
    // The kernel before this one on the stream has finished and its writes are visible; the one
    // after may begin its launch (it waits the same way for this one).
    GridDependencyWait();
    GridDependencyTrigger();
  }
  if (DEPENDENT && tid == 0) traced.MarkDependency();
  if constexpr (CLUSTER != kNoCluster) ClusterWait();

  const int64_t b = blockIdx.y;
  if (tid >= kConsumerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    // The request's lengths and window page are requested first (ahead of the 64 KB of query
    // copies in the memory pipeline: the first tile's lookups wait on them), then the queries,
    // then the lookups' prefetch.
    const int window_len = p.window_len[b];
    const int n_compressed = p.n_compressed[b];
    const int window_page = p.window_size > 0 ? p.window_page[b] : 0;
    if (!multicast) {
      IssueQueries(p, base);
    } else if (tid == kConsumerThreads) {
      IssueQueriesMulticast(p, &q_map, base);
    }
    if (DEPENDENT && p.prefetch_lookups) PrefetchLookups(p);
    const BlockWork w = GetBlockWork(p, window_len, n_compressed);
    Produce(p, w, n_compressed, window_page, base, smem + kValidOffset);
    // A block with nothing to attend keeps its threads until the query copies have landed.
    if (w.n_tiles == 0) MbarrierWait(q_full, 0);
    // The consumers' cluster barriers (ConsumeAndFinish): every thread takes part.
    if constexpr (CLUSTER == kMergeCluster) {
      ClusterArrive();
      ClusterWait();
    }
    if constexpr (CLUSTER != kNoCluster) {
      ClusterArrive();
      ClusterWait();
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    const BlockWork w = GetBlockWork(p, p.window_len[b], p.n_compressed[b]);
    if (tid < 128) {
      ConsumeAndFinish<0, DEPENDENT, CLUSTER>(p, w, base, smem, so, traced);
    } else {
      ConsumeAndFinish<1, DEPENDENT, CLUSTER>(p, w, base, smem, so, traced);
    }
  }
}

constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

size_t PartialRows(const SparseDecodeParams& p) {
  return static_cast<size_t>(p.batch) * static_cast<size_t>(SparseDecodeSplits(p)) *
         static_cast<size_t>(p.heads);
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent of the
// kernel before it on `stream` when `dependent`.
template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, bool dependent,
                   cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = dependent ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// The split kernels' shared-memory size, set for all four on a device at the first call of any
// variant there (so a later first use of another variant or cluster shape, maybe inside graph
// capture, sets none).
cudaError_t SplitKernelAttributes() {
  for (const auto kernel :
       {SparseDecodeSplitKernel<false, kNoCluster>, SparseDecodeSplitKernel<true, kNoCluster>,
        SparseDecodeSplitKernel<true, kQueryCluster>,
        SparseDecodeSplitKernel<true, kMergeCluster>}) {
    const cudaError_t set =
        SetMaxDynamicSharedMemory(reinterpret_cast<const void*>(kernel), kSmemBytes);
    if (set != cudaSuccess) return set;
  }
  return cudaSuccess;
}

// The queries [batch * heads, 512] bf16 as a 2-D tensor in boxes of 64 dims x 64 heads with the
// 128-byte swizzle (one region of the query area, see IssueQueriesMulticast). False when the
// driver has no encoder, q is not 16-byte aligned or the rows do not fit an int32 coordinate.
bool EncodeQueryMap(CUtensorMap* map, const SparseDecodeParams& p) {
  const auto encode = TensorMapEncodeFunction();
  const int64_t rows = p.batch * p.heads;
  if (encode == nullptr || reinterpret_cast<uintptr_t>(p.q) % 16 != 0 || rows > INT32_MAX) {
    return false;
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kDim), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kDim * sizeof(__nv_bfloat16))};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(kHeads)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(p.q), dims,
                strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The split kernel in clusters of `cluster` consecutive splits (CLUSTER: kQueryCluster or
// kMergeCluster), the queries multicast when p.multicast_queries and they can be mapped.
template <int CLUSTER>
cudaError_t LaunchClusters(const SparseDecodeParams& p, const SplitOutputs& so, int64_t cluster,
                           cudaStream_t stream) {
  const cudaError_t attribute_status = SplitKernelAttributes();
  if (attribute_status != cudaSuccess) return attribute_status;
  SparseDecodeParams lp = p;
  CUtensorMap q_map{};
  lp.multicast_queries = p.multicast_queries && EncodeQueryMap(&q_map, p);
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(SparseDecodeSplits(p)),
                        static_cast<unsigned>(p.batch), static_cast<unsigned>(p.heads / kHeads));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(kSmemBytes);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = p.programmatic_launch ? 2 : 1;
  return cudaLaunchKernelEx(&config, SparseDecodeSplitKernel<true, CLUSTER>, lp, so, q_map);
}

// The split kernel, then (several splits) the combine kernel; DEPENDENT: kDependentLaunch.
template <bool DEPENDENT>
cudaError_t LaunchVariant(const SparseDecodeParams& p, const SplitOutputs& so,
                          cudaStream_t stream) {
  const cudaError_t attribute_status = SplitKernelAttributes();
  if (attribute_status != cudaSuccess) return attribute_status;
  const bool dependent = DEPENDENT && p.programmatic_launch;
  const int64_t splits = SparseDecodeSplits(p);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(p.heads / kHeads));
  cudaError_t status = cudaSuccess;
  if (DEPENDENT && p.query_cluster > 1 && splits % p.query_cluster == 0 && p.multicast_queries) {
    status = LaunchClusters<kQueryCluster>(p, so, p.query_cluster, stream);
  } else {
    status = Launch(SparseDecodeSplitKernel<DEPENDENT, kNoCluster>, grid, dim3(kThreads),
                    kSmemBytes, dependent, stream, p, so, CUtensorMap{});
  }
  if (status != cudaSuccess || splits == 1) return status;
  const auto* part_out = static_cast<const __nv_bfloat16*>(so.part_out);
  const auto* part_max = static_cast<const float*>(so.part_max);
  const auto* part_sum = static_cast<const float*>(so.part_sum);
  if constexpr (DEPENDENT) {
    const dim3 merge_grid(static_cast<unsigned>(p.batch),
                          static_cast<unsigned>(p.heads / sparse_decode::kMergeHeadsPerBlock));
    return Launch(SparseDecodeMergeKernel, merge_grid, dim3(sparse_decode::kMergeThreads), 0,
                  dependent, stream, p, static_cast<int>(splits), part_out, part_max, part_sum,
                  so.out);
  } else {
    const dim3 combine_grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.heads));
    return Launch(SparseDecodeCombineKernel, combine_grid, dim3(kDim / 4), 0, false, stream, p,
                  static_cast<int>(splits), part_out, part_max, part_sum, so.out);
  }
}

// kClusterMerge: the split kernel alone, in clusters of all the splits of a (request, head
// group); as kDependentLaunch with one split or more than kSparseMaxClusterSplits.
cudaError_t LaunchMergeClusters(const SparseDecodeParams& p, const SplitOutputs& so,
                                cudaStream_t stream) {
  const int64_t splits = SparseDecodeSplits(p);
  if (splits == 1 || splits > kSparseMaxClusterSplits) return LaunchVariant<true>(p, so, stream);
  return LaunchClusters<kMergeCluster>(p, so, splits, stream);
}

}  // namespace

int SparseDecodeMaxActiveClusters(int64_t splits) {
  if (splits < 2 || splits > kSparseMaxClusterSplits) return 0;
  if (SplitKernelAttributes() != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(splits), 64);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(kSmemBytes);
  config.attrs = attr;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, SparseDecodeSplitKernel<true, kMergeCluster>,
                                     &config) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return clusters;
}

size_t SparseDecodeWorkspaceBytes(const SparseDecodeParams& p) {
  // The layout the launch below carves (sparse_decode_workspace.h).
  return sparse_decode_workspace::Bytes(p.batch, p.heads, SparseDecodeSplits(p));
}

cudaError_t sparse_decode_attention(const SparseDecodeParams& p, void* workspace,
                                    size_t workspace_bytes, __nv_bfloat16* out,
                                    cudaStream_t stream) {
  constexpr const char* kLauncher = "sparse_decode_attention";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.variant == SparseDecodeVariant::kSplitCombine ||
                                        p.variant == SparseDecodeVariant::kDependentLaunch ||
                                        p.variant == SparseDecodeVariant::kClusterMerge);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.batch >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.batch <= 65535);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.heads > 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.heads % kHeads == 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.softmax_scale > 0.0f);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.heads / kHeads <= 65535);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.window_size >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.compressed_slots >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.page_size >= 1);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.entries_per_split > 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher,
                         p.query_cluster >= 1 && p.query_cluster <= kSparseMaxClusterSplits);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.entries_per_split % kSparseTile == 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.window_size + p.compressed_slots <= INT32_MAX / 2);
  if (p.batch == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.q != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.window_len != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.n_compressed != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, p.sinks != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, out != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, workspace != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, workspace_bytes >= SparseDecodeWorkspaceBytes(p));
  PDSERVE_LAUNCH_REQUIRE(
      kLauncher, p.window_size == 0 || (p.window_pool != nullptr && p.window_page != nullptr));
  PDSERVE_LAUNCH_REQUIRE(
      kLauncher, p.compressed_slots == 0 || (p.kv_pool != nullptr && p.page_table != nullptr));
  const size_t rows = PartialRows(p);
  auto* base = static_cast<unsigned char*>(workspace);
  SplitOutputs so;
  so.out = out;
  so.part_out = reinterpret_cast<__nv_bfloat16*>(base);
  so.part_max = reinterpret_cast<float*>(base + AlignUp(rows * kDim * sizeof(__nv_bfloat16)));
  so.part_sum = so.part_max + AlignUp(rows * sizeof(float)) / sizeof(float);
  so.trace = block_trace();
  switch (p.variant) {
    case SparseDecodeVariant::kSplitCombine:
      return LaunchVariant<false>(p, so, stream);
    case SparseDecodeVariant::kDependentLaunch:
      return LaunchVariant<true>(p, so, stream);
    case SparseDecodeVariant::kClusterMerge:
      break;
  }
  return LaunchMergeClusters(p, so, stream);
}

}  // namespace pdserve::kernels::cuda
