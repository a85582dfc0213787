// FP8 e4m3 block-scaled dense GEMM on Hopper, as DeepSeek-V3/V4 inference computes its linear
// layers: weights stay e4m3 with one fp32 scale per 128 x 128 block, activations are quantized
// per 1 x 128 on the fly, the output is bf16.
//
// Math (CPU reference kernels/cpu/fp8_gemm.h, Fp8GemmReference):
//   act quant, per row r and 128-block b of x (DeepSeek inference's act_quant):
//     amax = max(max_i |x[r, 128b + i]|, 1e-4) (NaN ignored); s[r, b] = amax / 448, or with
//     ue8m0 the smallest power of two >= amax / 448; xq = e4m3(x / s), saturated to +-448,
//     rounded to nearest even; NaN stays NaN, Inf becomes NaN (Inf / Inf). The kernel:
//     act_quant.cuh's kHalfWarpVectorized where its alignment holds, else (or with
//     PDSERVE_ACT_QUANT=warp) kWarpPerBlock (act_quant_default_variant; the same bits).
//   out[r, n] = bf16( sum_b s[r, b] * w_scale[n / 128, b] * sum_i xq[r, 128b+i] * w[n, 128b+i] )
// The inner sums run on the FP8 tensor cores (mma.sync m16n8k32, fp32 accumulation inside one
// 128-block), the outer sum in fp32 in ascending b (split over blocks, then the splits added in
// ascending order: deterministic, equal inputs give equal bits). NaN / Inf propagate as in fp32.
//
// Layouts: x [m, x_stride] bf16 (columns 0..k-1 read); w [n, k] e4m3 row-major (DeepSeek's
// `weight`); w_scale [ceil(n / 128), k / 128] fp32 row-major (`scale` / `weight_scale_inv`);
// out [m, out_stride] bf16 (columns 0..n-1 written, nothing else).
//
// Paths (fp8_gemm_path), chosen by the H200 measurement of 2026-12-04 (docs/perf.md, CUDA
// graphs, V4-Flash's wq_b / wo_b / w13 / w2): fp8_gemm runs fp8_gemm_mma (mma.sync m16n8k32 e4m3,
// which sm_90 runs as f16 HMMA plus conversions) for m <= kFp8MmaMaxTokens (8; at 1-8 tokens it
// was as fast as the wgmma kernel or faster on three of the four shapes), fp8_gemm_wgmma
// (Hopper warpgroup MMA on the FP8 tensor cores, weights streamed by TMA) below
// kFp8LtMinTokens (at 16-32 tokens 1.1-1.4x faster than cuBLASLt and 1.3-2.5x faster than
// mma.sync), and cuBLASLt's block-scaled FP8 (fp8_gemm_cublaslt) from kFp8LtMinTokens (64) on,
// where it was 1.1-2.8x faster than the wgmma kernel, for n a multiple of 128 (else, or when
// cuBLASLt has no algorithm, the wgmma path). PDSERVE_FP8_GEMM=mma, =wgmma or =cublaslt (read
// once per process) forces that path for every m (cuBLASLt where it can); =own keeps the
// thresholds but never takes cuBLASLt (the wgmma kernel from kFp8MmaMaxTokens + 1 tokens on).
// Against the read floor of the same bytes timed the same way (bench/cuda/decode_bench.cu,
// docs/perf.md, H200 2026-12-04) fp8_gemm_w8a16 reaches 71-86% at 1-8 tokens, 43-64% at 32, 28-35%
// at 128: issue 25's decode goal (80%) is met only by wq_b at 1-8 tokens.
//
// CUDA-graph safe: no allocation, no host synchronization; the launch shapes depend only on the
// sizes. Asynchronous on `stream`; no state, so concurrent calls with different outputs and
// workspaces are safe.
// The wgmma kernels are launched as programmatic dependents: they read w (and, W8A8, w_scale)
// before the kernels before them on the stream have finished (several may still run: kernels
// that let their dependents start early), x and the rest after. So w and w_scale must not be
// written by any kernel that may still be running on the stream (weights are not).
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/fp8_gemm_workspace.h"

namespace pdserve::kernels::cuda {

// Bytes of device workspace fp8_gemm needs (quantized activations, their scales and the split-k
// partial sums: the larger of its two paths' needs); 0 for sizes fp8_gemm refuses. Host only.
size_t fp8_gemm_workspace_bytes(int64_t m, int64_t n, int64_t k);

// out = x @ dequant(w, w_scale)^T as above. Requires m, n >= 0; k > 0 and a multiple of 128;
// x_stride >= k and a multiple of 8; out_stride >= n; x, w, out 16-byte aligned; w_scale 4-byte
// aligned; every tensor under 2^62 elements; workspace 256-byte aligned with at least
// fp8_gemm_workspace_bytes(m, n, k) bytes. m or n of 0 writes nothing. Returns
// cudaErrorInvalidValue on bad arguments, with `refusal` (when given) naming the argument and
// the check that failed, else the launch status.
cudaError_t fp8_gemm(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                     const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                     __nv_bfloat16* out, int64_t out_stride, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream, std::string* refusal = nullptr);
// fp32 output: out [m, out_stride] fp32, each sum stored as it is (no bf16 rounding; what the
// engine's bf16 path gets from cuBLAS). Every fp8_gemm* / fp8_gemm_w8a16* function below has this
// float* overload with the same paths, workspace and requirements (out 16-byte aligned).
cudaError_t fp8_gemm(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                     const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                     float* out, int64_t out_stride, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream, std::string* refusal = nullptr);

// Creates fp8_gemm's cuBLASLt handle for the current device now (fp8_gemm otherwise creates it
// on its first call at >= kFp8LtMinTokens tokens). Call it before capturing a CUDA graph that
// may run such a call, so that no handle is created inside the capture. Returns
// cudaErrorNotSupported when cuBLASLt cannot create one (fp8_gemm then uses its own kernels).
// Host only; thread-safe.
cudaError_t fp8_gemm_prepare();

// Which kernel fp8_gemm tries first for m tokens (see "Paths" above; kFp8MmaMaxTokens,
// kFp8LtMinTokens and the rule: fp8_gemm_workspace.h, fp8_workspace::PathFor). Host only.
Fp8GemmPath fp8_gemm_path(int64_t m);
// PDSERVE_FP8_GEMM as fp8_gemm_path reads it ("" when unset), for fp8_workspace::RowBytes.
const std::string& fp8_gemm_forced_path();
// fp8_gemm_w8a16's: fp8_gemm_w8a16_mma up to kW8a16MmaMaxTokens (8), fp8_gemm_w8a16_wgmma above
// (H200, 2026-12-04 16:05 UTC: mma.sync with its k splits reduced in-kernel 1.1-1.4x faster than
// the wgmma kernel at 1-8 tokens; at 16 tokens the wgmma kernel with register weights
// (kFp8WgmmaDecodeConfig) 1.15-1.25x faster than mma.sync on wo_b, w13, w2 and as fast on wq_b,
// at 32 tokens 1.2-1.6x; no cuBLASLt path for bf16 x e4m3).
// PDSERVE_FP8_GEMM forces it as for fp8_gemm.
inline constexpr int64_t kW8a16MmaMaxTokens = 8;
Fp8GemmPath fp8_gemm_w8a16_path(int64_t m);

// The mma.sync path alone (same contract and workspace as fp8_gemm).
cudaError_t fp8_gemm_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                         const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                         __nv_bfloat16* out, int64_t out_stride, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream,
                         std::string* refusal = nullptr);
cudaError_t fp8_gemm_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                         const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                         float* out, int64_t out_stride, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream, std::string* refusal = nullptr);

// Tiles and pipeline of fp8_gemm_wgmma (kernels/cuda/fp8_gemm_wgmma.cu has the design):
// warpgroups: consumer warpgroups per block, 64 weight rows each (1 or 2; 0: 2 for W8A16 token
// tiles past 64 when the weight rows alone give target_blocks blocks, else 1); stages:
// shared-memory ring depth (2..8; fewer when one stage is too large for 8; 0: 2 for W8A16 token
// tiles past 32 and at 32 with at most 8 k blocks per split (unless alternate_turns), else 4);
// target_blocks: k is split until about this many blocks run (tiles x splits, at most 32 splits
// and one 128-k block per split; 0: never split). The flags act on token tiles up to 64 (m <= 64)
// only: cluster_reduce: the k splits of one tile run as one thread-block cluster (so at most
// kFp8WgmmaClusterSplits splits, rounded down to a power of two) and add their sums through
// distributed shared memory in the GEMM kernel itself, in the same ascending order and with the
// same bits as the second reduction kernel they replace (no split-k workspace); smem_scales: the
// block's weight and activation scales for its k split are copied to shared memory once before
// the main loop instead of being read per 128-k block; a16_register_weights
// (fp8_gemm_w8a16_wgmma): each thread converts its own wgmma A fragment from the e4m3 stage in
// registers (bf16 wgmma with A from registers) instead of the warpgroup converting the block into
// shared memory first. Two ways to keep the tensor cores busy while a block's products are
// folded in with its scales (neither is in kFp8WgmmaDecodeConfig: on the H200 neither made
// W8A16 faster, and W8A8 gained on some shapes and lost on others; docs/perf.md):
// alternate_turns: two consumer warpgroups share each block's 64 weight rows and take turns on
// the stage ring (even / odd 128-k blocks, each its own sums, added once at the end: a fixed
// order, deterministic, but not the one-block-at-a-time bits); warpgroups is taken as 1,
// cluster_reduce as false, an odd stage count as one less, and W8A8 token tiles past 64 ignore
// it. two_in_flight (token tiles up to 64; W8A16 only with register weights): each consumer
// warpgroup issues the next block's products into a second partial accumulator before waiting
// for the current block's (the same fold order and bits as without; with alternate_turns only
// from 4 stages). split_tokens (more than 8 tokens): two consumer warpgroups per block share its
// 64 weight rows (one weight box per stage) and each takes half of the block's tokens, up to 64
// (the block's tile 2 x 8..64 tokens), so a warpgroup runs a token tile of at most 64 (registers
// for smem_scales and two_in_flight) and two warpgroups' products overlap on each weight box;
// warpgroups is taken as 1, alternate_turns wins over it, no cluster_reduce with it. The token
// tiles and k splits are those without it, so each token's sums are folded in the same order
// (from wgmma products of a narrower N). stagger_k: each block takes its split's 128-k blocks
// from (row tile mod their count) on, wrapping around, so that the blocks running at once read
// different activation boxes (without it every block reads the same box at about the same time);
// deterministic, but the blocks of a split are then folded in that rotated order, not ascending
// (not the CPU reference's rounding order). multicast_activations: the blocks of row tiles 2j and
// 2j + 1 run as a cluster of two and load each activation box once for both (each block half of
// its rows, by TMA multicast into both), so the activations are read from L2 once per 128 weight
// rows; only where the block's tokens are a multiple of 16 (with split_tokens always) and the row
// tiles even, not with alternate_turns or cluster_reduce; the same bits as without.
// max_registers (96 or 128): where a block has one consumer warpgroup taking every k block and the
// plan runs one block at a time (not two in flight), token tiles up to 64 run a build of the
// kernel with at most that many registers a thread (ptxas may spill: 96 spills 80-740 bytes at
// W8A16 tiles of 8-64 tokens, 128 spills ~50 bytes at 48-64), the same arithmetic and bits. A
// block is 5 warps and a scheduler's quarter of the register file holds 16 K registers, so 3
// blocks fit on a multiprocessor at <= 128 registers and 4 at <= 96, where shared memory allows
// (W8A16 at 24 tokens, at 32 with more than 8 k blocks a split, and W8A8 at 48-64 fit 3 by their
// stages). Uncapped, W8A16 tiles of 32-64 tokens take 130-156 registers (2 blocks) and tiles of
// 8-24 121-128 (3); W8A8 tiles take 56-123 (3 or more) (ptxas, 2026-12-06), so only W8A16 at
// 32-64 tokens gains a
// block from 128, and 96 adds a fourth only where shared memory has room. The member defaults
// are the kernel without them. (Fp8WgmmaConfig, kFp8WgmmaClusterSplits and
// kFp8WgmmaDecodeConfig are defined in fp8_gemm_workspace.h, host arithmetic without CUDA.)
// a16_cluster_reduce_tokens: W8A16 token tiles up to this size take cluster_reduce whatever
// cluster_reduce says (0: none).
// kFp8WgmmaDecodeConfig, the config fp8_gemm and fp8_gemm_w8a16 use (H200, 2026-12-04,
// bench/cuda/decode_bench.cu at V4-Flash's dense shapes and 1-128 tokens; docs/perf.md): warpgroups
// and stages by the rules above, 264 target blocks, smem_scales and register weights; not
// cluster_reduce (at 32-64 tokens 1.3-1.6x slower than the reduce kernel for W8A16, no faster for
// W8A8 at 16-32) but for W8A16 token tiles up to 16 (a16_cluster_reduce_tokens 16: one V4-Flash
// layer's dense W8A16 GEMMs at 16 tokens 169.8 us against 184.4 with the reduce kernel, one H100
// run of tools/gpu/run_trace64.sh, 2026-12-06; at 32-64 tokens 1-2% slower, so not there).
// kFp8WgmmaDecodeConfig, or PDSERVE_FP8_WGMMA="warpgroups,stages,target[,cluster_reduce[,
// smem_scales[,a16_register_weights[,alternate_turns[,two_in_flight[,split_tokens[,stagger_k[,
// multicast_activations[,max_registers[,a16_cluster_reduce_tokens]]]]]]]]]]" (the flags 0 or 1,
// max_registers 0, 96 or 128, a16_cluster_reduce_tokens 0-64, missing ones as in
// kFp8WgmmaDecodeConfig;
// read once per process; other text is warned about and ignored, kernels/env_switch.h). Host only.
Fp8WgmmaConfig fp8_gemm_wgmma_default_config();
// Device workspace bytes of fp8_gemm_wgmma (quantized activations, their scales, the split-k
// sums), and its number of k splits; 0 for sizes it refuses. Host only.
size_t fp8_gemm_wgmma_workspace_bytes(int64_t m, int64_t n, int64_t k,
                                      const Fp8WgmmaConfig& config);
int32_t fp8_gemm_wgmma_splits(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config);
// Registers a thread of the kernel that fp8_gemm_wgmma (a16 false) or fp8_gemm_w8a16_wgmma (a16
// true) launches for m x n x k with `config` (cudaFuncGetAttributes' numRegs: which build the plan
// picks, e.g. a max_registers one); -1 for sizes it refuses, m = 0 or a CUDA error. Host only,
// needs a device.
int fp8_gemm_wgmma_kernel_registers(int64_t m, int64_t n, int64_t k, const Fp8WgmmaConfig& config,
                                    bool a16);
// fp8_gemm's function on the Hopper warpgroup MMA (sm_90a; e4m3 x e4m3 -> fp32 wgmma, 8..128
// tokens per block, weights streamed by TMA through a shared-memory ring). Same math, layouts and
// requirements as fp8_gemm plus n, k < 2^31; workspace fp8_gemm_wgmma_workspace_bytes(m, n, k,
// config). Split-k sums are added in ascending order by a second kernel: deterministic. Returns
// cudaErrorNotSupported when the driver cannot encode the TMA descriptors (`refusal` says so).
cudaError_t fp8_gemm_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                           __nv_bfloat16* out, int64_t out_stride, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream,
                           const Fp8WgmmaConfig& config, std::string* refusal = nullptr);
cudaError_t fp8_gemm_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, bool ue8m0_act_scale,
                           float* out, int64_t out_stride, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, const Fp8WgmmaConfig& config,
                           std::string* refusal = nullptr);

// W8A16 on the same kernel (fp8_gemm_w8a16's math: bf16 activations as they are, no act quant):
// the e4m3 weights are converted exactly to bf16 in shared memory by the consumer warpgroups and
// the products run on bf16 wgmma m64nNk16 (activations streamed by TMA in bf16). Same
// requirements as fp8_gemm_wgmma; workspace (the split-k sums only)
// fp8_gemm_w8a16_wgmma_workspace_bytes(m, n, k, config), at most fp8_gemm_wgmma's.
size_t fp8_gemm_w8a16_wgmma_workspace_bytes(int64_t m, int64_t n, int64_t k,
                                            const Fp8WgmmaConfig& config);
cudaError_t fp8_gemm_w8a16_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                                 const uint8_t* w, const float* w_scale, int64_t n,
                                 __nv_bfloat16* out, int64_t out_stride, void* workspace,
                                 size_t workspace_bytes, cudaStream_t stream,
                                 const Fp8WgmmaConfig& config, std::string* refusal = nullptr);
cudaError_t fp8_gemm_w8a16_wgmma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                                 const uint8_t* w, const float* w_scale, int64_t n, float* out,
                                 int64_t out_stride, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream, const Fp8WgmmaConfig& config,
                                 std::string* refusal = nullptr);

namespace fp8_gemm_internal {
// The argument checks fp8_gemm's paths share (fp8_gemm.cu); `refusal` names the failed check.
cudaError_t ValidateDense(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                          const uint8_t* w, const float* w_scale, int64_t n,
                          const __nv_bfloat16* out, int64_t out_stride, std::string* refusal);
// workspace_bytes >= needed and workspace 256-byte aligned, else the refusal.
cudaError_t CheckWorkspace(const void* workspace, size_t workspace_bytes, size_t needed,
                           std::string* refusal);
// The output pointer ValidateDense checks (null, 16-byte alignment): out_f32 when set, else out.
inline const __nv_bfloat16* OutForChecks(const __nv_bfloat16* out, const float* out_f32) {
  return out_f32 != nullptr ? reinterpret_cast<const __nv_bfloat16*>(out_f32) : out;
}
}  // namespace fp8_gemm_internal

// W8A16: out[r, n] = bf16( sum_b w_scale[n / 128, b] * sum_i x[r, 128b+i] * w[n, 128b+i] ) with x
// as it is (bf16, no activation quantization), every e4m3 weight converted exactly to bf16 in
// registers and the inner sums on the bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation;
// the outer sum as fp8_gemm's). CPU reference kernels/cpu/fp8_gemm.h, W8a16GemmReference. Reads
// the same weight bytes as fp8_gemm, so decode sizes should run about as fast; keeps the
// activations' 8 mantissa bits where fp8_gemm keeps 3 (docs/engine-gpu.md, "FP8 weights": the
// argmax agreement that costs). Same layouts and requirements as fp8_gemm; its workspace (the
// split-k partial sums) is fp8_gemm_w8a16_workspace_bytes(m, n, k) bytes, at most fp8_gemm's.
// Paths: fp8_gemm_w8a16_wgmma where fp8_gemm_path(m) is kWgmma, else fp8_gemm_w8a16_mma.
size_t fp8_gemm_w8a16_workspace_bytes(int64_t m, int64_t n, int64_t k);
cudaError_t fp8_gemm_w8a16(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, __nv_bfloat16* out,
                           int64_t out_stride, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, std::string* refusal = nullptr);
cudaError_t fp8_gemm_w8a16(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                           const uint8_t* w, const float* w_scale, int64_t n, float* out,
                           int64_t out_stride, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream, std::string* refusal = nullptr);
// The mma.sync W8A16 path alone (same contract and workspace as fp8_gemm_w8a16).
cudaError_t fp8_gemm_w8a16_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                               const uint8_t* w, const float* w_scale, int64_t n,
                               __nv_bfloat16* out, int64_t out_stride, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream,
                               std::string* refusal = nullptr);
cudaError_t fp8_gemm_w8a16_mma(const __nv_bfloat16* x, int64_t m, int64_t k, int64_t x_stride,
                               const uint8_t* w, const float* w_scale, int64_t n, float* out,
                               int64_t out_stride, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, std::string* refusal = nullptr);

// fp8_gemm on activations quantized beforehand (act_quant.cuh: act_quant, or a producer kernel
// with the quantization fused in), so GEMMs that share an input quantize it once. xq [m, k] e4m3
// (row stride k), xs the m * (k / 128) fp32 scales in ActScaleLayout::kGemmSplit (for m % 4 == 0
// plain [k / 128, m], rows fastest). With xq, xs from act_quant(x, ..., kGemmSplit) the output
// on the cuBLASLt path has fp8_gemm_cublaslt(x, ...)'s bits (so fp8_gemm's from
// kFp8LtMinTokens rows, n a multiple of 128); elsewhere the same math. Paths: cuBLASLt over the
// first m & ~3 rows and fp8_gemm_mma over the rest where fp8_gemm_path(m) is kCublasLt (n a
// multiple of 128, out_stride of 8, cuBLASLt has an algorithm), else fp8_gemm_mma over both parts
// (no wgmma path: the wgmma kernel quantizes inside). Requirements as fp8_gemm with x replaced by
// xq (not null, 16-byte aligned) and xs (not null, 16-byte aligned); workspace
// fp8_gemm_quantized_workspace_bytes(m, n, k). Compiled, not yet run on a GPU (2026-12-04).
size_t fp8_gemm_quantized_workspace_bytes(int64_t m, int64_t n, int64_t k);
cudaError_t fp8_gemm_quantized(const uint8_t* xq, const float* xs, int64_t m, int64_t k,
                               const uint8_t* w, const float* w_scale, int64_t n,
                               __nv_bfloat16* out, int64_t out_stride, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream,
                               std::string* refusal = nullptr);
cudaError_t fp8_gemm_quantized(const uint8_t* xq, const float* xs, int64_t m, int64_t k,
                               const uint8_t* w, const float* w_scale, int64_t n, float* out,
                               int64_t out_stride, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream, std::string* refusal = nullptr);

// Bytes of device workspace fp8_gemm_cublaslt needs: the quantized activations and their scales,
// the weight scales padded to a multiple of 4 per row when k / 128 is not, and
// kCublasLtWorkspace for cuBLASLt itself (or fp8_gemm_mma's workspace for the last m % 4 rows,
// when larger; kCublasLtWorkspace and the layout: fp8_gemm_workspace.h). 0 for sizes it refuses.
// Host only.
size_t fp8_gemm_cublaslt_workspace_bytes(int64_t m, int64_t n, int64_t k);

// The same function through cuBLASLt's block-scaled FP8 (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
// for the activations, BLK128x128_32F for the weights; CUDA 12.9+ on sm_90): the activations are
// quantized by the same kernel, then one cublasLtMatmul over the first m & ~3 rows (cuBLASLt
// needs the activation-scale rows a multiple of 4 and reads the weight scales with a leading
// dimension of round_up(k / 128, 4); fp8_gemm.cu copies them padded when needed), and
// fp8_gemm_mma over the last m % 4 rows. Same requirements as fp8_gemm plus n a
// multiple of 16 and out_stride a multiple of 8; `handle` from cublasLtCreate. Descriptors and
// the algorithm are chosen on every call (host work, outside a captured graph's replay). Returns
// cudaErrorNotSupported when cuBLASLt has no algorithm or refuses the call (`refusal` says which
// cuBLASLt status), cudaErrorInvalidValue on bad arguments.
cudaError_t fp8_gemm_cublaslt(cublasLtHandle_t handle, const __nv_bfloat16* x, int64_t m, int64_t k,
                              int64_t x_stride, const uint8_t* w, const float* w_scale, int64_t n,
                              bool ue8m0_act_scale, __nv_bfloat16* out, int64_t out_stride,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream,
                              std::string* refusal = nullptr);
// (fp32 output: cuBLASLt's D in fp32; cudaErrorNotSupported where it has no such algorithm.)
cudaError_t fp8_gemm_cublaslt(cublasLtHandle_t handle, const __nv_bfloat16* x, int64_t m, int64_t k,
                              int64_t x_stride, const uint8_t* w, const float* w_scale, int64_t n,
                              bool ue8m0_act_scale, float* out, int64_t out_stride, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream,
                              std::string* refusal = nullptr);

}  // namespace pdserve::kernels::cuda
