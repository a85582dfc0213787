// Activation quantization per 1 x 128 for the W8A8 FP8 GEMMs (DeepSeek inference's act_quant),
// as a kernel of its own and fused into the kernels that produce a GEMM's input, and the scale
// layout fp8_gemm_quantized (fp8_gemm.cuh) reads.
//
// Math (CPU reference kernels/cpu/fp8_gemm.h, QuantizeActivations; equal bits): per row r and
// 128-column block b of the bf16 values v: amax = max(max_i |v[r, 128b + i]|, 1e-4) (NaN
// ignored); s = amax / 448, or with ue8m0 the smallest power of two >= amax / 448; xq[r, 128b +
// i] = e4m3(v / s) saturated to +-448, nearest even (NaN -> 0x7F; an Inf in the block makes s Inf,
// so finite values become 0 and the Inf itself NaN); the scale goes to xs at ActScaleIndex.
// The fused producers compute v as the kernel they replace would store it in bf16 (round to
// nearest even), then quantize it: act_quant_f32 = engine/gpu's CastToBf16 + act_quant;
// clamped_swiglu_act_quant = clamped_swiglu (fp32, activations.cuh) + CastToBf16 + act_quant.
//
// Layouts: xq [rows, k] e4m3 row-major (row stride k); xs rows * (k / 128) fp32 at
// ActScaleIndex; k a positive multiple of 128.
//
// Variants (ActQuantVariant): kWarpPerBlock is the kernel fp8_gemm has always run (one warp per
// 128-column block, 8-byte loads, 4-byte stores); kHalfWarpVectorized (one half-warp per block, 16
// threads of 8 columns each: 16-byte loads, 8-byte stores, the block's max by 4 shuffles, two rows
// per half-warp with both loads in flight, 32 rows x one 128-column block per 256-thread CUDA
// block, no shared memory). Both give the same bits. fp8_gemm and moe_grouped_gemm use
// kHalfWarpVectorized where its alignment holds (act_quant_default_variant): 78-83% of the read +
// write floor on an H200 against 48-65% for kWarpPerBlock at 4096-8192 tokens (docs/perf.md, "Act
// quant for the W8A8 prefill GEMMs").
//
// All launchers: asynchronous on `stream`, launched with programmatic stream serialization (the
// blocks wait for the kernel before them before touching memory); CUDA-graph safe (no
// allocation, no synchronization; the launch shape depends only on the sizes); no state, so
// concurrent calls on different outputs are safe. They return cudaErrorInvalidValue on bad
// arguments (the refusal recorded as launch_check.h says, naming the check), else the launch
// status. rows of 0 writes nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kActQuantBlock = 128;

enum class ActScaleLayout {
  // xs[b * rows + r]: [k / 128, rows], rows fastest (QuantizeActivations' and fp8_gemm's own).
  kColumnMajor,
  // fp8_gemm_quantized's: with m4 = rows & ~3, rows [0, m4) as [k / 128, m4] (rows fastest),
  // then rows [m4, rows) as [k / 128, rows - m4] after them (cuBLASLt takes the first m4 rows with
  // their scales contiguous, fp8_gemm_mma the rest). The same as kColumnMajor when rows % 4 == 0.
  kGemmSplit,
};

// Where the scale of row r, 128-column block b goes (0 <= r < rows, 0 <= b < kblocks).
__host__ __device__ inline int64_t ActScaleIndex(int64_t r, int64_t b, int64_t rows,
                                                 int64_t kblocks, ActScaleLayout layout) {
  const int64_t m4 = layout == ActScaleLayout::kGemmSplit ? (rows & ~int64_t{3}) : rows;
  return r < m4 ? b * m4 + r : m4 * kblocks + b * (rows - m4) + (r - m4);
}

// Column groups (act_quant_f32's group_cols): columns [g * cols, (g + 1) * cols) quantized as a
// [rows, cols] matrix of their own, its e4m3 rows (row stride cols) at xq + g * bytes, its scales
// (in the call's layout over (rows, cols / 128)) at xs + g * scales; each group 256-byte aligned,
// as cuBLASLt wants its operands (the per-group GEMMs of o_a read one group each).
struct ActGroups {
  int64_t cols = 0;
  int64_t bytes = 0;
  int64_t scales = 0;
};
__host__ __device__ inline int64_t ActGroupBytes(int64_t rows, int64_t cols) {
  return (rows * cols + 255) & ~int64_t{255};
}
__host__ __device__ inline int64_t ActGroupScales(int64_t rows, int64_t cols) {
  return ((rows * (cols / kActQuantBlock) * 4 + 255) & ~int64_t{255}) / 4;
}

enum class ActQuantVariant { kWarpPerBlock, kHalfWarpVectorized };

// The variant fp8_gemm and moe_grouped_gemm quantize their activations with where its alignment
// holds: kHalfWarpVectorized, or kWarpPerBlock with PDSERVE_ACT_QUANT=warp (read once per process;
// another value: kHalfWarpVectorized, warned about, kernels/env_switch.h). Host only; thread-safe.
ActQuantVariant act_quant_default_variant();

// x [rows, x_stride] bf16 (columns 0..k-1 read) -> xq, xs as above. Requires rows >= 0, k a
// positive multiple of 128, x_stride >= k, rows * x_stride < 2^62; when rows > 0: x, xq, xs not
// null, xs 4-byte aligned; kWarpPerBlock: x 8-byte aligned, x_stride a multiple of 4, xq 4-byte
// aligned; kHalfWarpVectorized: x 16-byte aligned, x_stride a multiple of 8, xq 8-byte aligned.
cudaError_t act_quant(const __nv_bfloat16* x, int64_t rows, int64_t k, int64_t x_stride, bool ue8m0,
                      uint8_t* xq, float* xs, ActScaleLayout layout, ActQuantVariant variant,
                      cudaStream_t stream);

// Fused into the fp32 -> bf16 cast that feeds a GEMM (the engine's Cast of the normed
// hidden state, of the attention output, ...): v = bf16(x) (nearest even), quantized as above;
// y (when not null) [rows, y_stride] gets v as CastToBf16 writes it (columns 0..k-1). x [rows,
// x_stride] fp32. Requires what act_quant's kHalfWarpVectorized requires, with x 16-byte aligned
// and x_stride a multiple of 4, and y (when given) 16-byte aligned with y_stride >= k a multiple
// of 8. group_cols (0: k, one group, the plain layout): the columns in groups of group_cols (a
// multiple of 128 dividing k), each quantized as its own matrix (ActGroups: e4m3 at xq + g *
// ActGroupBytes(rows, group_cols), scales at xs + g * ActGroupScales(rows, group_cols)); xq and
// xs then hold k / group_cols such groups. Always the vectorized kernel.
cudaError_t act_quant_f32(const float* x, int64_t rows, int64_t k, int64_t x_stride, bool ue8m0,
                          __nv_bfloat16* y, int64_t y_stride, uint8_t* xq, float* xs,
                          ActScaleLayout layout, cudaStream_t stream, int64_t group_cols = 0);

// Fused into the clamped SwiGLU that feeds a down projection (the shared expert's w2): v =
// bf16(silu(min(gate, limit)) * clamp(up, -limit, limit)) computed as clamped_swiglu's fp32
// kernel does, then quantized; y (when not null) gets v. gate, up [rows, in_stride] fp32 (the
// fused [gate | up] layout: up = gate + inter). cols (the k of the GEMM) a positive multiple of
// 128; gate, up 16-byte aligned, in_stride >= cols a multiple of 4; otherwise as act_quant_f32.
cudaError_t clamped_swiglu_act_quant(const float* gate, const float* up, int64_t rows, int64_t cols,
                                     int64_t in_stride, float limit, bool ue8m0, __nv_bfloat16* y,
                                     int64_t y_stride, uint8_t* xq, float* xs,
                                     ActScaleLayout layout, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
