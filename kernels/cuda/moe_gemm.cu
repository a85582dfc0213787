#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/cuda/block_scaled_mma.cuh"
#include "kernels/cuda/fp8_gemm.cuh"
#include "kernels/cuda/moe_gemm.cuh"
#include "kernels/cuda/moe_grouping.cuh"
#include "kernels/env_switch.h"

namespace pdserve::kernels::cuda {
namespace {

namespace bs = block_scaled;

using moe_grouping::GroupPicksKernel;
using moe_grouping::kGroupThreads;
using moe_grouping::kMaxExperts;
constexpr int64_t kMaxTopK = 32;

__global__ void CombineKernel(const __nv_bfloat16* y, int64_t y_stride, const int32_t* experts,
                              int64_t tokens, int32_t top_k, int64_t n_experts, int64_t n,
                              float* out, int64_t out_stride) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < tokens * n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / n;
    const int64_t c = i % n;
    float sum = out[t * out_stride + c];
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t e = experts[t * top_k + j];
      if (e < 0 || e >= n_experts) continue;
      sum += __bfloat162float(y[(t * top_k + j) * y_stride + c]);
    }
    out[t * out_stride + c] = sum;
  }
}

// Sizes and workspace layout (kernels/cuda/moe_gemm_workspace.h, shared with the memory plan):
// entry_pick [picks] | items [max_items] | n_items | xq [x_rows, k] | xs [k / 128, x_rows] |
// partial [splits, picks, n].
using GroupedPlan = moe_workspace::MmaSizes;
GroupedPlan PlanGrouped(int64_t tokens, int64_t top_k, int64_t x_rows, const ExpertWeights& w) {
  return moe_workspace::Mma(tokens, top_k, x_rows, w.n_experts, w.n, w.k,
                            /*a16=*/w.format == ExpertFormat::kFp8W8A16);  // W8A16 reads x as it is
}

// PDSERVE_MOE_GEMM's choice: kAuto unless "mma" or "wgmma".
enum class PathMode { kMma, kWgmma, kAuto };
PathMode DefaultPathMode() {
  static const PathMode mode =
      ReadSwitch("PDSERVE_MOE_GEMM",
                 {{"auto", PathMode::kAuto}, {"mma", PathMode::kMma}, {"wgmma", PathMode::kWgmma}},
                 PathMode::kAuto, "the default, auto");
  return mode;
}

// PDSERVE_MOE_DIRECT's choice for MoeMmaGrouping::kAuto: direct picks for one token unless
// "group".
bool DirectPicksAllowed() {
  static const bool allowed = ReadSwitch("PDSERVE_MOE_DIRECT", {{"auto", true}, {"group", false}},
                                         true, "the default, auto");
  return allowed;
}

// MoeMmaGrouping::kReuse is taken at its word only where the call before (the same picks) surely
// ran this path and grouped them: not one token (direct picks), not sizes moe_grouped_gemm may
// send to the warpgroup-MMA path, whose grouping lies in the workspace otherwise.
bool ReuseHonoured(int64_t tokens, int64_t top_k, const ExpertWeights& w) {
  if (tokens == 1) return false;
  if (w.format == ExpertFormat::kFp4) return true;
  const PathMode mode = DefaultPathMode();
  return mode == PathMode::kMma || (mode == PathMode::kAuto && tokens * top_k < kMoeWgmmaMinPicks);
}

}  // namespace

namespace moe_gemm_internal {

cudaError_t ValidateSizes(int64_t tokens, int64_t top_k, int64_t x_rows, const ExpertWeights& w,
                          std::string* refusal) {
  const auto refuse = [&](const std::string& what) { return bs::Refuse(refusal, what); };
  if (tokens < 0) return refuse("tokens: negative (" + std::to_string(tokens) + ")");
  if (top_k < 1 || top_k > kMaxTopK) return refuse("top_k: outside [1, 32]");
  if (tokens * top_k >= (int64_t{1} << 31)) return refuse("tokens * top_k: 2^31 or more");
  if (w.n_experts < 1 || w.n_experts > kMaxExperts) {
    return refuse("weights.n_experts: outside [1, 1024]");
  }
  if (w.n < 1 || w.n > bs::kMaxN) return refuse("weights.n: outside [1, 4194240]");
  if (w.format != ExpertFormat::kFp8 && w.format != ExpertFormat::kFp4 &&
      w.format != ExpertFormat::kFp8W8A16) {
    return refuse("weights.format: unknown");
  }
  if (w.k <= 0 || w.k % bs::kBlockK != 0) {
    return refuse("weights.k: not a positive multiple of 128 (" + std::to_string(w.k) + ")");
  }
  if (!bs::ProductAtMost(w.n_experts * w.n, w.k, bs::kMaxElements)) {
    return refuse("weights.w: n_experts * n * k >= 2^62");
  }
  if (!bs::ProductAtMost(x_rows, w.k, bs::kMaxElements) ||
      !bs::ProductAtMost(16 * tokens * top_k, w.n, bs::kMaxElements)) {
    return refuse("x / out: elements >= 2^62");
  }
  return cudaSuccess;
}

cudaError_t ValidatePointers(const __nv_bfloat16* x, int64_t x_stride, const int32_t* experts,
                             const ExpertWeights& w, const __nv_bfloat16* out, int64_t out_stride,
                             std::string* refusal) {
  const auto refuse = [&](const std::string& what) { return bs::Refuse(refusal, what); };
  if (x_stride < w.k || x_stride % 8 != 0) {
    return refuse("x_stride: below k or not a multiple of 8 (" + std::to_string(x_stride) + ")");
  }
  if (out_stride < w.n) return refuse("out_stride: below n (" + std::to_string(out_stride) + ")");
  if (x == nullptr || !bs::Aligned(x, 16)) return refuse("x: null or not 16-byte aligned");
  if (experts == nullptr) return refuse("experts: null");
  if (w.w == nullptr || !bs::Aligned(w.w, 16)) {
    return refuse("weights.w: null or not 16-byte aligned");
  }
  if (w.format != ExpertFormat::kFp4 && (w.scale == nullptr || !bs::Aligned(w.scale, 4))) {
    return refuse("weights.scale: null or not 4-byte aligned (FP8 experts)");
  }
  if (w.format == ExpertFormat::kFp4 &&
      (w.scale_e8m0 == nullptr || !bs::Aligned(w.scale_e8m0, 4))) {
    return refuse("weights.scale_e8m0: null or not 4-byte aligned (FP4 experts)");
  }
  if (out == nullptr || !bs::Aligned(out, 16)) return refuse("out: null or not 16-byte aligned");
  return cudaSuccess;
}

}  // namespace moe_gemm_internal

using moe_gemm_internal::ValidatePointers;
using moe_gemm_internal::ValidateSizes;

MoeGemmPath moe_grouped_gemm_path(int64_t tokens, int64_t top_k, const ExpertWeights& weights) {
  const PathMode mode = DefaultPathMode();
  if (mode == PathMode::kMma || weights.format == ExpertFormat::kFp4) return MoeGemmPath::kMma;
  if (mode == PathMode::kAuto && tokens * top_k < kMoeWgmmaMinPicks) return MoeGemmPath::kMma;
  // (x_rows as the down projection's: the larger of the two forms, the same support.)
  return moe_grouped_gemm_wgmma_workspace_bytes(tokens, top_k, tokens * top_k, weights) > 0
             ? MoeGemmPath::kWgmma
             : MoeGemmPath::kMma;
}

size_t moe_grouped_gemm_mma_workspace_bytes(int64_t tokens, int64_t top_k, int64_t x_rows,
                                            const ExpertWeights& weights) {
  if (x_rows < 0 || ValidateSizes(tokens, top_k, x_rows, weights, nullptr) != cudaSuccess) {
    return 0;
  }
  return PlanGrouped(tokens, top_k, x_rows, weights).total();
}

size_t moe_grouped_gemm_workspace_bytes(int64_t tokens, int64_t top_k, int64_t x_rows,
                                        const ExpertWeights& weights) {
  const size_t mma = moe_grouped_gemm_mma_workspace_bytes(tokens, top_k, x_rows, weights);
  if (mma == 0 || moe_grouped_gemm_path(tokens, top_k, weights) == MoeGemmPath::kMma) return mma;
  return std::max(mma,
                  moe_grouped_gemm_wgmma_workspace_bytes(tokens, top_k, x_rows, weights,
                                                         moe_grouped_gemm_wgmma_default_config()));
}

cudaError_t moe_grouped_gemm(const __nv_bfloat16* x, int64_t x_stride, bool x_per_pick,
                             const int32_t* experts, const float* pick_weights, int64_t tokens,
                             int64_t top_k, const ExpertWeights& weights, bool ue8m0_act_scale,
                             __nv_bfloat16* out, int64_t out_stride, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream, std::string* refusal,
                             MoeMmaGrouping grouping) {
  // Refused whichever path the sizes take (the warpgroup-MMA path would ignore it).
  if (grouping == MoeMmaGrouping::kIdentity && top_k != weights.n_experts) {
    return bs::Refuse(refusal, "grouping: kIdentity needs top_k == weights.n_experts");
  }
  if (tokens > 0 && moe_grouped_gemm_path(tokens, top_k, weights) == MoeGemmPath::kWgmma) {
    const cudaError_t status = moe_grouped_gemm_wgmma(
        x, x_stride, x_per_pick, experts, pick_weights, tokens, top_k, weights, ue8m0_act_scale,
        out, out_stride, workspace, workspace_bytes, stream,
        moe_grouped_gemm_wgmma_default_config(), refusal);
    if (status != cudaErrorNotSupported) return status;  // no TMA descriptors: the mma.sync path
  }
  return moe_grouped_gemm_mma(x, x_stride, x_per_pick, experts, pick_weights, tokens, top_k,
                              weights, ue8m0_act_scale, out, out_stride, workspace, workspace_bytes,
                              stream, refusal, grouping);
}

cudaError_t moe_grouped_gemm_mma(const __nv_bfloat16* x, int64_t x_stride, bool x_per_pick,
                                 const int32_t* experts, const float* pick_weights, int64_t tokens,
                                 int64_t top_k, const ExpertWeights& weights, bool ue8m0_act_scale,
                                 __nv_bfloat16* out, int64_t out_stride, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream, std::string* refusal,
                                 MoeMmaGrouping grouping) {
  const int64_t x_rows = x_per_pick ? tokens * top_k : tokens;
  cudaError_t status = ValidateSizes(tokens, top_k, x_rows, weights, refusal);
  if (status != cudaSuccess || tokens == 0) return status;
  status = ValidatePointers(x, x_stride, experts, weights, out, out_stride, refusal);
  if (status != cudaSuccess) return status;
  const GroupedPlan plan = PlanGrouped(tokens, top_k, x_rows, weights);
  status = fp8_gemm_internal::CheckWorkspace(workspace, workspace_bytes, plan.total(), refusal);
  if (status != cudaSuccess) return status;
  uint8_t* p = static_cast<uint8_t*>(workspace);
  int32_t* entry_pick = reinterpret_cast<int32_t*>(p);
  p += plan.entry_bytes;
  bs::WorkItem* items = reinterpret_cast<bs::WorkItem*>(p);
  p += plan.item_bytes;
  int32_t* n_items = reinterpret_cast<int32_t*>(p);
  p += plan.count_bytes;
  uint8_t* xq = p;
  p += plan.xq_bytes;
  float* xs = reinterpret_cast<float*>(p);
  p += plan.xs_bytes;
  float* partial = reinterpret_cast<float*>(p);

  const int64_t picks = tokens * top_k;
  // MoeMmaGrouping: identity routing, the previous call's grouping, one token's picks directly,
  // else the grouping kernel.
  const bool identity = grouping == MoeMmaGrouping::kIdentity;
  if (identity && top_k != weights.n_experts) {
    return bs::Refuse(refusal, "grouping: kIdentity needs top_k == weights.n_experts");
  }
  const bool reuse = grouping == MoeMmaGrouping::kReuse && ReuseHonoured(tokens, top_k, weights);
  const bool direct = !identity && !reuse && tokens == 1 &&
                      grouping != MoeMmaGrouping::kGroupPicks && DirectPicksAllowed();
  if (!identity && !reuse && !direct) {
    // Programmatic launch: resident when the kernel before ends, and it waits for it first.
    status =
        bs::LaunchDependent(GroupPicksKernel, dim3(1), dim3(kGroupThreads), stream, experts,
                            static_cast<int32_t>(picks), static_cast<int32_t>(weights.n_experts),
                            static_cast<int32_t>(8 * plan.tiles), entry_pick, items, n_items,
                            static_cast<int32_t*>(nullptr));
    if (status != cudaSuccess) return status;
  }
  const bool a16 = weights.format == ExpertFormat::kFp8W8A16;
  if (!a16) {
    status = bs::LaunchActQuant(x, x_rows, weights.k, x_stride, ue8m0_act_scale, xq, xs, stream);
    if (status != cudaSuccess) return status;
  }
  bs::GemmArgs a{};
  a.w = weights.w;
  a.w_scale = weights.scale;
  a.w_scale8 = weights.scale_e8m0;
  a.xq = xq;
  a.xs = xs;
  a.xb = x;
  a.xb_stride = x_stride;
  a.x_rows = x_rows;
  a.n = weights.n;
  a.k = weights.k;
  if (direct) {
    a.pick_experts = experts;
    a.n_experts = static_cast<int32_t>(weights.n_experts);
  } else if (identity) {
    a.identity_tokens = static_cast<int32_t>(tokens);
    a.n_experts = static_cast<int32_t>(weights.n_experts);
  } else {
    a.items = items;
    a.n_items = n_items;
    a.entry_pick = entry_pick;
  }
  a.x_row_div = x_per_pick ? 1 : static_cast<int32_t>(top_k);
  a.row_weight = pick_weights;
  a.k_splits = plan.splits;
  a.partial = partial;
  a.out_rows = picks;
  a.out = out;
  a.out_stride = out_stride;
  const int64_t chunk = 8 * int64_t{plan.tiles};
  const int64_t grid_items = direct     ? picks
                             : identity ? weights.n_experts * ((tokens + chunk - 1) / chunk)
                                        : plan.max_items;
  if (identity) {
    status = weights.format == ExpertFormat::kFp4
                 ? bs::LaunchGemmIdentity<true>(a, plan.tiles, grid_items, stream)
             : a16 ? bs::LaunchGemmIdentity<false, true>(a, plan.tiles, grid_items, stream)
                   : bs::LaunchGemmIdentity<false>(a, plan.tiles, grid_items, stream);
  } else {
    status = weights.format == ExpertFormat::kFp4
                 ? bs::LaunchGemm<true>(a, plan.tiles, grid_items, stream)
             : a16 ? bs::LaunchGemm<false, true>(a, plan.tiles, grid_items, stream)
                   : bs::LaunchGemm<false>(a, plan.tiles, grid_items, stream);
  }
  if (status != cudaSuccess || plan.splits == 1) return status;
  return bs::LaunchReduce(partial, plan.splits, picks, weights.n, pick_weights, experts,
                          static_cast<int32_t>(weights.n_experts), out, out_stride, stream);
}

cudaError_t moe_combine(const __nv_bfloat16* y, int64_t y_stride, const int32_t* experts,
                        int64_t tokens, int64_t top_k, int64_t n_experts, int64_t n, float* out,
                        int64_t out_stride, cudaStream_t stream, std::string* refusal) {
  const auto refuse = [&](const std::string& what) { return bs::Refuse(refusal, what); };
  if (tokens < 0 || n < 0) return refuse("tokens / n: negative");
  if (top_k < 1 || top_k > kMaxTopK) return refuse("top_k: outside [1, 32]");
  if (y_stride < n) return refuse("y_stride: below n");
  if (out_stride < n) return refuse("out_stride: below n");
  if (!bs::ProductAtMost(tokens * top_k, y_stride, bs::kMaxElements) ||
      !bs::ProductAtMost(tokens, out_stride, bs::kMaxElements)) {
    return refuse("y / out: elements >= 2^62");
  }
  if (tokens == 0 || n == 0) return cudaSuccess;
  if (y == nullptr) return refuse("y: null");
  if (experts == nullptr) return refuse("experts: null");
  if (out == nullptr) return refuse("out: null");
  const int64_t total = tokens * n;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(4096, (total + 255) / 256));
  CombineKernel<<<blocks, 256, 0, stream>>>(
      y, y_stride, experts, tokens, static_cast<int32_t>(top_k), n_experts, n, out, out_stride);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
