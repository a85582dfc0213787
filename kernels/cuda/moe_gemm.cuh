// Grouped GEMM of DeepSeek-V4's routed experts with block-scaled FP8 or FP4 weights (the
// checkpoint's own formats kept in HBM), and the combine of the picks' outputs.
//
// Math (CPU reference kernels/cpu/fp8_gemm.h, MoeGemmReference):
//   for every pick p = token * top_k + j with a valid expert e = experts[p] (0 <= e < n_experts):
//     out[p, :] = bf16( weight[p] * xq_row . dequant(W_e)^T )
//   where xq_row is row p (x_per_pick: the input of the down projection, one row per pick) or row
//   token of x (the input of gate / up), quantized per 1 x 128 exactly as fp8_gemm does (the
//   same act-quant kernel), and dequant(W_e) is
//     FP8: e4m3(w[e, n, k]) * scale[e, n / 128, k / 128] (fp32 scales);
//     FP4: e2m1(w[e, n, k]) * 2^(scale[e, n, k / 32] - 127) (ue8m0 scales, 0xFF = NaN; the packed
//          byte holds element 2i in its low nibble, docs/checkpoints.md).
//   Picks with an invalid expert id leave their out row untouched.
//   The FP8 inner sums run on the tensor cores per 128-block, the FP4 ones per 32-group (each e2m1
//   value is converted exactly to e4m3 in registers, the group's scale applied to the fp32
//   result); the outer sums are fp32 in ascending k. Equal inputs give equal bits.
//
// Grouping (decode and prefill alike): the picks are grouped by expert on the device (counting
// sort in one block); each block then streams one 64-row tile of one routed expert's weights for
// up to 32 of its picks (8 x NT, NT <= 4 token tiles). Experts nobody picked are never read. One
// token (batch 1) skips the grouping kernel: each pick is its own work item (MoeMmaGrouping below).
// All of it is CUDA-graph safe: no host synchronization, launch shapes from the sizes only (blocks
// past the device-side count of work items exit at once).
//
// Speed (one H200, docs/perf.md, 2026-12-04, V4-Flash's 256 experts, top-6): FP8 gate+up at
// 16-64 tokens reads the routed experts at 81-82% of the read floor, 50% at 1 token, 2.0-2.6x
// faster than bf16 torch._grouped_mm at 1-64 tokens; FP4 is slower than FP8 at every size
// (instruction-bound: 24-37% of the read floor), hence FP4 experts are to become FP8 at load.
// Prefill sizes (>= 2048 tokens) are 2-7x slower than a bf16 grouped GEMM: not a prefill kernel
// (the kWgmma path below serves those).
//
// Paths (moe_grouped_gemm_path): kMma, the kernel above (every format, every size); kWgmma,
// moe_grouped_gemm_wgmma (FP8 and W8A16 experts, meant for prefill sizes): the picks grouped by
// expert as above, then their activation rows copied in that order (W8A16: bf16 rows; FP8: the
// rows quantized per token first, then the e4m3 rows and their scales), so each expert's rows are
// contiguous; one block per (128 weight rows, work item of up to 64 or 128 of one expert's
// entries) streams the expert's weights (TMA over all experts' rows [n_experts * n, k] from row
// expert * n + row tile) and the item's rows through a shared-memory ring into Hopper warpgroup
// MMA (kernels/cuda/moe_gemm_wgmma.cu has the design). Same inputs, outputs and math; the fp32
// sums are folded per 128-k block in ascending k as on the mma path (the tensor cores' order
// inside a block differs, so the two paths' bits may differ in the last place). PDSERVE_MOE_GEMM
// (read once per process): unset or "auto" (the default since 2026-12-05) takes kWgmma from
// kMoeWgmmaMinPicks routed picks (tokens * top_k) on, "mma" keeps kMma for every size, "wgmma"
// takes kWgmma for every call it supports. Measured on an H100 (docs/perf.md, 2026-12-05):
// kWgmma 2.2-2.8x faster than kMma from 2048 tokens at top-6, 0.95-1.09x at 512; one V4-Flash
// layer's 4096-token prefill in the engine 46.6 -> 37.5 ms (W8A16).
//
// Asynchronous on `stream`; no state, so concurrent calls with different outputs and workspaces
// are safe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/moe_gemm_workspace.h"

namespace pdserve::kernels::cuda {

// kFp8W8A16: FP8 weights as kFp8, activations kept bf16 (not quantized; ue8m0_act_scale ignored),
// each e4m3 weight converted exactly to bf16 in registers, bf16 tensor cores (fp8_gemm.cuh's
// fp8_gemm_w8a16; CPU reference: ExpertWeightsRef::bf16_activations).
enum class ExpertFormat { kFp8, kFp4, kFp8W8A16 };

// Routed experts' weights of one projection, all experts stacked.
//   kFp8, kFp8W8A16: w [n_experts, n, k] e4m3; scale [n_experts, ceil(n / 128), k / 128] fp32.
//   kFp4: w [n_experts, n, k / 2] packed e2m1; scale_e8m0 [n_experts, n, k / 32] ue8m0 bytes.
struct ExpertWeights {
  ExpertFormat format = ExpertFormat::kFp8;
  const uint8_t* w = nullptr;
  const float* scale = nullptr;
  const uint8_t* scale_e8m0 = nullptr;
  int64_t n_experts = 0;
  int64_t n = 0;
  int64_t k = 0;
};

// Bytes of device workspace moe_grouped_gemm needs for `tokens` x `top_k` picks and x_rows rows of
// input (the most either path needs where moe_grouped_gemm_path may be kWgmma); 0 for sizes
// moe_grouped_gemm refuses. Host only.
size_t moe_grouped_gemm_workspace_bytes(int64_t tokens, int64_t top_k, int64_t x_rows,
                                        const ExpertWeights& weights);

// How the mma.sync path finds each block's expert. kGroupPicks: a grouping kernel lists the picks
// expert by expert first (a work item per up to 8 x NT picks of one expert). kAuto: the same,
// except for one token (V4-Flash's batch 1), whose picks go to the GEMM directly (one item per
// pick, its expert read from `experts` by the GEMM's blocks): one kernel less before the GEMM. A
// token that picks one expert twice reads its weights twice there. PDSERVE_MOE_DIRECT
// (docs/engine-gpu.md, "Environment switches"): "group" makes kAuto group as well.
// kReuse: no grouping kernel; the workspace already holds the grouping of the same picks (equal
// `experts` contents, tokens, top_k, n_experts and expert format), written by the call before on
// this stream with this workspace (the routed experts' down projection after their gate+up,
// whatever their n and k: the grouping's place in the workspace depends on the picks alone,
// moe_gemm_workspace.h); one token, or
// sizes that may take the warpgroup-MMA path (PDSERVE_MOE_GEMM=wgmma, or kMoeWgmmaMinPicks picks
// or more, through moe_grouped_gemm), as kAuto. A call that ran in between on that workspace, or
// other picks, give wrong sums: the caller's promise, not checked.
// kIdentity: every token picks every expert in order (top_k == n_experts, pick t * top_k + j is
// expert j, as V4's grouped o_a projection's groups); `experts` must say so (the warpgroup-MMA
// path, which ignores kIdentity, routes by it, and the split-K reduce skips invalid ids). No grouping kernel and no items: each block finds its expert and tokens from
// its index, so it issues its first weight loads before waiting for the kernel before, as a dense
// GEMM does. Refused (cudaErrorInvalidValue) when top_k != n_experts.
// All of them give the same bits for the same picks: an entry's sums do not depend on the other
// entries of its item, and the k splits are the plan's in every mode.
enum class MoeMmaGrouping { kAuto, kGroupPicks, kReuse, kIdentity };

// out[p, :] for every valid pick, as above.
//   x [x_rows, x_stride] bf16: x_rows = tokens (x_per_pick false) or tokens * top_k (true).
//   experts [tokens, top_k] int32 (moe_route's output); pick_weights [tokens, top_k] fp32 or
//   nullptr (= 1: gate / up); out [tokens * top_k, out_stride] bf16.
//   ue8m0_act_scale: round the activation scales up to powers of two (DeepSeek's scale_fmt).
// Requires tokens >= 0, 1 <= top_k <= 32, tokens * top_k < 2^31, 1 <= n_experts <= 1024,
// 1 <= n <= 4194240, k > 0 a multiple of 128, x_stride >= k and a multiple of 8, out_stride >= n,
// 16-byte aligned x, w and out, scales present for the format, workspace 256-byte aligned with
// at least moe_grouped_gemm_workspace_bytes bytes. tokens of 0 writes nothing. Returns
// cudaErrorInvalidValue on bad arguments, with `refusal` (when given) naming the argument and the
// check that failed, else the launch status. `grouping`: the mma.sync path's (MoeMmaGrouping;
// the warpgroup-MMA path groups the picks itself whatever it says).
cudaError_t moe_grouped_gemm(const __nv_bfloat16* x, int64_t x_stride, bool x_per_pick,
                             const int32_t* experts, const float* pick_weights, int64_t tokens,
                             int64_t top_k, const ExpertWeights& weights, bool ue8m0_act_scale,
                             __nv_bfloat16* out, int64_t out_stride, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream,
                             std::string* refusal = nullptr,
                             MoeMmaGrouping grouping = MoeMmaGrouping::kAuto);

enum class MoeGemmPath { kMma, kWgmma };
// PDSERVE_MOE_GEMM=auto (the default): kWgmma from this many picks (tokens * top_k) on (1366
// tokens at top-6; gemm_bench moe_prefill on an H100: at 512 tokens the two paths are within
// 0.95-1.09x of each other, from 2048 kWgmma is 2.2-2.8x faster).
inline constexpr int64_t kMoeWgmmaMinPicks = moe_workspace::kMoeWgmmaMinPicks;
// The path moe_grouped_gemm takes for these sizes (PDSERVE_MOE_GEMM as above; kMma for FP4
// experts and for sizes moe_grouped_gemm_wgmma refuses). Host only.
MoeGemmPath moe_grouped_gemm_path(int64_t tokens, int64_t top_k, const ExpertWeights& weights);

// The mma.sync path alone: moe_grouped_gemm's contract; workspace
// moe_grouped_gemm_mma_workspace_bytes (at most moe_grouped_gemm_workspace_bytes).
size_t moe_grouped_gemm_mma_workspace_bytes(int64_t tokens, int64_t top_k, int64_t x_rows,
                                            const ExpertWeights& weights);
cudaError_t moe_grouped_gemm_mma(const __nv_bfloat16* x, int64_t x_stride, bool x_per_pick,
                                 const int32_t* experts, const float* pick_weights, int64_t tokens,
                                 int64_t top_k, const ExpertWeights& weights, bool ue8m0_act_scale,
                                 __nv_bfloat16* out, int64_t out_stride, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream,
                                 std::string* refusal = nullptr,
                                 MoeMmaGrouping grouping = MoeMmaGrouping::kAuto);

// The warpgroup-MMA path's tile: token_tile entries per work item (0: 128 when the routed experts
// average more than 64 picks, else 64; or 64 / 128), stages: shared-memory ring depth (0: 4, or
// 2..8; fewer when they do not fit), multicast_activations: the blocks of two neighbouring
// 128-row tiles (same work item) run as a cluster and load each activation box once for both by
// TMA multicast (where n gives an even number of row tiles; the same bits).
struct MoeWgmmaConfig {
  int token_tile = 0;
  int stages = 0;
  bool multicast_activations = false;
};
// The default config, or PDSERVE_MOE_WGMMA="token_tile,stages[,multicast 0|1]" (read once per
// process; other text is warned about and ignored, kernels/env_switch.h). Host only.
MoeWgmmaConfig moe_grouped_gemm_wgmma_default_config();
// Workspace bytes of moe_grouped_gemm_wgmma (grouping, the grouped activation rows, FP8: the
// per-token quantized rows and scales too); 0 for sizes it refuses. Host only.
size_t moe_grouped_gemm_wgmma_workspace_bytes(int64_t tokens, int64_t top_k, int64_t x_rows,
                                              const ExpertWeights& weights,
                                              const MoeWgmmaConfig& config = {});
// moe_grouped_gemm's function on the Hopper warpgroup MMA (sm_90a): its requirements plus
// weights.format kFp8 or kFp8W8A16, n_experts * n < 2^31 and at most 65535 work items (tokens *
// top_k up to about 4 million). Returns cudaErrorNotSupported when the driver cannot encode the
// TMA descriptors (`refusal` says so), cudaErrorInvalidValue on bad arguments.
cudaError_t moe_grouped_gemm_wgmma(const __nv_bfloat16* x, int64_t x_stride, bool x_per_pick,
                                   const int32_t* experts, const float* pick_weights,
                                   int64_t tokens, int64_t top_k, const ExpertWeights& weights,
                                   bool ue8m0_act_scale, __nv_bfloat16* out, int64_t out_stride,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                   const MoeWgmmaConfig& config = {},
                                   std::string* refusal = nullptr);

namespace moe_gemm_internal {
// moe_grouped_gemm's argument checks (sizes, then pointers; moe_gemm.cu), shared by both paths;
// `refusal` names the failed check. x_rows: tokens or tokens * top_k.
cudaError_t ValidateSizes(int64_t tokens, int64_t top_k, int64_t x_rows, const ExpertWeights& w,
                          std::string* refusal);
cudaError_t ValidatePointers(const __nv_bfloat16* x, int64_t x_stride, const int32_t* experts,
                             const ExpertWeights& w, const __nv_bfloat16* out, int64_t out_stride,
                             std::string* refusal);
}  // namespace moe_gemm_internal

// out[t, c] += sum over j ascending of y[t * top_k + j, c] (fp32), skipping picks whose expert id
// is outside [0, n_experts) (their y rows are never read). y [tokens * top_k, y_stride] bf16
// (moe_grouped_gemm's output of the down projection, already weighted); out [tokens, out_stride]
// fp32. Requires tokens, n >= 0, 1 <= top_k <= 32, y_stride and out_stride >= n, tensors under
// 2^62 elements. Returns cudaErrorInvalidValue with `refusal` on bad arguments.
cudaError_t moe_combine(const __nv_bfloat16* y, int64_t y_stride, const int32_t* experts,
                        int64_t tokens, int64_t top_k, int64_t n_experts, int64_t n, float* out,
                        int64_t out_stride, cudaStream_t stream, std::string* refusal = nullptr);

}  // namespace pdserve::kernels::cuda
