// moe_grouped_gemm_wgmma (moe_gemm.cuh): the routed experts' grouped GEMM on Hopper's warpgroup
// MMA, for prefill sizes.
//
// Design (sm_90a), fp8_gemm_wgmma.cu's kernel made grouped. Before the GEMM:
// - GroupPicksKernel (moe_grouping.cuh) lists the valid picks expert by expert (entry_pick) and
//   cuts each expert's entries into work items of at most N (the token tile, 64 or 128).
// - FP8: the act-quant kernel quantizes x per row as moe_grouped_gemm's mma.sync path does (once
//   per token for gate / up); GatherRowsKernel then copies each entry's e4m3 row and its k / 128
//   scales in entry order (xg [picks, k], xsg [k / 128, picks]). W8A16: it copies the bf16 rows.
//   Every expert's rows are then contiguous, so TMA can stream a work item's rows as one box.
// The GEMM, computed transposed (out^T[n, entry] = W_e[n, :] . xg[entry, :]): one block per
// (128 weight rows, work item); grid x = row tile (fastest, so the blocks running at once share
// a few items' activation rows through L2), y = work item (blocks past the device-side count
// exit at once). Two consumer warpgroups of 64 weight rows each plus one producer warp:
// - Producer (one thread): per 128-k block, one TMA box of the weights [128 rows x 128 k] from
//   row expert * n + row tile of the map over all experts' rows [n_experts * n, k] (rows past
//   the expert's n belong to the next expert, or read as zeros past the tensor: never stored)
//   and the item's activation box [N entries x 128 k] (e4m3, or bf16 as two [N x 64 k] boxes;
//   entries past the item's count belong to the next item: their columns are never stored) into
//   a ring of `stages` shared-memory stages; full[s] completes when both landed, empty[s] when
//   the 8 consumer warps are done with it.
// - Consumers: per 128-k block, FP8: 4 wgmma m64nNk32 e4m3 into a block partial p; W8A16: the
//   e4m3 weights converted exactly to bf16 (in registers for N = 64, fp8_gemm_wgmma's register
//   A fragments; through a per-warpgroup shared-memory copy for N = 128), then 8 bf16 wgmma
//   m64nNk16. Wait, release the stage, fold acc += p * (w_scale[expert, row block, kb] (*
//   xsg[kb, entry])) in fp32 in ascending kb: the CPU reference's per-block scaling.
// - Epilogue: out[entry_pick[entry], row] = bf16(acc * pick weight) for the item's entries and
//   rows < n only. No k splits (prefill has blocks enough), no atomics: equal inputs, equal bits.
// - multicast_activations (an even number of row tiles): the blocks of row tiles 2j, 2j + 1 (the
//   same item) run as a cluster of two; each loads half of every activation box by TMA multicast
//   into both, so an item's rows are read from L2 once per 256 weight rows; a stage is released
//   to the producers once the consumers of both blocks are done with it (fp8_gemm_wgmma's
//   multicast_activations, the same bits as without).
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/fp8_gemm_wgmma_parts.cuh"
#include "kernels/cuda/hopper_wgmma.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_grouping.cuh"
#include "kernels/cuda/tensor_map.cuh"
#include "kernels/cuda/wgmma_e4m3.cuh"
#include "kernels/env_switch.h"

namespace pdserve::kernels::cuda {
namespace {

using namespace fp8_wgmma;  // NOLINT(build/namespaces): the dense kernel's pieces
namespace bs = block_scaled;

constexpr int kWarpgroups = 2;  // consumer warpgroups, 64 weight rows each
constexpr int kRowTile = 64 * kWarpgroups;
constexpr int kThreads = 128 * kWarpgroups + 32;
constexpr int kMaxItems = 65535;  // grid.y
constexpr int kSmallTile = 64;
constexpr int kLargeTile = 128;
constexpr int kDefaultStages = 4;

struct MoeWgmmaArgs {
  const float* w_scale;  // [n_experts, ceil(n / 128), k / 128]
  const float* xs;       // FP8: [k / 128, picks], the grouped entries' activation scales
  const bs::WorkItem* items;
  const int32_t* n_items;
  const int32_t* entry_pick;
  const float* row_weight;  // [picks] or nullptr (= 1)
  int64_t picks;
  int64_t n;
  int64_t k;
  int32_t stages;
  int32_t multicast;  // clusters of row tiles 2j, 2j + 1 share the item's activation boxes
  __nv_bfloat16* out;
  int64_t out_stride;
};

// dst row i = src row entry_pick[i] / x_row_div for i < *n_entries (row_bytes each, 16-byte
// vectors); with xs (FP8) also xsg[b, i] = xs[b, that row] for the kblocks scale blocks. One block
// per entry (blocks past the count exit).
__global__ void __launch_bounds__(128)
    GatherRowsKernel(const uint8_t* src, int64_t src_stride_bytes, int64_t row_bytes,
                     const float* xs, int64_t x_rows, int64_t kblocks, const int32_t* entry_pick,
                     const int32_t* n_entries, int32_t x_row_div, uint8_t* dst, float* xsg,
                     int64_t picks) {
  bs::GridDependencyTrigger();
  bs::GridDependencyWait();  // entry_pick from the grouping kernel, xq / xs from the act quant
  const int64_t entry = blockIdx.x;
  if (entry >= *n_entries) return;
  const int64_t row = entry_pick[entry] / x_row_div;
  const uint4* from = reinterpret_cast<const uint4*>(src + row * src_stride_bytes);
  uint4* to = reinterpret_cast<uint4*>(dst + entry * row_bytes);
  for (int64_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) to[i] = from[i];
  if (xs != nullptr) {
    for (int64_t b = threadIdx.x; b < kblocks; b += blockDim.x) {
      xsg[b * picks + entry] = xs[b * x_rows + row];
    }
  }
}

template <int N, bool A16>
__global__ void __launch_bounds__(kThreads, 1)
    MoeWgmmaKernel(const __grid_constant__ CUtensorMap w_map,
                   const __grid_constant__ CUtensorMap x_map, const MoeWgmmaArgs a) {
  extern __shared__ uint8_t smem_raw[];
  bs::GridDependencyWait();  // the items, entry_pick and the grouped rows
  bs::GridDependencyTrigger();
  if (static_cast<int32_t>(blockIdx.y) >= *a.n_items) return;
  const bs::WorkItem item = a.items[blockIdx.y];
  constexpr bool kConvert = A16 && N > kRegWeightTokens;  // W8A16 through shared memory
  constexpr uint32_t kBoxBytes = N * 128;                 // one activation box
  constexpr uint32_t kWeightBytes = kRowTile * kBlockK;
  constexpr uint32_t kStageBytes = StageBytes(kWarpgroups, N, A16);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const uint32_t base = (SharedAddress(smem_raw) + 1023u) & ~1023u;
  uint8_t* const smem = smem_raw + (base - SharedAddress(smem_raw));  // generic, 1024-aligned
  const int stages = a.stages;
  const uint32_t conv_offset = stages * kStageBytes;  // kConvert: per-warpgroup bf16 weights
  const uint32_t full_bar = base + conv_offset + (kConvert ? kWarpgroups * kConvBytes : 0u);
  const uint32_t empty_bar = full_bar + 8u * stages;
  const int kblocks = static_cast<int>(a.k / kBlockK);
  const int64_t row0 = int64_t{blockIdx.x} * kRowTile;  // in the expert's n rows
  // multicast: this block loads half `rank` of each activation box into both blocks of the
  // cluster (the same item: the same blockIdx.y), so a stage is free once both blocks' consumers
  // are done with it.
  const bool multicast = a.multicast != 0;
  const uint32_t rank = multicast ? ClusterRank() : 0u;

  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      MbarrierInit(full_bar + 8u * s, 1);
      MbarrierInit(empty_bar + 8u * s, 4 * kWarpgroups * (multicast ? 2 : 1));
    }
    FenceBarrierInit();  // the initialized barriers are visible to the TMA unit
    FenceProxyAsync();
  }
  __syncthreads();
  if (multicast) {  // the other block's barriers are initialized before any copy into it
    ClusterArrive();
    ClusterWait();
  }

  if (warp == 4 * kWarpgroups) {  // producer
    if (lane == 0) {
      PrefetchTensorMap(&w_map);
      PrefetchTensorMap(&x_map);
      const auto w_row = static_cast<int32_t>(item.expert * a.n + row0);
      // (A half wholly past the rows loads from the last row on: its columns are past the
      // item's count, never stored.)
      const uint32_t x_dst = kWeightBytes + rank * (N / 2) * 128u;
      const auto x_row = static_cast<int32_t>(
          min(int64_t{item.first} + (multicast ? rank * (N / 2) : 0u), a.picks - 1));
      const auto x_mask = static_cast<uint16_t>(multicast ? 3u : 0u);
      for (int kb = 0; kb < kblocks; ++kb) {
        const int s = kb % stages;
        const uint32_t stage = base + s * kStageBytes;
        if (kb >= stages) {
          MbarrierWait(empty_bar + 8u * s, static_cast<uint32_t>((kb / stages - 1) & 1));
        }
        MbarrierArriveExpectTx(full_bar + 8u * s, kStageBytes);
        TmaLoad2d(stage, &w_map, kb * kBlockK, w_row, full_bar + 8u * s);
        LoadActivations<A16>(&x_map, stage + x_dst, kb * kBlockK, x_row, full_bar + 8u * s,
                             kBoxBytes, x_mask);
      }
    }
    if (multicast) {  // no block leaves while the other may still copy or arrive into it
      ClusterArrive();
      ClusterWait();
    }
    return;
  }

  // Consumer warpgroup wg: weight rows row0 + 64 wg .. + 63 (one 128-row scale block; past n:
  // computed, never stored), the item's entries as the N columns.
  const int wg = warp / 4;
  const int t = lane % 4;
  const int64_t scale_rows = (a.n + kBlockK - 1) / kBlockK;
  const float* w_scale =
      a.w_scale + (item.expert * scale_rows + min(row0 + 64 * wg, a.n - 1) / kBlockK) * kblocks;
  float acc[N / 2];
  float p[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = p[i] = 0.0f;
  for (int kb = 0; kb < kblocks; ++kb) {
    const int s = kb % stages;
    const uint32_t stage = base + s * kStageBytes;
    const float ws = __ldg(w_scale + kb);
    MbarrierWait(full_bar + 8u * s, static_cast<uint32_t>((kb / stages) & 1));
    __syncwarp();  // wgmma is .sync.aligned: the warp converged after its spin
    if constexpr (!A16) {
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 32; ++kk) {
        WgmmaE4m3<N>(p, SmemDescriptor(stage + wg * 64 * kBlockK + kk * 32, 16, 1024),
                     SmemDescriptor(stage + kWeightBytes + kk * 32, 16, 1024), kk);
      }
    } else if constexpr (!kConvert) {
      RegisterA afrag;
      ProductsRegisterWeights<N>(p, afrag, smem + s * kStageBytes + wg * 64 * kBlockK,
                                 stage + kWeightBytes, kBoxBytes, warp % 4, lane);
    } else {
      const uint32_t conv = conv_offset + wg * kConvBytes;
      ProductsConvertedWeights<N>(p, smem + s * kStageBytes + wg * 64 * kBlockK, smem + conv,
                                  base + conv, stage + kWeightBytes, kBoxBytes, wg);
    }
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegisters(p);
    __syncwarp();
    if (lane == 0) {
      MbarrierArrive(empty_bar + 8u * s);
      if (multicast) MbarrierArriveInCluster(empty_bar + 8u * s, rank ^ 1u);
    }
    if constexpr (A16) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc[i] += p[i] * ws;
    } else {
      // The scales of this thread's columns 8j + 2t (+ 1), clamped to the item's last entry.
      const float* xs = a.xs + int64_t{kb} * a.picks + item.first;
      const int last = item.count - 1;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
        const float s0 = ws * __ldg(xs + min(8 * j + 2 * t, last));
        const float s1 = ws * __ldg(xs + min(8 * j + 2 * t + 1, last));
        acc[4 * j + 0] += p[4 * j + 0] * s0;
        acc[4 * j + 1] += p[4 * j + 1] * s1;
        acc[4 * j + 2] += p[4 * j + 2] * s0;
        acc[4 * j + 3] += p[4 * j + 3] * s1;
      }
    }
  }

  // acc[4j + c]: row 16 (warp % 4) + g (+ 8 for c >= 2), column 8j + 2t + (c & 1).
  const int64_t row_base = row0 + 64 * wg + 16 * (warp % 4) + lane / 4;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = 8 * j + 2 * t + c;
      if (col >= item.count) continue;
      const int64_t pick = a.entry_pick[item.first + col];
      const float weight = a.row_weight != nullptr ? a.row_weight[pick] : 1.0f;
      __nv_bfloat16* out = a.out + pick * a.out_stride;
      if (row_base < a.n) out[row_base] = __float2bfloat16_rn(acc[4 * j + c] * weight);
      if (row_base + 8 < a.n) out[row_base + 8] = __float2bfloat16_rn(acc[4 * j + 2 + c] * weight);
    }
  }
  if (multicast) {
    ClusterArrive();
    ClusterWait();
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The workspace's sizes and layout (kernels/cuda/moe_gemm_workspace.h, shared with the memory
// plan: entry_pick | items | n_items, n_entries | FP8: xq, xs | xg | FP8: xsg), the grid and the
// shared-memory ring.
struct MoeWgmmaPlan : moe_workspace::WgmmaSizes {
  int stages = kDefaultStages;
  int64_t row_tiles = 0;
  bool multicast = false;
  size_t smem_bytes = 0;
};
static_assert(moe_workspace::kWgmmaSmallTile == kSmallTile &&
              moe_workspace::kWgmmaLargeTile == kLargeTile &&
              moe_workspace::kWgmmaMaxItems == kMaxItems && moe_workspace::kBlockK == kBlockK);

MoeWgmmaPlan PlanMoeWgmma(int64_t tokens, int64_t top_k, int64_t x_rows, const ExpertWeights& w,
                          const MoeWgmmaConfig& config) {
  MoeWgmmaPlan p;
  const bool a16 = w.format == ExpertFormat::kFp8W8A16;
  static_cast<moe_workspace::WgmmaSizes&>(p) =
      moe_workspace::Wgmma(tokens, top_k, x_rows, w.n_experts, w.k, a16, config.token_tile);
  p.row_tiles = (w.n + kRowTile - 1) / kRowTile;
  p.multicast = config.multicast_activations && p.row_tiles % 2 == 0;
  const uint32_t stage_bytes = StageBytes(kWarpgroups, p.n_tile, a16);
  const uint32_t conv_bytes = a16 && p.n_tile > kRegWeightTokens ? kWarpgroups * kConvBytes : 0u;
  const int fit = static_cast<int>((kSmemLimit - kSmemSlack - conv_bytes) / (stage_bytes + 16));
  const int stages = config.stages != 0 ? config.stages : kDefaultStages;
  p.stages = std::clamp(std::min(stages, fit), 2, kMaxStages);
  p.smem_bytes = static_cast<size_t>(p.stages) * (stage_bytes + 16) + conv_bytes + kSmemSlack;
  return p;
}

// PDSERVE_MOE_WGMMA's text: "token_tile,stages[,multicast]" (token_tile 0, kSmallTile or
// kLargeTile; stages 0 or 2..kMaxStages; multicast 0 or 1, missing: 0); nullopt for anything else.
std::optional<MoeWgmmaConfig> ParseMoeWgmmaConfig(std::string_view text) {
  const std::optional<std::vector<int64_t>> fields = ParseWholeNumbers(text, 2, 3);
  if (!fields) return std::nullopt;
  const std::vector<int64_t>& f = *fields;
  const int64_t multicast = f.size() == 3 ? f[2] : 0;
  if ((f[0] != 0 && f[0] != kSmallTile && f[0] != kLargeTile) ||
      (f[1] != 0 && (f[1] < 2 || f[1] > kMaxStages)) || (multicast != 0 && multicast != 1)) {
    return std::nullopt;
  }
  MoeWgmmaConfig c;
  c.token_tile = static_cast<int>(f[0]);
  c.stages = static_cast<int>(f[1]);
  c.multicast_activations = multicast == 1;
  return c;
}

// The sizes moe_grouped_gemm takes, plus the warpgroup path's own limits.
cudaError_t ValidateWgmmaSizes(int64_t tokens, int64_t top_k, int64_t x_rows,
                               const ExpertWeights& w, std::string* refusal) {
  const cudaError_t status = moe_gemm_internal::ValidateSizes(tokens, top_k, x_rows, w, refusal);
  if (status != cudaSuccess) return status;
  if (w.format != ExpertFormat::kFp8 && w.format != ExpertFormat::kFp8W8A16) {
    return bs::Refuse(refusal, "weights.format: FP4 experts take the mma.sync path only");
  }
  if (w.n_experts * w.n >= (int64_t{1} << 31) || w.k >= (int64_t{1} << 31)) {
    return bs::Refuse(refusal, "weights: n_experts * n or k 2^31 or more (TMA coordinates)");
  }
  const int64_t picks = tokens * top_k;
  if (std::min(w.n_experts, picks) + picks / kSmallTile > kMaxItems) {
    return bs::Refuse(refusal, "tokens * top_k: more work items than a grid holds (65535)");
  }
  return cudaSuccess;
}

template <int N, bool A16>
cudaError_t LaunchMoeKernel(const CUtensorMap& w_map, const CUtensorMap& x_map,
                            const MoeWgmmaArgs& a, const MoeWgmmaPlan& p, cudaStream_t stream) {
  const cudaError_t attribute =
      SetMaxDynamicSharedMemory(reinterpret_cast<const void*>(MoeWgmmaKernel<N, A16>), kSmemLimit);
  if (attribute != cudaSuccess) return attribute;
  const dim3 grid(static_cast<unsigned>(p.row_tiles), static_cast<unsigned>(p.max_items));
  return bs::LaunchClustered(MoeWgmmaKernel<N, A16>, grid, dim3(kThreads), p.smem_bytes,
                             dim3(p.multicast ? 2 : 1, 1, 1), stream, w_map, x_map, a);
}

cudaError_t LaunchMoeWgmma(const CUtensorMap& w_map, const CUtensorMap& x_map,
                           const MoeWgmmaArgs& a, const MoeWgmmaPlan& p, bool a16,
                           cudaStream_t stream) {
  if (p.n_tile == kLargeTile) {
    return a16 ? LaunchMoeKernel<kLargeTile, true>(w_map, x_map, a, p, stream)
               : LaunchMoeKernel<kLargeTile, false>(w_map, x_map, a, p, stream);
  }
  return a16 ? LaunchMoeKernel<kSmallTile, true>(w_map, x_map, a, p, stream)
             : LaunchMoeKernel<kSmallTile, false>(w_map, x_map, a, p, stream);
}

}  // namespace

MoeWgmmaConfig moe_grouped_gemm_wgmma_default_config() {
  static const MoeWgmmaConfig config = ReadSwitchWith(
      "PDSERVE_MOE_WGMMA", ParseMoeWgmmaConfig, MoeWgmmaConfig{},
      "token_tile (0, " + std::to_string(kSmallTile) + " or " + std::to_string(kLargeTile) +
          "),stages (0 or 2-" + std::to_string(kMaxStages) + ")[,multicast 0 or 1]",
      "the default config");
  return config;
}

size_t moe_grouped_gemm_wgmma_workspace_bytes(int64_t tokens, int64_t top_k, int64_t x_rows,
                                              const ExpertWeights& weights,
                                              const MoeWgmmaConfig& config) {
  if (x_rows < 0 || ValidateWgmmaSizes(tokens, top_k, x_rows, weights, nullptr) != cudaSuccess) {
    return 0;
  }
  return PlanMoeWgmma(tokens, top_k, x_rows, weights, config).total();
}

cudaError_t moe_grouped_gemm_wgmma(const __nv_bfloat16* x, int64_t x_stride, bool x_per_pick,
                                   const int32_t* experts, const float* pick_weights,
                                   int64_t tokens, int64_t top_k, const ExpertWeights& weights,
                                   bool ue8m0_act_scale, __nv_bfloat16* out, int64_t out_stride,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                   const MoeWgmmaConfig& config, std::string* refusal) {
  const int64_t x_rows = x_per_pick ? tokens * top_k : tokens;
  cudaError_t status = ValidateWgmmaSizes(tokens, top_k, x_rows, weights, refusal);
  if (status != cudaSuccess || tokens == 0) return status;
  status =
      moe_gemm_internal::ValidatePointers(x, x_stride, experts, weights, out, out_stride, refusal);
  if (status != cudaSuccess) return status;
  const MoeWgmmaPlan plan = PlanMoeWgmma(tokens, top_k, x_rows, weights, config);
  status = fp8_gemm_internal::CheckWorkspace(workspace, workspace_bytes, plan.total(), refusal);
  if (status != cudaSuccess) return status;
  const bool a16 = weights.format == ExpertFormat::kFp8W8A16;
  const int64_t picks = tokens * top_k;
  uint8_t* p = static_cast<uint8_t*>(workspace);
  int32_t* entry_pick = reinterpret_cast<int32_t*>(p);
  p += plan.entry_bytes;
  bs::WorkItem* items = reinterpret_cast<bs::WorkItem*>(p);
  p += plan.item_bytes;
  int32_t* counts = reinterpret_cast<int32_t*>(p);  // n_items, n_entries
  p += plan.count_bytes;
  uint8_t* xq = p;
  p += plan.xq_bytes;
  float* xs = reinterpret_cast<float*>(p);
  p += plan.xs_bytes;
  uint8_t* xg = p;
  p += plan.xg_bytes;
  float* xsg = reinterpret_cast<float*>(p);

  CUtensorMap w_map;
  CUtensorMap x_map;
  if (!EncodeGemmMap(&w_map, weights.w, weights.n_experts * weights.n, weights.k, weights.k,
                     kRowTile, false) ||
      !EncodeGemmMap(&x_map, xg, picks, weights.k, weights.k,
                     plan.multicast ? plan.n_tile / 2 : plan.n_tile, a16)) {
    if (refusal != nullptr) *refusal = "cuTensorMapEncodeTiled failed (driver too old?)";
    return cudaErrorNotSupported;
  }
  status = bs::LaunchDependent(
      moe_grouping::GroupPicksKernel, dim3(1), dim3(moe_grouping::kGroupThreads), stream, experts,
      static_cast<int32_t>(picks), static_cast<int32_t>(weights.n_experts),
      static_cast<int32_t>(plan.n_tile), entry_pick, items, counts, counts + 1);
  if (status != cudaSuccess) return status;
  const int64_t kblocks = weights.k / kBlockK;
  if (!a16) {
    status = bs::LaunchActQuant(x, x_rows, weights.k, x_stride, ue8m0_act_scale, xq, xs, stream);
    if (status != cudaSuccess) return status;
  }
  status = bs::LaunchDependent(
      GatherRowsKernel, dim3(static_cast<unsigned>(picks)), dim3(128), stream,
      a16 ? reinterpret_cast<const uint8_t*>(x) : static_cast<const uint8_t*>(xq),
      a16 ? x_stride * 2 : weights.k, weights.k * (a16 ? 2 : 1),
      a16 ? static_cast<const float*>(nullptr) : static_cast<const float*>(xs), x_rows, kblocks,
      static_cast<const int32_t*>(entry_pick), static_cast<const int32_t*>(counts + 1),
      static_cast<int32_t>(x_per_pick ? 1 : top_k), xg, a16 ? nullptr : xsg, picks);
  if (status != cudaSuccess) return status;
  MoeWgmmaArgs a{};
  a.w_scale = weights.scale;
  a.xs = a16 ? nullptr : xsg;
  a.items = items;
  a.n_items = counts;
  a.entry_pick = entry_pick;
  a.row_weight = pick_weights;
  a.picks = picks;
  a.n = weights.n;
  a.k = weights.k;
  a.stages = plan.stages;
  a.multicast = plan.multicast ? 1 : 0;
  a.out = out;
  a.out_stride = out_stride;
  return LaunchMoeWgmma(w_map, x_map, a, plan, a16, stream);
}

}  // namespace pdserve::kernels::cuda
