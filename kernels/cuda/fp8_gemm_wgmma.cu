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
// Consumer options for the wait on each block's products (the loop is latency-bound there):
// - two_in_flight (IN_FLIGHT kernels, N <= 64): a warpgroup issues block j + 1's products into a
//   second partial accumulator q before it waits for block j's (wgmma.wait_group 1) and folds
//   them; p and q alternate (W8A16: each with its own A fragment registers). Same fold order and
//   bits as one block at a time.
// - alternate_turns (turns = 2): two consumer warpgroups share one row group's 64 rows and take
//   the split's k blocks in turns (even / odd), each folding into its own sums; at the end
//   warpgroup 1 hands its sums to warpgroup 0 through shared memory (CombineTurns), which adds
//   them (even + odd: deterministic, a different rounding order than one warpgroup's).
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
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/block_trace.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/fp8_gemm_wgmma_parts.cuh"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/tensor_map.cuh"
#include "kernels/cuda/wgmma_e4m3.cuh"
#include "kernels/env_switch.h"

namespace pdserve::kernels::cuda {
namespace {

using namespace fp8_wgmma;  // NOLINT(build/namespaces): this file's own pieces
namespace bs = block_scaled;

// A16: W8A16 (x_map over bf16 x, no activation scales; weights converted to bf16 in shared
// memory, products on bf16 wgmma m64nNk16). IN_FLIGHT: two blocks' products in flight per
// consumer warpgroup (N <= kInFlightTokens; A16 with register weights only). A kernel of its own:
// ptxas serializes every wgmma of a function where register-A products stay in flight across a
// branch, which would slow the one-block-at-a-time loop too.
// The kernel's body; Fp8WgmmaKernel and Fp8WgmmaCappedKernel below differ only in the registers
// ptxas may give a thread (the arithmetic, and so the bits, are the same).
template <int N, bool A16, bool IN_FLIGHT>
__device__ __forceinline__ void Fp8WgmmaBody(const CUtensorMap& w_map, const CUtensorMap& x_map,
                                             const WgmmaArgs& a) {
  extern __shared__ uint8_t smem_raw[];
  const trace::BlockTraceScope traced(a.trace);
  const int consumers = static_cast<int>(blockDim.x) / 128;  // consumer warpgroups
  const int turns = A16 || N <= kAlternateA8Tokens ? a.turns : 1;
  const int tgroups = a.tgroups;                  // token groups of N (split_tokens: 2)
  const int wgs = consumers / (turns * tgroups);  // row groups of 64 weight rows
  const int n_block = N * tgroups;                // the block's tokens
  const uint32_t box_bytes = static_cast<uint32_t>(n_block * 128);  // one activation box
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const uint32_t base = (SharedAddress(smem_raw) + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - SharedAddress(smem_raw));  // generic, 1024-aligned
  const uint32_t w_bytes = static_cast<uint32_t>(64 * wgs * kBlockK);
  const uint32_t stage_bytes = StageBytes(wgs, n_block, A16);
  const int stages = a.stages;
  const uint32_t conv_offset = stages * stage_bytes;  // A16's per-warpgroup bf16 weights
  const uint32_t full_bar =
      base + conv_offset + (A16 && a.reg_weights == 0 ? consumers * kConvBytes : 0u);
  const uint32_t empty_bar = full_bar + 8u * stages;
  const int64_t kblocks = a.k / kBlockK;
  const int kb_begin = static_cast<int>(kblocks * blockIdx.z / a.k_splits);
  const int kb_end = static_cast<int>(kblocks * (blockIdx.z + 1) / a.k_splits);
  const int n_kb = kb_end - kb_begin;
  // stagger_k: the split's k blocks in the order rot, rot + 1, ..., n_kb - 1, 0, ..., rot - 1
  // (rot from the row tile), so the blocks that run at once read different activation boxes.
  // multicast: clusters of the row tiles 2j, 2j + 1 (the same k order in both, as they share the
  // activation boxes); this block loads rows rank * half .. of each box into both.
  const bool multicast = a.multicast != 0;
  const uint32_t rank = multicast ? ClusterRank() : 0u;
  const int pair_y = static_cast<int>(blockIdx.y) / (multicast ? 2 : 1);
  const int rot = a.stagger != 0 && n_kb > 0 ? pair_y % n_kb : 0;
  const auto kb_at = [rot, n_kb](int it) { return it + rot < n_kb ? it + rot : it + rot - n_kb; };
  const int64_t block_token0 = int64_t{blockIdx.x} * n_block;
  const int64_t row0 = int64_t{blockIdx.y} * 64 * wgs;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      MbarrierInit(full_bar + 8u * s, 1);
      // each stage is one turn's: wgs * tgroups warpgroups (of both blocks with multicast)
      MbarrierInit(empty_bar + 8u * s, 4 * wgs * tgroups * (multicast ? 2 : 1));
    }
    FenceBarrierInit();  // the initialized barriers are visible to the TMA unit
    FenceProxyAsync();
  }
  __syncthreads();
  if (multicast) {  // the other block's barriers are initialized before any copy into it
    ClusterArrive();
    ClusterWait();
  }
  const int half = n_block / 2;
  const uint32_t x_dst = multicast ? w_bytes + rank * half * 128u : w_bytes;  // in a stage
  // (A half wholly past the tokens loads from the last token on: those columns are never stored.)
  const int32_t x_token0 =
      static_cast<int32_t>(min(block_token0 + (multicast ? rank * half : 0), a.m - 1));
  const auto x_mask = static_cast<uint16_t>(multicast ? 3u : 0u);

  if (warp == 4 * consumers) {  // producer
    if (lane == 0) {
      PrefetchTensorMap(&w_map);
      PrefetchTensorMap(&x_map);
      const int ahead = min(stages, n_kb);
      for (int it = 0; it < ahead; ++it) {
        const uint32_t stage = base + it * stage_bytes;
        MbarrierArriveExpectTx(full_bar + 8u * it, stage_bytes);
        TmaLoad2d(stage, &w_map, (kb_begin + kb_at(it)) * kBlockK, static_cast<int32_t>(row0),
                  full_bar + 8u * it);
      }
      bs::GridDependencyWait();  // xq / xs come from the act-quant kernel
      bs::GridDependencyTrigger();
      for (int it = 0; it < ahead; ++it) {
        LoadActivations<A16>(&x_map, base + it * stage_bytes + x_dst,
                             (kb_begin + kb_at(it)) * kBlockK, x_token0, full_bar + 8u * it,
                             box_bytes, x_mask);
      }
      for (int it = ahead; it < n_kb; ++it) {
        const int s = it % stages;
        const uint32_t stage = base + s * stage_bytes;
        MbarrierWait(empty_bar + 8u * s, static_cast<uint32_t>((it / stages - 1) & 1));
        MbarrierArriveExpectTx(full_bar + 8u * s, stage_bytes);
        const int32_t kc = (kb_begin + kb_at(it)) * kBlockK;
        TmaLoad2d(stage, &w_map, kc, static_cast<int32_t>(row0), full_bar + 8u * s);
        LoadActivations<A16>(&x_map, stage + x_dst, kc, x_token0, full_bar + 8u * s, box_bytes,
                             x_mask);
      }
    }
    if (a.cluster_reduce != 0) ClusterReduce<N>(a, smem, nullptr, wgs, block_token0, row0);
    if (multicast) {  // no block leaves while the other may still copy or arrive into it
      ClusterArrive();
      ClusterWait();
    }
    return;
  }

  // Consumer warpgroup wg: row group rg (weight rows row0 + 64 rg .. + 63, one 128-row scale
  // block), the 128-k blocks turn, turn + turns, ... of the split, the block's tokens tg N ..
  // tg N + N - 1 (rows tg N .. of the activation box).
  // smem_scales: ws_smem [wgs, kb_span] and xs_smem [kb_span, n_block] (tokens clamped to the
  // last, as LoadTokenScales reads them). W8A8: copied by cp.async and waited for (wait_all and
  // the consumers' barrier 3: scales_ready) only after the first block's products are issued, so
  // the copies' latency (a miss to HBM behind the weight stream the producer issued: 1-2.4 us in
  // tools/gpu/run_trace64.sh's timelines, H100, 2026-12-06) overlaps the first stage's wait and
  // products instead of preceding them; the weight scales, like the weights, are not written by
  // the kernel before this one, so they go out before its wait, the activation scales after.
  // W8A16 (weight scales only): loaded after the wait and waited for before the loop, as before
  // 2026-12-06 (the early copies were 0.2-0.5 us slower on wo_b, w13 and w2 at 16 tokens there).
  // (Token tiles past kEarlyScaleTokens compile without it: at 128 tokens it cost 168 registers
  // and spills.)
  constexpr bool kSmemScales = N <= kEarlyScaleTokens;
  const bool staged = kSmemScales && a.smem_scales != 0;
  const uint32_t ws_smem = full_bar + 16u * stages;  // shared address
  if (!A16 && staged) {
    for (int i = static_cast<int>(threadIdx.x); i < wgs * n_kb; i += 128 * consumers) {
      const int w = i / n_kb;
      CopyAsync4(ws_smem + 4u * (w * a.kb_span + i % n_kb),
                 a.w_scale + ((row0 + 64 * w) / kBlockK) * kblocks + kb_begin + i % n_kb);
    }
  }
  bs::GridDependencyWait();  // xs
  bs::GridDependencyTrigger();
  if (threadIdx.x == 0) traced.MarkDependency();
  const int wg = warp / 4;
  const int tg = wg % tgroups;
  const int rg = wg / tgroups / turns;
  const int turn = wg / tgroups % turns;
  const int64_t token0 = block_token0 + int64_t{tg} * N;
  const uint32_t b_offset = static_cast<uint32_t>(tg * N * 128);  // this group's activation rows
  const int g = lane / 4;
  const int t = lane % 4;
  const float* w_scale = a.w_scale + ((row0 + 64 * rg) / kBlockK) * kblocks;
  if constexpr (A16) {
    if (staged) {
      float* const ws = reinterpret_cast<float*>(smem + (ws_smem - base));
      for (int i = static_cast<int>(threadIdx.x); i < wgs * n_kb; i += 128 * consumers) {
        const int w = i / n_kb;
        ws[w * a.kb_span + i % n_kb] =
            __ldg(a.w_scale + ((row0 + 64 * w) / kBlockK) * kblocks + kb_begin + i % n_kb);
      }
      asm volatile("bar.sync 3, %0;\n" ::"r"(128 * consumers) : "memory");  // every consumer's
    }
  } else {
    if (staged) {
      const uint32_t xs_smem = ws_smem + 4u * wgs * a.kb_span;
      for (int i = static_cast<int>(threadIdx.x); i < n_kb * n_block; i += 128 * consumers) {
        CopyAsync4(xs_smem + 4u * i, a.xs + (kb_begin + i / n_block) * a.m +
                                         min(block_token0 + i % n_block, a.m - 1));
      }
    }
  }
  if (threadIdx.x == 0) traced.Mark(kTraceSetup);
  // W8A8: every consumer thread calls it exactly once, after its first block's products are
  // issued (or first, when it has no block): the staged scales are then in shared memory.
  // Unconditional (without staged scales a barrier that waits for nothing): a branch while
  // products are in flight may make ptxas serialize the kernel's wgmma. W8A16: nothing.
  const auto scales_ready = [consumers]() {
    if constexpr (!A16) {
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      // Not .aligned: the warpgroups may reach it from different places (a warpgroup without a
      // block: before its loop).
      asm volatile("barrier.sync 3, %0;\n" ::"r"(128 * consumers) : "memory");
    }
  };
  constexpr int kXs = A16 ? 1 : N / 4;
  // Block it's weight scale, and (early, where registers allow) its activation scales: loaded
  // before the stage wait so their latency hides behind it and the products.
  // (Shared addresses recomputed here rather than kept: at N = 128 every register counts.)
  const auto load_scales = [&](int it, float(&xs)[kXs]) -> float {
    const uint32_t scales = full_bar + 16u * stages;
    const float ws = kSmemScales && a.smem_scales != 0
                         ? LoadSharedF32(scales + 4u * (rg * a.kb_span + kb_at(it)))
                         : __ldg(w_scale + kb_begin + kb_at(it));
    if constexpr (!A16 && N <= kEarlyScaleTokens) {
      if (a.smem_scales == 0) LoadTokenScales<N>(a, kb_begin + kb_at(it), token0, t, xs);
    }
    return ws;
  };
  // Waits for block it's stage and issues its products into p (committed, not waited for); A16
  // with register weights: the A fragments in `afrag`.
  const auto issue = [&](float(&p)[N / 2], RegisterA& afrag, int it) {
    const int s = it % stages;
    const uint32_t stage = base + s * stage_bytes;
    MbarrierWait(full_bar + 8u * s, static_cast<uint32_t>((it / stages) & 1));
    // (No first / last stage marks here: inside the loop they cost 5-21 registers a thread,
    // a block a multiprocessor at W8A16 24 / 80 tokens and W8A8 64; the ring's own timing is
    // decode_bench's TmaStreamKernel.)
    __syncwarp();  // wgmma is .sync.aligned: the warp converged after its spin
    bool register_weights = A16 && IN_FLIGHT;
    if constexpr (A16 && N <= kRegWeightTokens && !IN_FLIGHT) {
      register_weights = a.reg_weights != 0;
    }
    if (register_weights) {
      if constexpr (A16 && N <= kRegWeightTokens) {
        ProductsRegisterWeights<N>(p, afrag, smem + s * stage_bytes + rg * 64 * kBlockK,
                                   stage + w_bytes + b_offset, box_bytes, warp % 4, lane);
      }
    } else if constexpr (A16 && !IN_FLIGHT) {
      const uint32_t conv = conv_offset + wg * kConvBytes;
      ProductsConvertedWeights<N>(p, smem + s * stage_bytes + rg * 64 * kBlockK, smem + conv,
                                  base + conv, stage + w_bytes + b_offset, box_bytes, wg);
    } else if constexpr (!A16) {
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 32; ++kk) {
        WgmmaE4m3<N>(p, SmemDescriptor(stage + rg * 64 * kBlockK + kk * 32, 16, 1024),
                     SmemDescriptor(stage + w_bytes + b_offset + kk * 32, 16, 1024), kk);
      }
    }
    WgmmaCommit();
  };
  // Block it's products p are complete: release its stage and fold them into acc.
  float acc[N / 2];
  const auto fold = [&](float(&p)[N / 2], int it, float ws, float(&xs)[kXs]) {
    FenceRegisters(p);
    __syncwarp();
    if (lane == 0) {
      MbarrierArrive(empty_bar + 8u * (it % stages));
      if (multicast) MbarrierArriveInCluster(empty_bar + 8u * (it % stages), rank ^ 1u);
    }
    if constexpr (A16) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc[i] += p[i] * ws;
    } else {
      if (kSmemScales && a.smem_scales != 0) {
        const uint32_t scales = full_bar + 16u * stages;
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          const uint32_t at =
              scales + 4u * (wgs * a.kb_span + kb_at(it) * n_block + tg * N + 8 * j + 2 * t);
          xs[2 * j] = LoadSharedF32(at);
          xs[2 * j + 1] = LoadSharedF32(at + 4u);
        }
      } else if constexpr (N > kEarlyScaleTokens) {
        LoadTokenScales<N>(a, kb_begin + kb_at(it), token0, t, xs);
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
  };
  float p[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = p[i] = 0.0f;
  if constexpr (!IN_FLIGHT) {
    // One block at a time: its products are waited for before the next block's are issued.
    int it = turn;
    // W8A8: the first block's products go out before the scales' wait. (W8A16: the loop alone, as
    // before; with the first block peeled its kernels took 8 more registers a thread and were
    // 1.2-1.4 us slower on wo_b, w13 and w2 at 16 tokens, H100, 2026-12-06.)
    if constexpr (!A16) {
      if (it < n_kb) {
        float xs[kXs];
        RegisterA afrag;
        issue(p, afrag, it);
        scales_ready();
        const float ws = load_scales(it, xs);
        WgmmaWait<0>();
        fold(p, it, ws, xs);
        it += turns;
      } else {
        scales_ready();
      }
    }
    for (; it < n_kb; it += turns) {
      float xs[kXs];
      RegisterA afrag;
      const float ws = load_scales(it, xs);
      issue(p, afrag, it);
      WgmmaWait<0>();
      fold(p, it, ws, xs);
    }
  } else {
    // Two blocks in flight: this warpgroup's j-th block (turn + j turns) has its products issued
    // before the (j-1)-th's are waited for (wgmma.wait_group 1) and folded; p and q alternate.
    // Every branch joins with the same group in flight (ptxas serializes all wgmma otherwise).
    // The fold order (ascending blocks) and so the bits are those of the loop above.
    float q[N / 2];
    RegisterA a_p;  // the A fragments of p's and q's blocks, alive until those are waited for
    RegisterA a_q;
    float xs_p[kXs];
    float xs_q[kXs];
    float ws_p = 0.0f;
    float ws_q = 0.0f;
    const int count = n_kb > turn ? (n_kb - turn + turns - 1) / turns : 0;
    const auto block = [&](int j) { return turn + j * turns; };
    if (count == 0) scales_ready();
    if (count > 0) {
      if constexpr (A16) {
        ws_p = load_scales(block(0), xs_p);
        issue(p, a_p, block(0));
      } else {
        issue(p, a_p, block(0));
        scales_ready();
        ws_p = load_scales(block(0), xs_p);
      }
      int j = 1;  // p holds block j - 1, in flight
#pragma unroll 1
      for (; j + 1 < count; j += 2) {
        ws_q = load_scales(block(j), xs_q);
        issue(q, a_q, block(j));
        WgmmaWait<1>();
        if constexpr (A16) FenceRegisterA(a_p);
        fold(p, block(j - 1), ws_p, xs_p);
        ws_p = load_scales(block(j + 1), xs_p);
        issue(p, a_p, block(j + 1));
        WgmmaWait<1>();
        if constexpr (A16) FenceRegisterA(a_q);
        fold(q, block(j), ws_q, xs_q);
      }
      if (j < count) {
        ws_q = load_scales(block(j), xs_q);
        issue(q, a_q, block(j));
        WgmmaWait<1>();
        if constexpr (A16) FenceRegisterA(a_p);
        fold(p, block(j - 1), ws_p, xs_p);
        WgmmaWait<0>();
        if constexpr (A16) FenceRegisterA(a_q);
        fold(q, block(j), ws_q, xs_q);
      } else {
        WgmmaWait<0>();
        if constexpr (A16) FenceRegisterA(a_p);
        fold(p, block(j - 1), ws_p, xs_p);
      }
    }
  }

  if (threadIdx.x == 0) traced.Mark(kTraceLoopDone);
  if (turns == 2 && !CombineTurns<N>(smem, acc, consumers, rg, turn)) return;
  if (a.cluster_reduce != 0) {
    ClusterReduce<N>(a, smem, acc, wgs, token0, row0);
    return;
  }
  // d[4j + c]: row 16 (warp % 4) + g (+ 8 for c >= 2), token 8j + 2t + (c & 1).
  const int64_t row_base = row0 + 64 * rg + 16 * (warp % 4) + g;
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
  if (multicast) {  // no block leaves while the other may still copy or arrive into it
    ClusterArrive();
    ClusterWait();
  }
}

template <int N, bool A16, bool IN_FLIGHT>
__global__ void __launch_bounds__(kMaxThreads, 1)
    Fp8WgmmaKernel(const __grid_constant__ CUtensorMap w_map,
                   const __grid_constant__ CUtensorMap x_map, const WgmmaArgs a) {
  Fp8WgmmaBody<N, A16, IN_FLIGHT>(w_map, x_map, a);
}

// Fp8WgmmaConfig::max_registers: one consumer warpgroup (160 threads) with at most MAXREG
// registers a thread, so that more blocks fit on a multiprocessor (131 registers, W8A16 at 32
// tokens: 2 blocks; 128: 3; 96: 4). Token tiles up to kCappedMaxTokens, one block at a time.
template <int N, bool A16, int MAXREG>
__global__ void __maxnreg__(MAXREG)
    Fp8WgmmaCappedKernel(const __grid_constant__ CUtensorMap w_map,
                         const __grid_constant__ CUtensorMap x_map, const WgmmaArgs a) {
  Fp8WgmmaBody<N, A16, false>(w_map, x_map, a);
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The launch shape of one call: a pure function of the sizes and the config.
struct WgmmaPlan {
  int n_tile = 8;   // tokens per block (the instantiation)
  int wgs = 2;      // row groups of 64 weight rows (consumer warpgroups: wgs * turns)
  int turns = 1;    // consumer warpgroups taking turns on one row group's k blocks
  int tgroups = 1;  // split_tokens: consumer warpgroups of n_tile tokens each per block
  int stages = 4;   // ring depth after the shared-memory limit
  int64_t token_tiles = 1;
  int64_t row_tiles = 1;
  int32_t splits = 1;
  bool cluster_reduce = false;  // splits > 1 reduced in-kernel (clusters of 1 x 1 x splits)
  bool smem_scales = false;     // the split's scales staged in shared memory first
  bool reg_weights = false;     // A16 with n_tile <= kRegWeightTokens: A from registers
  bool in_flight = false;       // n_tile <= kInFlightTokens: two k blocks in flight
  bool stagger = false;         // stagger_k: each block's k blocks from a row-tile offset on
  bool multicast = false;       // multicast_activations: clusters of 2 row tiles share the boxes
  int max_registers = 0;        // Fp8WgmmaCappedKernel's cap (96 or 128), 0: Fp8WgmmaKernel
  int32_t kb_span = 1;          // the most 128-k blocks one split has
  size_t xq_bytes = 0;
  size_t xs_bytes = 0;
  size_t partial_bytes = 0;
  size_t smem_bytes = 0;
  size_t total() const { return xq_bytes + xs_bytes + partial_bytes; }
};

// W8A16 token tiles past this size run 2 stages when the config leaves stages to the plan, and
// tiles of this size too where a block has at most kA16TwoStageSpan k blocks (in three H200 runs
// 2 stages at 32 tokens were 1.02-1.07x faster on wq_b, w13, w2 with 4-8 k blocks per block and
// 1.01-1.03x slower on wo_b with 16; docs/perf.md).
constexpr int kA16TwoStageTokens = 32;
constexpr int kA16TwoStageSpan = 8;

static_assert(fp8_workspace::kWgmmaMaxTokenTile == kMaxTokenTile);
static_assert(fp8_workspace::kWgmmaMaxWarpgroups == kMaxWarpgroups);
static_assert(fp8_workspace::kWgmmaMaxSplits == kMaxSplits);
static_assert(fp8_workspace::kWgmmaRegWeightTokens == kRegWeightTokens);
static_assert(fp8_workspace::kWgmmaClusterReduceTokens == kClusterReduceTokens);
static_assert(fp8_workspace::kWgmmaAlternateA8Tokens == kAlternateA8Tokens);
static_assert(fp8_workspace::kWgmmaSplitTokensMin == kSplitTokensMin);
static_assert(fp8_workspace::kBlockK == kBlockK);
static_assert(kFp8WgmmaClusterSplits == kMaxClusterReduceSplits);

// a16: W8A16 (no quantized activations in the workspace; bf16 weight copies in shared memory).
WgmmaPlan PlanWgmma(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config, bool a16) {
  WgmmaPlan p;
  // Tiles, k splits and the workspace: fp8_gemm_workspace.h (shared with the memory plan).
  const fp8_workspace::WgmmaTiling t = fp8_workspace::PlanWgmmaTiling(m, n, k, config, a16);
  p.n_tile = t.n_tile;
  p.wgs = t.wgs;
  p.turns = t.turns;
  p.tgroups = t.tgroups;
  p.token_tiles = t.token_tiles;
  p.row_tiles = t.row_tiles;
  p.splits = t.splits;
  p.cluster_reduce = t.cluster_reduce;
  const int n_block = p.n_tile * p.tgroups;
  const int64_t kblocks = k / kBlockK;
  const int64_t splits = p.splits;
  p.kb_span = static_cast<int32_t>((kblocks + splits - 1) / splits);
  p.smem_scales = config.smem_scales && p.n_tile <= kEarlyScaleTokens;
  p.reg_weights = a16 && config.a16_register_weights && p.n_tile <= kRegWeightTokens;
  // Two blocks in flight need a second partial accumulator (registers: n_tile <= 64) and, for
  // W8A16, register weights (the shared-memory conversion buffer is one block's).
  p.in_flight = config.two_in_flight && p.n_tile <= kInFlightTokens && (!a16 || p.reg_weights);
  p.stagger = config.stagger_k;
  // Multicast halves of the activation box: each half a whole number of 8-row swizzle atoms, an
  // even number of row tiles (clusters of 2 along them), no other cluster or turns.
  p.multicast = config.multicast_activations && n_block % 16 == 0 && p.row_tiles % 2 == 0 &&
                p.turns == 1 && !p.cluster_reduce;
  const uint32_t scale_bytes =
      p.smem_scales ? static_cast<uint32_t>((p.wgs + (a16 ? 0 : n_block)) * p.kb_span * 4) : 0u;
  const uint32_t stage_bytes = StageBytes(p.wgs, n_block, a16);
  const uint32_t conv_bytes = a16 && !p.reg_weights ? p.wgs * p.turns * p.tgroups * kConvBytes : 0;
  const int fit =
      static_cast<int>((kSmemLimit - kSmemSlack - conv_bytes - scale_bytes) / (stage_bytes + 16));
  // stages 0 (auto): 2 for W8A16 token tiles past kA16TwoStageTokens (at 128 tokens a 40 KB stage:
  // two blocks per multiprocessor instead of one, 1.3x faster on the H200; at 64 tokens 1.04-1.10x
  // on all four V4-Flash shapes in three runs, docs/perf.md) and at it with short splits, unless
  // two warpgroups take turns (the block has the multiprocessor's registers to itself then),
  // else 4.
  const bool two_stages = a16 && p.turns == 1 &&
                          (p.n_tile > kA16TwoStageTokens ||
                           (p.n_tile == kA16TwoStageTokens && p.kb_span <= kA16TwoStageSpan));
  const int stages = config.stages != 0 ? config.stages : two_stages ? 2 : 4;
  p.stages = std::clamp(std::min(stages, fit), 2, kMaxStages);
  // Taking turns, an even ring: each stage then only ever holds one warpgroup's blocks, which it
  // waits for in order (an mbarrier wait by phase parity cannot tell a phase from the one two
  // ahead, and the other warpgroup may lag a phase behind). Two in flight each need 2 of its own.
  if (p.turns == 2) p.stages &= ~1;
  if (p.in_flight && p.stages < 2 * p.turns) p.in_flight = false;
  // The capped kernel: one consumer warpgroup, one block at a time, token tiles it has.
  if ((config.max_registers == 96 || config.max_registers == 128) && p.wgs == 1 && p.turns == 1 &&
      p.tgroups == 1 && !p.in_flight && p.n_tile <= kCappedMaxTokens) {
    p.max_registers = config.max_registers;
  }
  p.xq_bytes = t.xq_bytes;
  p.xs_bytes = t.xs_bytes;
  p.partial_bytes = t.partial_bytes;
  p.smem_bytes =
      static_cast<size_t>(p.stages) * (stage_bytes + 16) + conv_bytes + scale_bytes + kSmemSlack;
  return p;
}

using KernelFn = void (*)(CUtensorMap, CUtensorMap, WgmmaArgs);

// The kernel a plan launches for token tiles of N.
template <int N, bool A16>
KernelFn KernelN(const WgmmaPlan& p) {
  if constexpr (N <= kInFlightTokens) {
    if (p.in_flight) return Fp8WgmmaKernel<N, A16, true>;
  }
  if constexpr (N <= kCappedMaxTokens) {
    if (p.max_registers == 128) return Fp8WgmmaCappedKernel<N, A16, 128>;
    if (p.max_registers == 96) return Fp8WgmmaCappedKernel<N, A16, 96>;
  }
  return Fp8WgmmaKernel<N, A16, false>;
}

using KernelForFn = KernelFn (*)(const WgmmaPlan&);

template <bool A16, int... I>
constexpr std::array<KernelForFn, sizeof...(I)> KernelTable(std::integer_sequence<int, I...>) {
  return {&KernelN<8 * (I + 1), A16>...};
}

KernelFn KernelFor(const WgmmaPlan& p, bool a16) {
  constexpr auto kTiles = std::make_integer_sequence<int, kMaxTokenTile / 8>{};
  static constexpr auto kTable = KernelTable<false>(kTiles);
  static constexpr auto kTableA16 = KernelTable<true>(kTiles);
  return (a16 ? kTableA16 : kTable)[p.n_tile / 8 - 1](p);
}

cudaError_t LaunchWgmma(const CUtensorMap& w_map, const CUtensorMap& x_map, const WgmmaArgs& a,
                        const WgmmaPlan& p, bool a16, cudaStream_t stream) {
  const KernelFn kernel = KernelFor(p, a16);
  const cudaError_t attribute =
      SetMaxDynamicSharedMemory(reinterpret_cast<const void*>(kernel), kSmemLimit);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(static_cast<unsigned>(p.token_tiles), static_cast<unsigned>(p.row_tiles),
                  static_cast<unsigned>(p.splits));
  return bs::LaunchClustered(
      kernel, grid, dim3(static_cast<unsigned>(128 * p.wgs * p.turns * p.tgroups + 32)),
      p.smem_bytes, dim3(1, p.multicast ? 2 : 1, a.cluster_reduce != 0 ? p.splits : 1), stream,
      w_map, x_map, a);
}

// PDSERVE_FP8_WGMMA's text: "warpgroups,stages,target" and up to eight flags 0 / 1 in
// Fp8WgmmaConfig's order (cluster_reduce .. multicast_activations), then max_registers (0, 96 or
// 128), then a16_cluster_reduce_tokens (0-64); missing fields as in kFp8WgmmaDecodeConfig;
// nullopt for anything else.
std::optional<Fp8WgmmaConfig> ParseWgmmaConfig(std::string_view text) {
  const std::optional<std::vector<int64_t>> fields = ParseWholeNumbers(text, 3, 13);
  if (!fields) return std::nullopt;
  const std::vector<int64_t>& f = *fields;
  if (f[0] < 0 || f[0] > kMaxWarpgroups || (f[1] != 0 && f[1] < 2) || f[1] > kMaxStages ||
      f[2] < 0 || f[2] > INT32_MAX) {
    return std::nullopt;
  }
  Fp8WgmmaConfig c = kFp8WgmmaDecodeConfig;
  c.warpgroups = static_cast<int>(f[0]);
  c.stages = static_cast<int>(f[1]);
  c.target_blocks = static_cast<int>(f[2]);
  bool* const flags[] = {&c.cluster_reduce,  &c.smem_scales,          &c.a16_register_weights,
                         &c.alternate_turns, &c.two_in_flight,        &c.split_tokens,
                         &c.stagger_k,       &c.multicast_activations};
  for (size_t i = 3; i < f.size() && i < 11; ++i) {
    if (f[i] != 0 && f[i] != 1) return std::nullopt;
    *flags[i - 3] = f[i] == 1;
  }
  if (f.size() >= 12) {
    if (f[11] != 0 && f[11] != 96 && f[11] != 128) return std::nullopt;
    c.max_registers = static_cast<int>(f[11]);
  }
  if (f.size() == 13) {
    if (f[12] < 0 || f[12] > kClusterReduceTokens) return std::nullopt;
    c.a16_cluster_reduce_tokens = static_cast<int>(f[12]);
  }
  return c;
}

bool WgmmaSizesValid(int64_t m, int64_t n, int64_t k) {
  return m >= 0 && n >= 0 && k > 0 && k % kBlockK == 0 && m < (int64_t{1} << 31) &&
         k < (int64_t{1} << 31) && n < (int64_t{1} << 31) &&
         bs::ProductAtMost(m, k, bs::kMaxElements) && bs::ProductAtMost(n, k, bs::kMaxElements) &&
         bs::ProductAtMost(kMaxSplits * std::max<int64_t>(m, 1), n, bs::kMaxElements / 4);
}

}  // namespace

Fp8WgmmaConfig fp8_gemm_wgmma_default_config() {
  static const Fp8WgmmaConfig config = ReadSwitchWith(
      "PDSERVE_FP8_WGMMA", ParseWgmmaConfig, kFp8WgmmaDecodeConfig,
      "warpgroups (0-" + std::to_string(kMaxWarpgroups) + "),stages (0 or 2-" +
          std::to_string(kMaxStages) +
          "),target blocks (>= 0), then up to 8 flags 0 or 1, then max registers 0, 96 or "
          "128, then W8A16 cluster-reduce tokens 0-" +
          std::to_string(kClusterReduceTokens),
      "the default config");
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

int fp8_gemm_wgmma_kernel_registers(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config,
                                    bool a16) {
  if (!WgmmaSizesValid(m, n, k) || m == 0) return -1;
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(
                                             KernelFor(PlanWgmma(m, n, k, config, a16), a16))) !=
      cudaSuccess) {
    return -1;
  }
  return attributes.numRegs;
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
  // The activation boxes: the block's tokens, or half of them with multicast.
  const int x_rows = plan.n_tile * plan.tgroups / (plan.multicast ? 2 : 1);
  const bool encoded = EncodeGemmMap(&w_map, w, n, k, k, 64 * plan.wgs, false) &&
                       (a16 ? EncodeGemmMap(&x_map, x, m, k, x_stride, x_rows, true)
                            : EncodeGemmMap(&x_map, xq, m, k, k, x_rows, false));
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
  a.turns = plan.turns;
  a.tgroups = plan.tgroups;
  a.stagger = plan.stagger ? 1 : 0;
  a.multicast = plan.multicast ? 1 : 0;
  a.partial = partial;
  a.out = out;
  a.out_f32 = out_f32;
  a.out_stride = out_stride;
  a.trace = block_trace();
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
