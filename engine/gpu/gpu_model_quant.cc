// GpuModelOptions::fp8_shared_act_quant: a W8A8 GEMM input quantized once, by the kernel that
// writes it (kernels/cuda/act_quant.cuh), for every FP8 projection that reads it.
#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/gpu/gpu_model_impl.h"
#include "engine/quant.h"
#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/activations.cuh"
#include "kernels/env_switch.h"
#include "spdlog/spdlog.h"

namespace pdserve::engine::gpu {
namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// e4m3 bytes and scales of [rows, k] quantized in column groups of group_cols (= k: one group).
int64_t QuantBytes(int64_t rows, int64_t k, int64_t group_cols) {
  return k / group_cols * kc::ActGroupBytes(rows, group_cols);
}
int64_t QuantScales(int64_t rows, int64_t k, int64_t group_cols) {
  return k / group_cols * kc::ActGroupScales(rows, group_cols);
}

}  // namespace

bool GpuModel::Impl::SharedActQuant(int64_t rows, int64_t k, int slot, int64_t group_cols) const {
  if (group_cols == 0) group_cols = k;
  return act_q[slot].size() > 0 && k % kc::kActQuantBlock == 0 &&
         group_cols % kc::kActQuantBlock == 0 && k % group_cols == 0 && rows <= max_rows &&
         kc::fp8_gemm_path(rows) == kc::Fp8GemmPath::kCublasLt &&
         QuantBytes(rows, k, group_cols) <= static_cast<int64_t>(act_q[slot].size()) &&
         QuantScales(rows, k, group_cols) <= static_cast<int64_t>(act_s[slot].size());
}

bool GpuModel::Impl::SharedActQuantWanted() const {
  const bool wanted =
      kernels::ReadSwitchOverride("PDSERVE_FP8_SHARED_ACT_QUANT",
                                  "the option (GpuModelOptions::fp8_shared_act_quant)")
          .value_or(options.fp8_shared_act_quant);
  return wanted && options.fp8_activations == Fp8Activations::kFp8 &&
         options.weight_format == WeightFormat::kFp8Block;
}

absl::Status GpuModel::Impl::AllocateSharedActQuant() {
  if (!SharedActQuantWanted()) return absl::OkStatus();
  spdlog::info("fp8_shared_act_quant: W8A8 inputs quantized once, in the kernels that write them");
  const ModelConfig& c = config;
  const int64_t r = max_rows;
  const int64_t heads_hd = c.num_attention_heads * c.head_dim;
  const int64_t group_in = heads_hd / std::max<int64_t>(c.o_groups, 1);
  // Slot 0: the normed hidden state, o_a's output. Slot 1: q_a's output, the shared expert's
  // SwiGLU, the attention output in o_a's column groups.
  const int64_t bytes0 = std::max(r * c.hidden_size, r * c.o_groups * c.o_lora_rank);
  const int64_t bytes1 = std::max(
      {r * c.q_lora_rank, r * c.moe_intermediate_size,
       group_in % kc::kActQuantBlock == 0 ? QuantBytes(r, heads_hd, group_in) : int64_t{0}});
  const int64_t scales1 = std::max(
      bytes1 / kc::kActQuantBlock,
      group_in % kc::kActQuantBlock == 0 ? QuantScales(r, heads_hd, group_in) : int64_t{0});
  PDSERVE_RETURN_IF_ERROR(act_q[0].Allocate(static_cast<size_t>(bytes0)));
  PDSERVE_RETURN_IF_ERROR(act_s[0].Allocate(static_cast<size_t>(bytes0 / kc::kActQuantBlock)));
  PDSERVE_RETURN_IF_ERROR(act_q[1].Allocate(static_cast<size_t>(bytes1)));
  PDSERVE_RETURN_IF_ERROR(act_s[1].Allocate(static_cast<size_t>(scales1)));
  return absl::OkStatus();
}

absl::StatusOr<QuantizedRows> GpuModel::Impl::CastForGemm(const float* x, int64_t rows, int64_t k,
                                                          int64_t x_stride, bf16* y, int slot,
                                                          int64_t group_cols) {
  if (!SharedActQuant(rows, k, slot, group_cols) || !Aligned16(x) || x_stride % 4 != 0) {
    PDSERVE_RETURN_IF_ERROR(CastRows(x, rows, k, x_stride, y));
    return QuantizedRows{};
  }
  uint8_t* rows_q = act_q[slot].get();
  float* rows_s = act_s[slot].get();
  PDSERVE_CUDA_RETURN(kc::act_quant_f32(x, rows, k, x_stride, /*ue8m0=*/false, y, k, rows_q, rows_s,
                                        kc::ActScaleLayout::kGemmSplit, stream, group_cols));
  return QuantizedRows{rows_q, rows_s, rows, k, group_cols == 0 ? k : group_cols};
}

absl::StatusOr<QuantizedRows> GpuModel::Impl::SwiGluForGemm(const float* gate_in,
                                                            const float* up_in, int64_t rows,
                                                            int64_t cols, int64_t in_stride,
                                                            float limit, float* out, bf16* y,
                                                            int slot) {
  if (!SharedActQuant(rows, cols, slot) || !Aligned16(gate_in) || !Aligned16(up_in) ||
      in_stride % 4 != 0) {
    PDSERVE_CUDA_RETURN(
        kc::clamped_swiglu(gate_in, up_in, rows, cols, in_stride, limit, out, cols, stream));
    PDSERVE_RETURN_IF_ERROR(Cast(out, rows * cols, y));
    return QuantizedRows{};
  }
  uint8_t* rows_q = act_q[slot].get();
  float* rows_s = act_s[slot].get();
  PDSERVE_CUDA_RETURN(kc::clamped_swiglu_act_quant(gate_in, up_in, rows, cols, in_stride, limit,
                                                   /*ue8m0=*/false, y, cols, rows_q, rows_s,
                                                   kc::ActScaleLayout::kGemmSplit, stream));
  return QuantizedRows{rows_q, rows_s, rows, cols, cols};
}

absl::Status GpuModel::Impl::Fp8GemmQuantized(const uint8_t* rows_q, const float* rows_s,
                                              int64_t rows, int64_t k, const uint8_t* w,
                                              const float* w_scale, int64_t n, float* out,
                                              int64_t out_stride) {
  std::string refusal;
  const cudaError_t e =
      kc::fp8_gemm_quantized(rows_q, rows_s, rows, k, w, w_scale, n, out, out_stride,
                             fp8_workspace.get(), fp8_workspace.size(), stream, &refusal);
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("fp8_gemm_quantized: ", cudaGetErrorString(e),
                                          refusal.empty() ? "" : ": ", refusal));
}

absl::Status GpuModel::Impl::Fp8OaPerGroup(const Layer& layer, int64_t rows) {
  const ModelConfig& c = config;
  const int64_t heads_hd = c.num_attention_heads * c.head_dim;
  const int64_t groups = c.o_groups;
  const int64_t group_in = heads_hd / groups;
  const int64_t o_lora = c.o_lora_rank;
  // attn_bf as Cast writes it; with fp8_shared_act_quant also each group's e4m3 rows (slot 1).
  PDSERVE_ASSIGN_OR_RETURN(
      const QuantizedRows attn_q,
      CastForGemm(attn.get(), rows, heads_hd, heads_hd, attn_bf.get(), 1, group_in));
  // Where fp8_gemm takes cuBLASLt (n a multiple of 128, out_stride of 8), the group's rows as
  // fp8_gemm would quantize them give its bits.
  const bool quantized =
      attn_q.q != nullptr && o_lora % kc::kFp8LtRowBlock == 0 && (groups * o_lora) % 8 == 0;
  // Group g: rows [g * o_lora, (g + 1) * o_lora) of the weight, whose scale rows start at
  // g * o_lora / 128 (Load keeps o_a FP8 only when o_lora is a multiple of 128).
  const Linear& w = layer.o_a_proj;
  const int64_t kblocks = group_in / kFp8BlockCols;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w.fp8_weight() + g * o_lora * group_in;
    const float* sg = w.fp8_scales() + g * (o_lora / kFp8BlockRows) * kblocks;
    float* out = grouped.get() + g * o_lora;
    if (quantized) {
      PDSERVE_RETURN_IF_ERROR(Fp8GemmQuantized(attn_q.q + g * kc::ActGroupBytes(rows, group_in),
                                               attn_q.s + g * kc::ActGroupScales(rows, group_in),
                                               rows, group_in, wg, sg, o_lora, out,
                                               groups * o_lora));
    } else {
      PDSERVE_RETURN_IF_ERROR(Fp8Gemm(attn_bf.get() + g * group_in, heads_hd, rows, group_in, wg,
                                      sg, o_lora, out, groups * o_lora));
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::engine::gpu
