// CPU references of the block-scaled FP8 / FP4 GEMMs (kernels/cuda/fp8_gemm.cuh,
// kernels/cuda/moe_gemm.cuh): quantize the activations as DeepSeek's act_quant does, dequantize
// both operands to float32, then plain float32 dot products.
//
// Formats: e4m3 = OCP FP8 E4M3FN (bias 7, no infinities, S.1111.111 NaN); e2m1 = OCP FP4 (0, 0.5,
// 1, 1.5, 2, 3, 4, 6 and negatives; two per byte, element 2i in the low nibble); ue8m0 = 2^(e -
// 127), 0xFF NaN (docs/checkpoints.md, "Quantized formats"). All functions are pure and
// thread-safe.
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

inline constexpr int64_t kQuantBlock = 128;  // activation 1 x 128 and FP8 weight 128 x 128 blocks
inline constexpr int64_t kFp4Group = 32;     // FP4 scale group along k

float E4m3Value(uint8_t bits);
// v rounded to the nearest e4m3 value (ties to the even code), saturated to +-448; NaN -> 0x7F.
uint8_t E4m3FromFloat(float v);
float E2m1Value(uint8_t nibble);
float Ue8m0Value(uint8_t bits);

// Per row r and 128-block b of x [rows, x_stride] (columns 0..k-1, k a multiple of 128):
// amax = max(max |x|, 1e-4) ignoring NaN; s = amax / 448, or with ue8m0 the smallest power of two
// >= amax / 448; xq[r, :] = E4m3FromFloat(x / s); xs[b * rows + r] = s.
void QuantizeActivations(const float* x, int64_t rows, int64_t k, int64_t x_stride, bool ue8m0,
                         uint8_t* xq, float* xs);

// out [m, n] = dequant(act_quant(x)) @ dequant(w, w_scale)^T in float32. x [m, x_stride] (bf16
// values held as float), w [n, k] e4m3, w_scale [ceil(n / 128), k / 128].
void Fp8GemmReference(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* w,
                      const float* w_scale, int64_t n, bool ue8m0, float* out);

// W8A16 (kernels/cuda/fp8_gemm.cuh, fp8_gemm_w8a16): out [m, n] = x @ dequant(w, w_scale)^T in
// float32 with x as it is (bf16 values held as float: no activation quantization). Layouts as
// Fp8GemmReference.
void W8a16GemmReference(const float* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* w,
                        const float* w_scale, int64_t n, float* out);

// The routed experts' grouped GEMM: for each pick p = t * top_k + j with 0 <= experts[p] <
// n_experts, out[p, :] = weight[p] (1 when pick_weights is null) * dequant(act_quant(row)) @
// dequant(W_e)^T, row = x row p (x_per_pick) or t; other rows of out are not written.
//   fp4 false: w [E, n, k] e4m3, scale [E, ceil(n / 128), k / 128] fp32.
//   fp4 true:  w [E, n, k / 2] packed e2m1, scale_e8m0 [E, n, k / 32].
//   bf16_activations: the rows as they are, not act_quant'ed (W8A16: moe_gemm.cuh's
//   ExpertFormat::kFp8W8A16; fp4 false only); ue8m0 is then ignored.
struct ExpertWeightsRef {
  bool fp4 = false;
  const uint8_t* w = nullptr;
  const float* scale = nullptr;
  const uint8_t* scale_e8m0 = nullptr;
  int64_t n_experts = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool bf16_activations = false;
};
void MoeGemmReference(const float* x, int64_t x_stride, bool x_per_pick, const int32_t* experts,
                      const float* pick_weights, int64_t tokens, int64_t top_k,
                      const ExpertWeightsRef& weights, bool ue8m0, float* out);

}  // namespace pdserve::kernels::cpu
