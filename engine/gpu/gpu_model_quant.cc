// GpuModelOptions::fp8_shared_act_quant: a W8A8 GEMM input quantized once, by the kernel that
// writes it (kernels/cuda/act_quant.cuh), for every FP8 projection that reads it.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/gpu/gpu_model_impl.h"
#include "kernels/cuda/act_quant.cuh"
#include "kernels/cuda/activations.cuh"
#include "spdlog/spdlog.h"

namespace pdserve::engine::gpu {
namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool GpuModel::Impl::SharedActQuant(int64_t rows, int64_t k) const {
  return act_quant_width > 0 && k <= act_quant_width && k % kc::kActQuantBlock == 0 &&
         rows <= max_rows && kc::fp8_gemm_path(rows) == kc::Fp8GemmPath::kCublasLt;
}

bool GpuModel::Impl::SharedActQuantWanted() const {
  const char* env = std::getenv("PDSERVE_FP8_SHARED_ACT_QUANT");
  const std::string forced = env != nullptr ? env : "";
  const bool wanted = forced == "1" || (forced != "0" && options.fp8_shared_act_quant);
  return wanted && options.fp8_activations == Fp8Activations::kFp8 &&
         options.weight_format == WeightFormat::kFp8Block;
}

absl::Status GpuModel::Impl::AllocateSharedActQuant() {
  if (!SharedActQuantWanted()) return absl::OkStatus();
  spdlog::info("fp8_shared_act_quant: W8A8 inputs quantized once, in the kernels that write them");
  const ModelConfig& c = config;
  act_quant_width =
      std::max({c.hidden_size, c.q_lora_rank, c.o_groups * c.o_lora_rank, c.moe_intermediate_size});
  const auto rows = static_cast<size_t>(max_rows);
  const auto width = static_cast<size_t>(act_quant_width);
  for (int slot = 0; slot < 2; ++slot) {
    PDSERVE_RETURN_IF_ERROR(act_q[slot].Allocate(rows * width));
    PDSERVE_RETURN_IF_ERROR(act_s[slot].Allocate(rows * width / kc::kActQuantBlock));
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantizedRows> GpuModel::Impl::CastForGemm(const float* x, int64_t rows, int64_t k,
                                                          int64_t x_stride, bf16* y, int slot) {
  if (!SharedActQuant(rows, k) || !Aligned16(x) || x_stride % 4 != 0) {
    PDSERVE_RETURN_IF_ERROR(CastRows(x, rows, k, x_stride, y));
    return QuantizedRows{};
  }
  uint8_t* rows_q = act_q[slot].get();
  float* rows_s = act_s[slot].get();
  PDSERVE_CUDA_RETURN(kc::act_quant_f32(x, rows, k, x_stride, /*ue8m0=*/false, y, k, rows_q, rows_s,
                                        kc::ActScaleLayout::kGemmSplit, stream));
  return QuantizedRows{rows_q, rows_s, rows, k};
}

absl::StatusOr<QuantizedRows> GpuModel::Impl::SwiGluForGemm(const float* gate_in,
                                                            const float* up_in, int64_t rows,
                                                            int64_t cols, int64_t in_stride,
                                                            float limit, float* out, bf16* y,
                                                            int slot) {
  if (!SharedActQuant(rows, cols) || !Aligned16(gate_in) || !Aligned16(up_in) ||
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
  return QuantizedRows{rows_q, rows_s, rows, cols};
}

absl::Status GpuModel::Impl::Fp8GemmQuantized(const QuantizedRows& xq, const Linear& w, int64_t n,
                                              float* out) {
  std::string refusal;
  const cudaError_t e =
      kc::fp8_gemm_quantized(xq.q, xq.s, xq.rows, xq.k, w.fp8_weight(), w.fp8_scales(), n, out, n,
                             fp8_workspace.get(), fp8_workspace.size(), stream, &refusal);
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("fp8_gemm_quantized: ", cudaGetErrorString(e),
                                          refusal.empty() ? "" : ": ", refusal));
}

}  // namespace pdserve::engine::gpu
