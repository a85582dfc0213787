// fp8_gemm_wgmma and fp8_gemm_w8a16_wgmma (fp8_gemm.cuh): the block-scaled FP8 GEMM on Hopper's
// warpgroup MMA.
//
// Design (sm_90a). Computed transposed, out^T[n, token] = W[n, :] . xq[token, :]: the weight rows
// fill wgmma's M = 64 per consumer warpgroup and the tokens are N (a multiple of 8, 8..128, the
// instantiation picked by the token count), so a decode batch of 1..128 tokens costs one wgmma
// column tile and each weight byte is read once. One block per (token tile, 64 * wgs weight rows,
// k split); wgs (1 or 2) consumer warpgroups plus one producer warp:
// - Producer (one thread): per 128-k block, one TMA box of the weights [64 * wgs rows x 128 k] and
//   one of the quantized activations [N tokens x 128 k] (both e4m3, 128-byte swizzle, rows past
//   the tensor zero-filled) into a ring of `stages` shared-memory stages; full[s] completes when
//   both boxes landed (transaction bytes), empty[s] when every consumer warp is done with it. The
//   first `stages` weight boxes are issued before griddepcontrol.wait (they do not depend on the
//   act-quant kernel before), the activation boxes after it.
// - Consumers: per 128-k block, 4 wgmma m64nNk32 (e4m3 x e4m3 -> fp32, scale-d off for the first)
//   into a block partial p, wait, release the stage, then fold acc += p * (w_scale[row block, kb]
//   * xs[kb, token]) in fp32: the same per-block scaling as the CPU reference. With smem_scales
//   (token tiles <= 64) the split's w_scale / xs are copied to shared memory once before the loop
//   instead of being loaded from global memory per 128-k block.
// W8A16 (A16): the activations stay bf16 and stream by TMA as two [N x 64 k] boxes per block; after
// a stage lands, each consumer warpgroup converts its 64 e4m3 weight rows exactly to bf16 in its
// own shared-memory buffer (the same 128-byte swizzle), then runs 8 bf16 wgmma m64nNk16 from
// shared memory; the fold multiplies by the weight block scale only. With a16_register_weights
// (token tiles <= 64) there is no such buffer: each thread loads its own wgmma A fragment (2
// bytes x 4 per 16-k slice) from the e4m3 stage, converts it in registers and the bf16 wgmma
// takes A from registers (no warpgroup barriers or proxy fence per block).
// Split-K (k_splits > 1): each split writes its fp32 sums to partial[split, token, n], and
// block_scaled's SplitKReduceKernel adds the splits in ascending order (deterministic: equal
// inputs give equal bits; no atomics). With cluster_reduce the splits of one tile are one thread
// block cluster (1 x 1 x splits): after the main loop every block stores its sums in its own
// shared memory (over the drained ring), the cluster synchronizes, and block r adds slice r of
// the tile over the splits in ascending order from the blocks' shared memory (distributed
// shared memory), exactly as SplitKReduceKernel would (0.0f + split 0 + split 1 ...): the same
// bits, one kernel fewer and no partial sums in HBM.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>

#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/tensor_map.cuh"
#include "kernels/cuda/wgmma_e4m3.cuh"

namespace pdserve::kernels::cuda {
namespace {

namespace bs = block_scaled;
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
  float* partial;          // k_splits > 1 and !cluster_reduce: [k_splits, m, n]
  __nv_bfloat16* out;
  float* out_f32;  // set: fp32 output there instead of out
  int64_t out_stride;
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
constexpr int kRegWeightTokens = 64;
constexpr int kClusterReduceTokens = 64;
template <int N>
__device__ __forceinline__ void ProductsRegisterWeights(float (&p)[N / 2], const uint8_t* w_rows,
                                                        uint32_t b_stage, int warp, int lane) {
  const int t = lane % 4;
  const int lo = 16 * warp + lane / 4;  // rows lo and lo + 8: the same swizzle (lo % 8)
  const uint8_t* row_lo = w_rows + lo * 128 + 2 * t;
  const uint8_t* row_hi = row_lo + 8 * 128;
  uint32_t a[kBlockK / 16][4];
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
                     SmemDescriptor(b_stage + (ks / 4) * (N * 128) + (ks % 4) * 32, 16, 1024), ks);
  }
}

__device__ __forceinline__ float LoadSharedF32(uint32_t address) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(address) : "memory");
  return v;
}

// Named barrier of consumer warpgroup wg's 128 threads (0 is __syncthreads).
__device__ __forceinline__ void WarpgroupBarrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
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

// The activation box(es) of one stage: e4m3 [N x 128 k], or (A16) bf16 [N x 64 k] twice.
template <int N, bool A16>
__device__ __forceinline__ void LoadActivations(const void* x_map, uint32_t dst, int32_t k0,
                                                int32_t token0, uint32_t bar) {
  TmaLoad2d(dst, x_map, k0, token0, bar);
  if constexpr (A16) TmaLoad2d(dst + N * 128, x_map, k0 + 64, token0, bar);
}

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
  const int elements = rows * N;
  const int begin = elements * rank / splits;
  const int end = elements * (rank + 1) / splits;
  for (int e = begin + static_cast<int>(threadIdx.x); e < end; e += static_cast<int>(blockDim.x)) {
    const int64_t token = token0 + e / rows;
    const int64_t row = row0 + e % rows;
    if (token >= a.m || row >= a.n) continue;
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += cluster.map_shared_rank(sums, s)[e];
    bs::StoreOut(a.out, a.out_f32, token * a.out_stride + row, sum);
  }
  cluster.sync();
}

// A16: W8A16 (x_map over bf16 x, no activation scales; weights converted to bf16 in shared
// memory, products on bf16 wgmma m64nNk16).
template <int N, bool A16>
__global__ void __launch_bounds__(kMaxThreads, 1)
    Fp8WgmmaKernel(const __grid_constant__ CUtensorMap w_map,
                   const __grid_constant__ CUtensorMap x_map, const WgmmaArgs a) {
  extern __shared__ uint8_t smem_raw[];
  const int wgs = static_cast<int>(blockDim.x) / 128;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const uint32_t base = (SharedAddress(smem_raw) + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - SharedAddress(smem_raw));  // generic, 1024-aligned
  const uint32_t w_bytes = static_cast<uint32_t>(64 * wgs * kBlockK);
  const uint32_t stage_bytes = StageBytes(wgs, N, A16);
  const int stages = a.stages;
  const uint32_t conv_offset = stages * stage_bytes;  // A16's per-warpgroup bf16 weights
  const uint32_t full_bar =
      base + conv_offset + (A16 && a.reg_weights == 0 ? wgs * kConvBytes : 0u);
  const uint32_t empty_bar = full_bar + 8u * stages;
  const int64_t kblocks = a.k / kBlockK;
  const int kb_begin = static_cast<int>(kblocks * blockIdx.z / a.k_splits);
  const int kb_end = static_cast<int>(kblocks * (blockIdx.z + 1) / a.k_splits);
  const int n_kb = kb_end - kb_begin;
  const int64_t token0 = int64_t{blockIdx.x} * N;
  const int64_t row0 = int64_t{blockIdx.y} * 64 * wgs;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      MbarrierInit(full_bar + 8u * s, 1);
      MbarrierInit(empty_bar + 8u * s, 4 * wgs);
    }
    FenceBarrierInit();  // the initialized barriers are visible to the TMA unit
    FenceProxyAsync();
  }
  __syncthreads();

  if (warp == 4 * wgs) {  // producer
    if (lane == 0) {
      PrefetchTensorMap(&w_map);
      PrefetchTensorMap(&x_map);
      const int ahead = min(stages, n_kb);
      for (int it = 0; it < ahead; ++it) {
        const uint32_t stage = base + it * stage_bytes;
        MbarrierArriveExpectTx(full_bar + 8u * it, stage_bytes);
        TmaLoad2d(stage, &w_map, (kb_begin + it) * kBlockK, static_cast<int32_t>(row0),
                  full_bar + 8u * it);
      }
      bs::GridDependencyWait();  // xq / xs come from the act-quant kernel
      bs::GridDependencyTrigger();
      for (int it = 0; it < ahead; ++it) {
        LoadActivations<N, A16>(&x_map, base + it * stage_bytes + w_bytes,
                                (kb_begin + it) * kBlockK, static_cast<int32_t>(token0),
                                full_bar + 8u * it);
      }
      for (int it = ahead; it < n_kb; ++it) {
        const int s = it % stages;
        const uint32_t stage = base + s * stage_bytes;
        MbarrierWait(empty_bar + 8u * s, static_cast<uint32_t>((it / stages - 1) & 1));
        MbarrierArriveExpectTx(full_bar + 8u * s, stage_bytes);
        const int32_t kc = (kb_begin + it) * kBlockK;
        TmaLoad2d(stage, &w_map, kc, static_cast<int32_t>(row0), full_bar + 8u * s);
        LoadActivations<N, A16>(&x_map, stage + w_bytes, kc, static_cast<int32_t>(token0),
                                full_bar + 8u * s);
      }
    }
    if (a.cluster_reduce != 0) ClusterReduce<N>(a, smem, nullptr, wgs, token0, row0);
    return;
  }

  // Consumer warpgroup wg: weight rows row0 + 64 wg .. + 63 (one 128-row scale block).
  bs::GridDependencyWait();  // xs
  bs::GridDependencyTrigger();
  const int wg = warp / 4;
  const int g = lane / 4;
  const int t = lane % 4;
  const float* w_scale = a.w_scale + ((row0 + 64 * wg) / kBlockK) * kblocks;
  // smem_scales: ws_smem [wgs, kb_span] and xs_smem [kb_span, N] (tokens clamped to the last, as
  // LoadTokenScales reads them), after the barriers.
  // (Token tiles past kEarlyScaleTokens compile without it: at 128 tokens it cost 168 registers
  // and spills.)
  constexpr bool kSmemScales = N <= kEarlyScaleTokens;
  if (kSmemScales && a.smem_scales != 0) {
    float* const ws_smem = reinterpret_cast<float*>(smem + (full_bar - base) + 16u * stages);
    float* const xs_smem = ws_smem + wgs * a.kb_span;
    const int tid = static_cast<int>(threadIdx.x);
    for (int i = tid; i < wgs * n_kb; i += 128 * wgs) {
      const int w = i / n_kb;
      ws_smem[w * a.kb_span + i % n_kb] =
          __ldg(a.w_scale + ((row0 + 64 * w) / kBlockK) * kblocks + kb_begin + i % n_kb);
    }
    if constexpr (!A16) {
      for (int i = tid; i < n_kb * N; i += 128 * wgs) {
        xs_smem[i] = __ldg(a.xs + (kb_begin + i / N) * a.m + min(token0 + i % N, a.m - 1));
      }
    }
    asm volatile("bar.sync 3, %0;\n" ::"r"(128 * wgs) : "memory");  // every consumer's loads
  }
  float acc[N / 2];
  float p[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = p[i] = 0.0f;
  for (int it = 0; it < n_kb; ++it) {
    const int s = it % stages;
    const uint32_t stage = base + s * stage_bytes;
    const int64_t kb = kb_begin + it;
    // The block's scales: loaded before the wait where registers allow, so their latency hides
    // behind it and the products.
    // (Shared addresses recomputed here rather than kept: at N = 128 every register counts.)
    const uint32_t scales = full_bar + 16u * stages;
    const float ws = kSmemScales && a.smem_scales != 0
                         ? LoadSharedF32(scales + 4u * (wg * a.kb_span + it))
                         : __ldg(w_scale + kb);
    float xs[A16 ? 1 : N / 4];
    if constexpr (!A16 && N <= kEarlyScaleTokens) {
      if (a.smem_scales == 0) LoadTokenScales<N>(a, kb, token0, t, xs);
    }
    MbarrierWait(full_bar + 8u * s, static_cast<uint32_t>((it / stages) & 1));
    __syncwarp();  // wgmma is .sync.aligned: the warp converged after its spin
    bool register_weights = false;
    if constexpr (A16 && N <= kRegWeightTokens) register_weights = a.reg_weights != 0;
    if (register_weights) {
      if constexpr (A16 && N <= kRegWeightTokens) {
        ProductsRegisterWeights<N>(p, smem + s * stage_bytes + wg * 64 * kBlockK, stage + w_bytes,
                                   warp % 4, lane);
      }
    } else if constexpr (A16) {
      const uint32_t conv = conv_offset + wg * kConvBytes;
      WarpgroupBarrier(wg);  // the last block's products finished reading conv
      ConvertWeights(smem + s * stage_bytes + wg * 64 * kBlockK, smem + conv,
                     static_cast<int>(threadIdx.x) % 128);
      FenceProxyAsync();     // generic writes before the wgmma (async proxy) reads
      WarpgroupBarrier(wg);  // every row converted
      WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kBlockK / 16; ++ks) {
        const uint32_t col = (ks % 4) * 32;
        WgmmaBf16<N>(p, SmemDescriptor(base + conv + (ks / 4) * (64 * 128) + col, 16, 1024),
                     SmemDescriptor(stage + w_bytes + (ks / 4) * (N * 128) + col, 16, 1024), ks);
      }
    } else {
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 32; ++kk) {
        WgmmaE4m3<N>(p, SmemDescriptor(stage + wg * 64 * kBlockK + kk * 32, 16, 1024),
                     SmemDescriptor(stage + w_bytes + kk * 32, 16, 1024), kk);
      }
    }
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegisters(p);
    __syncwarp();
    if (lane == 0) MbarrierArrive(empty_bar + 8u * s);
    if constexpr (A16) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc[i] += p[i] * ws;
    } else {
      if (kSmemScales && a.smem_scales != 0) {
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          const uint32_t at = scales + 4u * (wgs * a.kb_span + it * N + 8 * j + 2 * t);
          xs[2 * j] = LoadSharedF32(at);
          xs[2 * j + 1] = LoadSharedF32(at + 4u);
        }
      } else if constexpr (N > kEarlyScaleTokens) {
        LoadTokenScales<N>(a, kb, token0, t, xs);
      }
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
        const float s0 = ws * xs[2 * j];
        const float s1 = ws * xs[2 * j + 1];
        acc[4 * j + 0] += p[4 * j + 0] * s0;
        acc[4 * j + 1] += p[4 * j + 1] * s1;
        acc[4 * j + 2] += p[4 * j + 2] * s0;
        acc[4 * j + 3] += p[4 * j + 3] * s1;
      }
    }
  }

  if (a.cluster_reduce != 0) {
    ClusterReduce<N>(a, smem, acc, wgs, token0, row0);
    return;
  }
  // d[4j + c]: row 16 (warp % 4) + g (+ 8 for c >= 2), token 8j + 2t + (c & 1).
  const int64_t row_base = row0 + 64 * wg + 16 * (warp % 4) + g;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const int64_t row = row_base + ((i & 2) != 0 ? 8 : 0);
    const int64_t token = token0 + 8 * (i / 4) + 2 * t + (i & 1);
    if (row >= a.n || token >= a.m) continue;
    if (a.k_splits > 1) {
      a.partial[(int64_t{blockIdx.z} * a.m + token) * a.n + row] = acc[i];
    } else {
      bs::StoreOut(a.out, a.out_f32, token * a.out_stride + row, acc[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The launch shape of one call: a pure function of the sizes and the config.
struct WgmmaPlan {
  int n_tile = 8;  // tokens per block (the instantiation)
  int wgs = 2;     // consumer warpgroups
  int stages = 4;  // ring depth after the shared-memory limit
  int64_t token_tiles = 1;
  int64_t row_tiles = 1;
  int32_t splits = 1;
  bool cluster_reduce = false;  // splits > 1 reduced in-kernel (clusters of 1 x 1 x splits)
  bool smem_scales = false;     // the split's scales staged in shared memory first
  bool reg_weights = false;     // A16 with n_tile <= kRegWeightTokens: A from registers
  int32_t kb_span = 1;          // the most 128-k blocks one split has
  size_t xq_bytes = 0;
  size_t xs_bytes = 0;
  size_t partial_bytes = 0;
  size_t smem_bytes = 0;
  size_t total() const { return xq_bytes + xs_bytes + partial_bytes; }
};

// a16: W8A16 (no quantized activations in the workspace; bf16 weight copies in shared memory).
WgmmaPlan PlanWgmma(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config, bool a16) {
  WgmmaPlan p;
  p.n_tile =
      static_cast<int>(std::min<int64_t>(kMaxTokenTile, (std::max<int64_t>(m, 1) + 7) / 8 * 8));
  // warpgroups 0 (auto): 2 for W8A16 token tiles past kRegWeightTokens when there are target_blocks
  // row tiles of 64 without a split (wq_b at 128 tokens: the bf16 activations re-read per block
  // halved), else 1.
  const int64_t row_tiles_1 = (n + 63) / 64;
  const bool two = a16 && p.n_tile > kRegWeightTokens && config.target_blocks > 0 &&
                   row_tiles_1 >= config.target_blocks;
  p.wgs = config.warpgroups == 0 ? (two ? 2 : 1) : std::clamp(config.warpgroups, 1, kMaxWarpgroups);
  p.token_tiles = (m + p.n_tile - 1) / p.n_tile;
  p.row_tiles = (n + 64 * p.wgs - 1) / (64 * p.wgs);
  const int64_t tiles = std::max<int64_t>(1, p.token_tiles * p.row_tiles);
  const int64_t kblocks = k / kBlockK;
  int64_t splits = config.target_blocks > 0 ? (config.target_blocks + tiles / 2) / tiles : 1;
  // cluster_reduce only for token tiles <= kClusterReduceTokens (at 128 tokens it was 1.7x slower
  // than the reduce kernel on the H200, 2026-12-04 15:40 UTC).
  const bool cluster = config.cluster_reduce && p.n_tile <= kClusterReduceTokens;
  const int64_t max_splits = cluster ? kFp8WgmmaClusterSplits : kMaxSplits;
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(max_splits, kblocks));
  if (cluster) {
    while ((splits & (splits - 1)) != 0) splits &= splits - 1;  // a power of two: 1, 2, 4, 8
  }
  p.splits = static_cast<int32_t>(splits);
  p.cluster_reduce = cluster && p.splits > 1;
  p.kb_span = static_cast<int32_t>((kblocks + splits - 1) / splits);
  p.smem_scales = config.smem_scales && p.n_tile <= kEarlyScaleTokens;
  p.reg_weights = a16 && config.a16_register_weights && p.n_tile <= kRegWeightTokens;
  const uint32_t scale_bytes =
      p.smem_scales ? static_cast<uint32_t>((p.wgs + (a16 ? 0 : p.n_tile)) * p.kb_span * 4) : 0u;
  const uint32_t stage_bytes = StageBytes(p.wgs, p.n_tile, a16);
  const uint32_t conv_bytes = a16 && !p.reg_weights ? p.wgs * kConvBytes : 0;
  const int fit =
      static_cast<int>((kSmemLimit - kSmemSlack - conv_bytes - scale_bytes) / (stage_bytes + 16));
  // stages 0 (auto): 2 for W8A16 token tiles past 64 (a 40 KB stage at 128 tokens: two blocks per
  // multiprocessor instead of one; 1.3x faster at 128 tokens on the H200), else 4.
  const int stages = config.stages != 0 ? config.stages : a16 && p.n_tile > 64 ? 2 : 4;
  p.stages = std::clamp(std::min(stages, fit), 2, kMaxStages);
  p.xq_bytes = a16 ? 0 : bs::AlignUp(static_cast<size_t>(m * k));
  p.xs_bytes = a16 ? 0 : bs::AlignUp(static_cast<size_t>(m * kblocks) * sizeof(float));
  p.partial_bytes = p.splits > 1 && !p.cluster_reduce
                        ? bs::AlignUp(static_cast<size_t>(p.splits) * m * n * 4)
                        : 0;
  p.smem_bytes =
      static_cast<size_t>(p.stages) * (stage_bytes + 16) + conv_bytes + scale_bytes + kSmemSlack;
  return p;
}

// A 2-D tensor [rows, k] (e4m3, or bf16 when `bf16`; row stride `stride` elements) in boxes of
// box_rows x 128 bytes with the 128-byte swizzle, rows past the end read as zeros.
bool EncodeMap(CUtensorMap* map, const void* p, int64_t rows, int64_t k, int64_t stride,
               int box_rows, bool bf16) {
  const auto encode = TensorMapEncodeFunction();
  if (encode == nullptr) return false;
  const int64_t element_bytes = bf16 ? 2 : 1;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride * element_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                const_cast<void*>(p), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int N, bool A16>
cudaError_t LaunchN(const CUtensorMap& w_map, const CUtensorMap& x_map, const WgmmaArgs& a,
                    const WgmmaPlan& p, cudaStream_t stream) {
  static std::once_flag once;
  static cudaError_t attribute = cudaSuccess;
  std::call_once(once, [] {
    attribute = cudaFuncSetAttribute(Fp8WgmmaKernel<N, A16>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemLimit);
  });
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(static_cast<unsigned>(p.token_tiles), static_cast<unsigned>(p.row_tiles),
                  static_cast<unsigned>(p.splits));
  return bs::LaunchClustered(Fp8WgmmaKernel<N, A16>, grid,
                             dim3(static_cast<unsigned>(128 * p.wgs + 32)), p.smem_bytes,
                             a.cluster_reduce != 0 ? p.splits : 1, stream, w_map, x_map, a);
}

using LaunchFn = cudaError_t (*)(const CUtensorMap&, const CUtensorMap&, const WgmmaArgs&,
                                 const WgmmaPlan&, cudaStream_t);

template <bool A16, int... I>
constexpr std::array<LaunchFn, sizeof...(I)> LaunchTable(std::integer_sequence<int, I...>) {
  return {&LaunchN<8 * (I + 1), A16>...};
}

cudaError_t LaunchWgmma(const CUtensorMap& w_map, const CUtensorMap& x_map, const WgmmaArgs& a,
                        const WgmmaPlan& p, bool a16, cudaStream_t stream) {
  constexpr auto kTiles = std::make_integer_sequence<int, kMaxTokenTile / 8>{};
  static constexpr auto kTable = LaunchTable<false>(kTiles);
  static constexpr auto kTableA16 = LaunchTable<true>(kTiles);
  return (a16 ? kTableA16 : kTable)[p.n_tile / 8 - 1](w_map, x_map, a, p, stream);
}

bool WgmmaSizesValid(int64_t m, int64_t n, int64_t k) {
  return m >= 0 && n >= 0 && k > 0 && k % kBlockK == 0 && m < (int64_t{1} << 31) &&
         k < (int64_t{1} << 31) && n < (int64_t{1} << 31) &&
         bs::ProductAtMost(m, k, bs::kMaxElements) && bs::ProductAtMost(n, k, bs::kMaxElements) &&
         bs::ProductAtMost(kMaxSplits * std::max<int64_t>(m, 1), n, bs::kMaxElements / 4);
}

}  // namespace

Fp8WgmmaConfig fp8_gemm_wgmma_default_config() {
  static const Fp8WgmmaConfig config = [] {
    Fp8WgmmaConfig c = kFp8WgmmaDecodeConfig;
    const char* env = std::getenv("PDSERVE_FP8_WGMMA");
    if (env != nullptr) {
      int wgs = 0;
      int stages = 0;
      int target = 0;
      int cluster = c.cluster_reduce ? 1 : 0;
      int scales = c.smem_scales ? 1 : 0;
      int reg = c.a16_register_weights ? 1 : 0;
      const int fields =
          std::sscanf(env, "%d,%d,%d,%d,%d,%d", &wgs, &stages, &target, &cluster, &scales, &reg);
      if (fields >= 3 && wgs >= 0 && wgs <= kMaxWarpgroups && (stages == 0 || stages >= 2) &&
          stages <= kMaxStages && target >= 0 && (cluster == 0 || cluster == 1) &&
          (scales == 0 || scales == 1) && (reg == 0 || reg == 1)) {
        c.warpgroups = wgs;
        c.stages = stages;
        c.target_blocks = target;
        c.cluster_reduce = cluster == 1;
        c.smem_scales = scales == 1;
        c.a16_register_weights = reg == 1;
      }
    }
    return c;
  }();
  return config;
}

size_t fp8_gemm_wgmma_workspace_bytes(int64_t m, int64_t n, int64_t k,
                                      const Fp8WgmmaConfig& config) {
  return WgmmaSizesValid(m, n, k) ? PlanWgmma(m, n, k, config, false).total() : 0;
}

size_t fp8_gemm_w8a16_wgmma_workspace_bytes(int64_t m, int64_t n, int64_t k,
                                            const Fp8WgmmaConfig& config) {
  return WgmmaSizesValid(m, n, k) ? PlanWgmma(m, n, k, config, true).total() : 0;
}

int32_t fp8_gemm_wgmma_splits(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config) {
  return WgmmaSizesValid(m, n, k) ? PlanWgmma(m, n, k, config, false).splits : 0;
}

namespace {

// Both modes: checks, descriptors, (act quant), the GEMM, the split-k reduction.
cudaError_t RunWgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                     const uint8_t* w, const float* w_scale, int64_t n, bool a16,
                     bool ue8m0_act_scale, __nv_bfloat16* out, float* out_f32, int64_t out_stride,
                     void* workspace, size_t workspace_bytes, cudaStream_t stream,
                     const Fp8WgmmaConfig& config, std::string* refusal) {
  cudaError_t status = fp8_gemm_internal::ValidateDense(
      x, m, k, x_stride, w, w_scale, n, fp8_gemm_internal::OutForChecks(out, out_f32), out_stride,
      refusal);
  if (status != cudaSuccess || m == 0 || n == 0) return status;
  if (!WgmmaSizesValid(m, n, k)) {
    return bs::Refuse(refusal, "n, k: 2^31 or more, or the split-k sums (32 * m * n) over 2^60");
  }
  const WgmmaPlan plan = PlanWgmma(m, n, k, config, a16);
  if (plan.total() > 0) {
    status = fp8_gemm_internal::CheckWorkspace(workspace, workspace_bytes, plan.total(), refusal);
    if (status != cudaSuccess) return status;
  }
  uint8_t* xq = static_cast<uint8_t*>(workspace);
  float* xs = a16 ? nullptr : reinterpret_cast<float*>(xq + plan.xq_bytes);
  float* partial = reinterpret_cast<float*>(xq + plan.xq_bytes + plan.xs_bytes);
  CUtensorMap w_map;
  CUtensorMap x_map;
  const bool encoded = EncodeMap(&w_map, w, n, k, k, 64 * plan.wgs, false) &&
                       (a16 ? EncodeMap(&x_map, x, m, k, x_stride, plan.n_tile, true)
                            : EncodeMap(&x_map, xq, m, k, k, plan.n_tile, false));
  if (!encoded) {
    if (refusal != nullptr) *refusal = "cuTensorMapEncodeTiled failed (driver too old?)";
    return cudaErrorNotSupported;
  }
  if (!a16) {
    status = bs::LaunchActQuant(x, m, k, x_stride, ue8m0_act_scale, xq, xs, stream);
    if (status != cudaSuccess) return status;
  }
  WgmmaArgs a{};
  a.w_scale = w_scale;
  a.xs = xs;
  a.m = m;
  a.n = n;
  a.k = k;
  a.k_splits = plan.splits;
  a.stages = plan.stages;
  a.cluster_reduce = plan.cluster_reduce ? 1 : 0;
  a.smem_scales = plan.smem_scales ? 1 : 0;
  a.reg_weights = plan.reg_weights ? 1 : 0;
  a.kb_span = plan.kb_span;
  a.partial = partial;
  a.out = out;
  a.out_f32 = out_f32;
  a.out_stride = out_stride;
  status = LaunchWgmma(w_map, x_map, a, plan, a16, stream);
  if (status != cudaSuccess || plan.splits == 1 || plan.cluster_reduce) return status;
  return bs::LaunchReduce(partial, plan.splits, m, n, nullptr, nullptr, 0, out, out_stride, stream,
                          out_f32);
}

}  // namespace

cudaError_t fp8_gemm_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                           __nv_bfloat16* out, int64_t out_stride, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream,
                           const Fp8WgmmaConfig& config, std::string* refusal) {
  return RunWgmma(x, m, k, x_stride, w, w_scale, n, false, ue8m0_act_scale, out, nullptr,
                  out_stride, workspace, workspace_bytes, stream, config, refusal);
}

cudaError_t fp8_gemm_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                           float* out, int64_t out_stride, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, const Fp8WgmmaConfig& config,
                           std::string* refusal) {
  return RunWgmma(x, m, k, x_stride, w, w_scale, n, false, ue8m0_act_scale, nullptr, out,
                  out_stride, workspace, workspace_bytes, stream, config, refusal);
}

cudaError_t fp8_gemm_w8a16_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                                 const uint8_t* w, const float* w_scale, int64_t n,
                                 __nv_bfloat16* out, int64_t out_stride, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream,
                                 const Fp8WgmmaConfig& config, std::string* refusal) {
  return RunWgmma(x, m, k, x_stride, w, w_scale, n, true, false, out, nullptr, out_stride,
                  workspace, workspace_bytes, stream, config, refusal);
}

cudaError_t fp8_gemm_w8a16_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                                 const uint8_t* w, const float* w_scale, int64_t n, float* out,
                                 int64_t out_stride, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream, const Fp8WgmmaConfig& config,
                                 std::string* refusal) {
  return RunWgmma(x, m, k, x_stride, w, w_scale, n, true, false, nullptr, out, out_stride,
                  workspace, workspace_bytes, stream, config, refusal);
}

}  // namespace pdserve::kernels::cuda
