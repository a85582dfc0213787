// The hyper-connection pre-mix of one site (GpuModel's HcPre) in two launches instead of four to
// six, fp32 throughout: the mixing GEMM with the unweighted RMSNorm of the flat streams folded
// into it, then the mixing weights, the Sinkhorn projection, the collapse of the streams and the
// sublayer's weighted RMSNorm in one kernel per row.
//
// Math (DeepSeek-V4 paper §2.2, manifold-constrained hyper-connections; transformers 5.17
// modeling_deepseek_v4.py, DeepseekV4HyperConnection; CPU reference engine/hyper_connection.cc),
// for one token with flat = flatten(streams) of length K = hc * hidden and outputs O = (2 + hc) hc:
//   inv_rms = 1 / sqrt(sum(flat^2) / K + rms_eps)
//   mix     = inv_rms * (flat fn^T)              [O]   (= rms(flat) fn^T, the unfused order)
//   pre, post, comb, collapsed from mix exactly as hyper_connection_pre (kernels/cuda/
//   hyper_connection.cuh): the same device functions, and the Sinkhorn projection's arithmetic
//   is kernels/cuda/sinkhorn_rows.cuh, sinkhorn_project's row kernel
//   out     = rms_norm(collapsed, norm_weight, rms_eps)   (kernels/cuda/rms_norm.cuh's formula:
//             sum of squares in fp64, inv in fp32, weight * (x * inv))
// Algebraically the unfused composition rms_norm(flat) -> GEMM -> hyper_connection_pre ->
// rms_norm; the rounding differs: the dot products are of the unnormalized streams, summed in
// fp32 per K-slice of kHcFusedSlice columns (fused multiply-adds, then a warp butterfly), the
// slices summed in fixed order, and inv_rms applied once to each sum; the first sum of squares is
// fp32 (rms_norm's is fp64), so a row whose squares overflow fp32 (|x| beyond ~1e19) gives
// zeros or NaN where the unfused path does not. Everything after mix rounds as the unfused
// kernels do. Deterministic: no atomics, every sum in a fixed order.
//
// Two kernels:
//   1. dots: grid (splits = ceil(K / kHcFusedSlice), ceil(rows / kHcFusedRowsPerBlock)); a block
//      stages its fn slice [O, kHcFusedSlice] in shared memory and, for each of its rows, writes
//      the slice's O dot products and sum of squares to partials[split, row, 0 .. O] (the sum of
//      squares last). Any row count (the row tiles cover prefill chunks too).
//   2. mix: one block per row: sums the row's partials over the splits in split order; warp 0
//      then makes the mixing weights and (the long serial part, ~20 dependent normalizations)
//      the Sinkhorn projection while the other warps collapse the streams into shared memory and
//      apply the RMSNorm.
//
// Layouts (fp32, contiguous): streams [rows, hc, hidden] (only read); fn [O, hc * hidden] (the
// checkpoint's hc_*_fn, row-major); base [O]; scale [3]; norm_weight [hidden] or nullptr
// (unweighted); partials [splits, rows, O + 1] workspace (hyper_connection_pre_fused_workspace);
// post [rows, hc]; comb [rows, hc, hc]; collapsed [rows, hidden]. collapsed must not alias
// streams.
//
// Supported: 1 <= hc <= kHcFusedMaxHc (V4: hc_mult 4, O = 24), 1 <= hidden <= kHcFusedMaxHidden
// (the collapsed row lives in shared memory). Errors: cudaErrorInvalidValue on bad arguments
// (shape outside that range, null pointers when rows > 0, a workspace smaller than the
// workspace size), else the launch status. rows == 0 launches nothing.
//
// Asynchronous on `stream`; no state (the workspace is the caller's), so calls on different
// workspaces and outputs may run concurrently. CUDA-graph safe: no allocation, no
// synchronization; launch shapes depend only on (rows, hc, hidden).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kHcFusedSlice = 128;        // flat columns per dots block
inline constexpr int64_t kHcFusedRowsPerBlock = 32;  // rows per dots block
inline constexpr int64_t kHcFusedMaxHc = 4;
inline constexpr int64_t kHcFusedMaxHidden = 8192;

// Whether hyper_connection_pre_fused takes this shape (hc streams of `hidden`, `outputs` mixing
// weights per token, which must be (2 + hc) * hc).
bool hyper_connection_pre_fused_supports(int64_t hc, int64_t hidden, int64_t outputs);

// Floats of the partials workspace for `rows` rows: ceil(hc * hidden / kHcFusedSlice) * rows *
// ((2 + hc) * hc + 1). 0 for a shape it does not support or rows <= 0.
int64_t hyper_connection_pre_fused_workspace(int64_t rows, int64_t hc, int64_t hidden);

// Writes post, comb (Sinkhorn-projected) and collapsed (= rms_norm(collapse, norm_weight)) of
// `rows` tokens; partials [partials_floats] is scratch. programmatic: both kernels launched with
// programmatic stream serialization (kernels/cuda/grid_dependency.cuh): the dots kernel stages
// its fn slice (weights, which no kernel writes) while the kernel before it drains, and the mix
// kernel's launch overlaps the dots kernel's tail; each waits for its predecessor before it
// touches anything else. Results are the same bits either way.
cudaError_t hyper_connection_pre_fused(const float* streams, int64_t rows, int64_t hc,
                                       int64_t hidden, const float* fn, const float* base,
                                       const float* scale, float hc_eps, int64_t sinkhorn_iters,
                                       const float* norm_weight, float rms_eps, float* partials,
                                       int64_t partials_floats, float* post, float* comb,
                                       float* collapsed, cudaStream_t stream,
                                       bool programmatic = false);

}  // namespace pdserve::kernels::cuda
