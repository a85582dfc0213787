// fp8_gemm_wgmma.cu's device pieces: the kernel arguments, the tile constants, and the consumer's
// helpers (W8A16 weight conversion, register A fragments, scale loads, the in-kernel split-k
// reduction, the alternate warpgroups' combine). Included by fp8_gemm_wgmma.cu (the design is
// described there) and moe_gemm_wgmma.cu.
#pragma once

#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/block_trace.h"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/wgmma_e4m3.cuh"

namespace pdserve::kernels::cuda::fp8_wgmma {

namespace bs = block_scaled;
using hopper::ClusterArrive;
using hopper::ClusterWait;
using hopper::FenceBarrierInit;
using hopper::FenceProxyAsync;
using hopper::FenceRegisters;
using hopper::MbarrierArrive;
using hopper::MbarrierArriveExpectTx;
using hopper::MbarrierInit;
using hopper::MbarrierWait;
using hopper::PrefetchTensorMap;
using hopper::SharedAddress;
using hopper::SmemDescriptor;
using hopper::TmaLoad2d;
using hopper::TmaLoad2dMulticast;
using hopper::WgmmaBf16;
using hopper::WgmmaBf16RegA;
using hopper::WgmmaCommit;
using hopper::WgmmaE4m3;
using hopper::WgmmaFence;
using hopper::WgmmaWait;

constexpr int kBlockK = bs::kBlockK;
constexpr int kMaxWarpgroups = 2;
constexpr int kMaxThreads = 128 * kMaxWarpgroups + 32;
constexpr int kMaxTokenTile = 128;
constexpr int kMaxStages = 8;
constexpr int kMaxSplits = 32;
constexpr int kSmemLimit = 227 * 1024;
constexpr int kSmemSlack = 1024;  // aligning the ring to 1024 bytes (the 128-byte swizzle atom)

struct WgmmaArgs {
  const float* w_scale;  // [ceil(n / 128), k / 128]
  const float* xs;       // [k / 128, m]
  int64_t m;
  int64_t n;
  int64_t k;
  int32_t k_splits;
  int32_t stages;
  int32_t cluster_reduce;  // launched as clusters of 1 x 1 x k_splits: the reduction in-kernel
  int32_t smem_scales;     // N <= kEarlyScaleTokens: this split's scales in shared memory first
  int32_t reg_weights;     // A16, N <= kRegWeightTokens: ProductsRegisterWeights (no conv buffers)
  int32_t kb_span;         // ceil(k / 128 / k_splits): the scale region's k blocks
  int32_t turns;           // 1, or 2: two consumer warpgroups per row group, alternate k blocks
  int32_t tgroups;         // 1, or 2: split_tokens, two consumer warpgroups per row group, each
                           // N of the block's 2N tokens (the same weight box, its own half of
                           // the activation box)
  int32_t stagger;    // stagger_k: the split's k blocks from blockIdx.y % n_kb on, wrapping around
  int32_t multicast;  // multicast_activations: clusters of two row tiles (grid y) share the
                      // activation boxes, each block loading half of the rows into both
  float* partial;     // k_splits > 1 and !cluster_reduce: [k_splits, m, n]
  __nv_bfloat16* out;
  float* out_f32;  // set: fp32 output there instead of out
  int64_t out_stride;
  BlockTrace trace;  // block_trace.h: set by a benchmark, else empty
};

// Bytes of one ring stage: the weight box, then the activation box (A16: two, k 0..63 and
// 64..127 of the block in bf16); each a multiple of 1024.
__host__ __device__ constexpr uint32_t StageBytes(int wgs, int n_tile, bool a16) {
  return static_cast<uint32_t>((64 * wgs + (a16 ? 2 : 1) * n_tile) * kBlockK);
}

// W8A16: each consumer warpgroup's bf16 copy of its 64 weight rows of one 128-k block, two
// 128-byte-swizzled regions of 64 rows x 64 k (the wgmma A operand).
constexpr uint32_t kConvBytes = 2 * 64 * 128;

// W8A16: converts this warpgroup's 64 e4m3 weight rows of the stage at `w_stage` (TMA's 128-byte
// swizzle: 16-byte chunk c of row r at r * 128 + (c ^ r % 8) * 16) to bf16 at `conv` (region h
// = k 64h .. 64h + 63, chunk c' of row r at h * 8192 + r * 128 + (c' ^ r % 8) * 16). Thread `tid`
// of the warpgroup converts row tid / 2, half tid % 2. Exact (bs::E4m3x2ToBf16x2).
__device__ __forceinline__ void ConvertWeights(const uint8_t* w_stage, uint8_t* conv, int tid) {
  const int r = tid / 2;
  const int h = tid % 2;
#pragma unroll
  for (int c2 = 0; c2 < 4; ++c2) {
    const int c = 4 * h + c2;
    const uint4 v = *reinterpret_cast<const uint4*>(w_stage + r * 128 + ((c ^ (r & 7)) << 4));
    uint4 lo;
    uint4 hi;
    lo.x = bs::E4m3x2ToBf16x2(v.x);
    lo.y = bs::E4m3x2ToBf16x2(v.x >> 16);
    lo.z = bs::E4m3x2ToBf16x2(v.y);
    lo.w = bs::E4m3x2ToBf16x2(v.y >> 16);
    hi.x = bs::E4m3x2ToBf16x2(v.z);
    hi.y = bs::E4m3x2ToBf16x2(v.z >> 16);
    hi.z = bs::E4m3x2ToBf16x2(v.w);
    hi.w = bs::E4m3x2ToBf16x2(v.w >> 16);
    uint8_t* row = conv + h * (64 * 128) + r * 128;
    *reinterpret_cast<uint4*>(row + (((2 * c2) ^ (r & 7)) << 4)) = lo;
    *reinterpret_cast<uint4*>(row + (((2 * c2 + 1) ^ (r & 7)) << 4)) = hi;
  }
}

// W8A16 with register weights (token tiles up to kRegWeightTokens): the 8 bf16 wgmma m64nNk16
// of one 128-k block with A from registers, each thread converting its own A fragment straight
// from the e4m3 stage (`w_rows`: this warpgroup's 64 rows, TMA's 128-byte swizzle) instead of the
// warpgroup converting the block into shared memory first (no barriers, no proxy fence, no
// conversion buffer). `b_stage`: the stage's activation boxes; warp: the warp in the warpgroup.
// `a` receives the A fragments; they must stay unchanged until the products are waited for
// (with two blocks in flight the caller keeps one array per block, so that ptxas need not
// serialize the wgmma to reuse their registers). box_bytes: the bytes of one activation box (its
// rows x 128: the k 64..127 box follows the k 0..63 one).
constexpr int kRegWeightTokens = 64;
constexpr int kClusterReduceTokens = 64;
using RegisterA = uint32_t[kBlockK / 16][4];
template <int N>
__device__ __forceinline__ void ProductsRegisterWeights(float (&p)[N / 2], RegisterA& a,
                                                        const uint8_t* w_rows, uint32_t b_stage,
                                                        uint32_t box_bytes, int warp, int lane) {
  const int t = lane % 4;
  const int lo = 16 * warp + lane / 4;  // rows lo and lo + 8: the same swizzle (lo % 8)
  const uint8_t* row_lo = w_rows + lo * 128 + 2 * t;
  const uint8_t* row_hi = row_lo + 8 * 128;
#pragma unroll
  for (int ks = 0; ks < kBlockK / 16; ++ks) {
    const int chunk = (ks ^ (lo & 7)) << 4;  // k 16 ks .. 16 ks + 15 of the row
    a[ks][0] = bs::E4m3x2ToBf16x2(*reinterpret_cast<const uint16_t*>(row_lo + chunk));
    a[ks][1] = bs::E4m3x2ToBf16x2(*reinterpret_cast<const uint16_t*>(row_hi + chunk));
    a[ks][2] = bs::E4m3x2ToBf16x2(*reinterpret_cast<const uint16_t*>(row_lo + chunk + 8));
    a[ks][3] = bs::E4m3x2ToBf16x2(*reinterpret_cast<const uint16_t*>(row_hi + chunk + 8));
  }
  WgmmaFence();  // the A registers are written before the wgmma read them
#pragma unroll
  for (int ks = 0; ks < kBlockK / 16; ++ks) {
    WgmmaBf16RegA<N>(p, a[ks],
                     SmemDescriptor(b_stage + (ks / 4) * box_bytes + (ks % 4) * 32, 16, 1024), ks);
  }
}

// Keeps A fragments alive (and unmoved) up to this point: after the wait for their products.
__device__ __forceinline__ void FenceRegisterA(RegisterA& a) {
#pragma unroll
  for (int i = 0; i < kBlockK / 16; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

__device__ __forceinline__ float LoadSharedF32(uint32_t address) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(address) : "memory");
  return v;
}

// Copies 4 bytes global -> shared asynchronously (cp.async.ca; waited for by cp.async.wait_all).
__device__ __forceinline__ void CopyAsync4(uint32_t dst, const float* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// Named barrier of consumer warpgroup wg's 128 threads (0 is __syncthreads).
__device__ __forceinline__ void WarpgroupBarrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
}

// W8A16 through shared memory (token tiles past kRegWeightTokens): consumer warpgroup wg
// converts its 64 e4m3 weight rows of the stage (`w_rows`) to bf16 in its buffer (`conv`, shared
// address conv_address; ConvertWeights) and issues the block's 8 bf16 wgmma m64nNk16 on them and
// the stage's activation boxes (`b_stage`, box_bytes each), not committed.
template <int N>
__device__ __forceinline__ void ProductsConvertedWeights(float (&p)[N / 2], const uint8_t* w_rows,
                                                         uint8_t* conv, uint32_t conv_address,
                                                         uint32_t b_stage, uint32_t box_bytes,
                                                         int wg) {
  WarpgroupBarrier(wg);  // the last block's products finished reading conv
  ConvertWeights(w_rows, conv, static_cast<int>(threadIdx.x) % 128);
  FenceProxyAsync();     // generic writes before the wgmma (async proxy) reads
  WarpgroupBarrier(wg);  // every row converted
  WgmmaFence();
#pragma unroll
  for (int ks = 0; ks < kBlockK / 16; ++ks) {
    const uint32_t col = (ks % 4) * 32;
    WgmmaBf16<N>(p, SmemDescriptor(conv_address + (ks / 4) * (64 * 128) + col, 16, 1024),
                 SmemDescriptor(b_stage + (ks / 4) * box_bytes + col, 16, 1024), ks);
  }
}

// Token tiles up to this size load a block's activation scales before waiting for its stage (at
// 128 the extra registers would spill).
constexpr int kEarlyScaleTokens = 64;

// xs[2j], xs[2j + 1] = the activation scales of 128-k block kb for tokens token0 + 8j + 2t (+ 1)
// (the accumulator columns of this thread), clamped to the last token.
template <int N>
__device__ __forceinline__ void LoadTokenScales(const WgmmaArgs& a, int64_t kb, int64_t token0,
                                                int t, float (&xs)[N / 4]) {
  const float* row = a.xs + kb * a.m;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    xs[2 * j] = __ldg(row + min(token0 + 8 * j + 2 * t, a.m - 1));
    xs[2 * j + 1] = __ldg(row + min(token0 + 8 * j + 2 * t + 1, a.m - 1));
  }
}

// Arrive on the barrier at shared address `bar` of block `cta` of the cluster (the same offset
// as in this block; PTX ISA "mapa", "mbarrier.arrive" on .shared::cluster).
__device__ __forceinline__ void MbarrierArriveInCluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}

// This block's rank in its cluster.
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// The activation box(es) of one stage: e4m3 [rows x 128 k], or (A16) bf16 [rows x 64 k] twice
// (rows: the block's tokens, box_bytes = rows * 128). cta_mask != 0 (multicast_activations): the
// map's boxes are half as many rows, `dst` and `token0` are this block's half of them, and each
// lands in every block of the mask (the same offsets there).
template <bool A16>
__device__ __forceinline__ void LoadActivations(const void* x_map, uint32_t dst, int32_t k0,
                                                int32_t token0, uint32_t bar, uint32_t box_bytes,
                                                uint16_t cta_mask) {
  if (cta_mask != 0) {
    TmaLoad2dMulticast(dst, x_map, k0, token0, bar, cta_mask);
    if constexpr (A16) TmaLoad2dMulticast(dst + box_bytes, x_map, k0 + 64, token0, bar, cta_mask);
    return;
  }
  TmaLoad2d(dst, x_map, k0, token0, bar);
  if constexpr (A16) TmaLoad2d(dst + box_bytes, x_map, k0 + 64, token0, bar);
}

// cluster_reduce's most splits (fp8_gemm_workspace.h's kFp8WgmmaClusterSplits).
constexpr int kMaxClusterReduceSplits = 8;
// ClusterReduce adds float4s from this token tile on (below: one element at a time).
constexpr int kClusterReduceVectorTokens = 32;

// cluster_reduce's epilogue, run by every thread of the block (acc: nullptr for the producer
// warp). The block's sums [N tokens x 64 * wgs rows] go to its shared memory at `smem` (over
// the ring: every stage has landed and been consumed once the consumers leave their loop, so
// nothing writes it any more), then block r of the cluster adds elements [r E / S, (r + 1) E / S)
// of the tile over the S blocks in ascending rank (= split) order and writes them as bf16. The
// second cluster barrier keeps each block's shared memory alive until every peer has read it.
template <int N>
__device__ __forceinline__ void ClusterReduce(const WgmmaArgs& a, uint8_t* smem, const float* acc,
                                              int wgs, int64_t token0, int64_t row0) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int rows = 64 * wgs;
  float* sums = reinterpret_cast<float*>(smem);
  __syncthreads();  // every warpgroup's products have finished reading the ring
  if (acc != nullptr) {
    FenceProxyAsync();  // the ring was last written by TMA and read by wgmma (async proxy)
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int lane = static_cast<int>(threadIdx.x) % 32;
    const int row_base = 64 * (warp / 4) + 16 * (warp % 4) + lane / 4;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const int row = row_base + ((i & 2) != 0 ? 8 : 0);
      const int token = 8 * (i / 4) + 2 * (lane % 4) + (i & 1);
      sums[token * rows + row] = acc[i];
    }
  }
  cluster.sync();
  const int splits = a.k_splits;
  const int rank = static_cast<int>(cluster.block_rank());
  // Token tiles from kClusterReduceVectorTokens on: four consecutive rows of one token per thread
  // and step (elements = rows x N, N a multiple of 8, splits a power of two <=
  // kMaxClusterReduceSplits: every slice begins on a float4), all splits' float4 loads issued
  // before the sums, which add them in ascending split order from 0.0f as the two-pass reduce
  // does (the same bits). At 64 tokens the epilogue took 3.2-3.3 us against 4.5-4.8 us one
  // element at a time (tools/gpu/run_trace64.sh, H100, 2026-12-06); at 16 tokens about the same
  // (2.2-2.5 us: there it waits for the cluster's slowest split).
  const int elements = rows * N;
  if constexpr (N < kClusterReduceVectorTokens) {
    // One element per thread and step, a serial load per split (few registers: the float4 loop
    // took the W8A16 16-token kernel to 133 registers a thread, past the 128 that three
    // 160-thread blocks per multiprocessor allow, and made it 1-2 us slower; H100, 2026-12-06).
    const int begin = elements * rank / splits;
    const int end = elements * (rank + 1) / splits;
    for (int e = begin + static_cast<int>(threadIdx.x); e < end;
         e += static_cast<int>(blockDim.x)) {
      const int64_t token = token0 + e / rows;
      const int64_t row = row0 + e % rows;
      if (token >= a.m || row >= a.n) continue;
      float sum = 0.0f;
      for (int s = 0; s < splits; ++s) sum += cluster.map_shared_rank(sums, s)[e];
      bs::StoreOut(a.out, a.out_f32, token * a.out_stride + row, sum);
    }
    cluster.sync();
    return;
  }
  const int begin = elements * rank / splits / 4;
  const int end = elements * (rank + 1) / splits / 4;
  for (int v = begin + static_cast<int>(threadIdx.x); v < end; v += static_cast<int>(blockDim.x)) {
    float4 part[kMaxClusterReduceSplits];
#pragma unroll
    for (int s = 0; s < kMaxClusterReduceSplits; ++s) {
      if (s < splits)
        part[s] = reinterpret_cast<const float4*>(cluster.map_shared_rank(sums, s))[v];
    }
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int s = 0; s < kMaxClusterReduceSplits; ++s) {
      if (s < splits) {
        sum.x += part[s].x;
        sum.y += part[s].y;
        sum.z += part[s].z;
        sum.w += part[s].w;
      }
    }
    const int e = 4 * v;
    const int64_t token = token0 + e / rows;
    const int64_t row = row0 + e % rows;
    if (token >= a.m) continue;
    const float values[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (row + j < a.n) bs::StoreOut(a.out, a.out_f32, token * a.out_stride + row + j, values[j]);
    }
  }
  cluster.sync();
}

// turns == 2: the two consumer warpgroups of one row group took turns on the ring; warpgroup 1
// hands its sums to warpgroup 0 through shared memory (over the drained ring, as ClusterReduce
// does), which adds them to its own: acc = (even blocks' sum) + (odd blocks' sum), fixed order.
// Every consumer thread calls it; returns false for the threads whose sums are handed over.
template <int N>
__device__ __forceinline__ bool CombineTurns(uint8_t* smem, float (&acc)[N / 2], int consumers,
                                             int rg, int turn) {
  float* const sums = reinterpret_cast<float*>(smem) + rg * (N / 2) * 128;
  const int tid = static_cast<int>(threadIdx.x) % 128;
  asm volatile("bar.sync 4, %0;\n" ::"r"(128 * consumers) : "memory");  // the ring is drained
  if (turn == 1) {
    FenceProxyAsync();  // the ring was last written by TMA and read by wgmma (async proxy)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) sums[i * 128 + tid] = acc[i];
  }
  asm volatile("bar.sync 4, %0;\n" ::"r"(128 * consumers) : "memory");
  if (turn == 1) return false;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] += sums[i * 128 + tid];
  return true;
}

// W8A8 token tiles up to this size may alternate warpgroups (WgmmaArgs::turns; past it, the
// code for it made the one-warpgroup kernel spill at 128 tokens, where cuBLASLt runs anyway).
constexpr int kAlternateA8Tokens = 64;

// split_tokens applies from this many tokens on (below, one token group of 8 already holds them).
constexpr int kSplitTokensMin = 8;

// Token tiles up to this size may keep two 128-k blocks' products in flight per warpgroup
// (Fp8WgmmaConfig::two_in_flight; a second partial accumulator: at 128 tokens it would spill).
constexpr int kInFlightTokens = 64;
// Fp8WgmmaConfig::max_registers: the token tiles Fp8WgmmaCappedKernel is built for.
constexpr int kCappedMaxTokens = 64;

}  // namespace pdserve::kernels::cuda::fp8_wgmma
