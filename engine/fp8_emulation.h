// TEST ONLY: the CPU engine computing its projections with the CUDA engine's FP8 arithmetic
// (engine/gpu/gpu_model.h, WeightFormat::kFp8Block), so the agreement that FP8 costs can be
// measured on a CPU and split into its causes (ModelOptions::fp8_emulation). The weights are the
// same in both (the checkpoint's FP8 values, dequantized exactly); what differs is the arithmetic
// around them:
//   quantize_inputs: the input is rounded to bf16 (the engine's GEMM input), then quantized per
//     1 x 128 to e4m3 as kernels/cuda/fp8_gemm and moe_gemm do (kernels::cpu::QuantizeActivations,
//     amax / 448 scales, not rounded to powers of two);
//   bf16_inputs: the input is rounded to bf16 and not quantized (W8A16: kernels/cuda/w8a16_gemm's
//     arithmetic, FP8 weights dequantized exactly, bf16 activations, fp32 accumulation);
//     quantize_inputs takes precedence;
//   bf16_outputs: the projection's output is rounded to bf16 (the FP8 kernels' output dtype); for
//     the routed experts also the SwiGLU output and each pick's weighted contribution, as
//     moe_gemm's per-pick bf16 rows.
//   ue8m0_scales: the activation scales rounded up to powers of two (DeepSeek's scale_fmt ue8m0;
//     the engine's kernels take amax / 448 as they are);
//   dense, routed_experts: which projections the above apply to (the dense ones: attention,
//     compressors, indexer, shared expert; the routed experts), to split the cost between them.
// Applies to projections whose input width is a multiple of 128 (the others are bf16 on the GPU).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>

namespace pdserve::engine {

struct Fp8Emulation {
  bool quantize_inputs = false;
  bool bf16_inputs = false;
  bool bf16_outputs = false;
  bool ue8m0_scales = false;
  bool dense = true;
  bool routed_experts = true;
  bool on() const { return quantize_inputs || bf16_inputs || bf16_outputs; }
  // The same with `dense` / `routed_experts` applied: what one projection site uses.
  Fp8Emulation ForDense() const { return dense ? *this : Fp8Emulation{}; }
  Fp8Emulation ForExperts() const { return routed_experts ? *this : Fp8Emulation{}; }
};

// y [rows, out] (row stride y_stride) = x [rows, in] (row stride x_stride) @ w [out, in]^T, as
// kernels::cpu::Linear, with `emulation`'s roundings where they apply.
void EmulatedLinear(const Fp8Emulation& emulation, const float* x, int64_t rows, int64_t in,
                    int64_t x_stride, const float* w, int64_t out, float* y, int64_t y_stride);

inline void EmulatedLinear(const Fp8Emulation& emulation, const float* x, int64_t rows, int64_t in,
                           const float* w, int64_t out, float* y) {
  EmulatedLinear(emulation, x, rows, in, in, w, out, y, out);
}

}  // namespace pdserve::engine
