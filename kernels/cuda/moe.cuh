// DeepSeek-V4 mixture-of-experts on the GPU: the router (scores, top-k or hash pick, weights) and
// the routed experts' SwiGLU FFN, bf16 weights and activations in, fp32 math and output.
//
// Math (DeepSeek-V4 paper §2.1; transformers 5.17 modeling_deepseek_v4.py, DeepseekV4TopKRouter,
// DeepseekV4HashRouter, DeepseekV4Experts; CPU reference engine/moe.cc, Moe::Route and the routed
// part of Moe::Forward, matched operation for operation where the text says so):
//   scores  = f(logits), f = softmax over experts (kernels/cpu/softmax.h), sigmoid or
//             sqrt(softplus) (kernels/cpu/activations.h)
//   experts = tid2eid[token] (hash layers) or top-k of scores + correction_bias
//   (kernels/cpu/topk.h:
//             descending, equal values -> lower index first)
//   weights = scores[picked] * routed_scaling_factor / (sum_j scores[picked_j] + 1e-20)
//   out[r] += sum over r's picks, in ascending expert order (the CPU reference's order), of
//             weight * down_e(ClampedSwiGlu(gate_e x_r, up_e x_r, limit))
//
// CUDA-graph safe: no allocation, no host synchronization; launch shapes depend only on the sizes
// (rows, k, n_experts, hidden, inter); expert ids and token ids are read from device memory.
// Deterministic: no floating-point atomics; every sum runs in a fixed order, so equal inputs give
// bit-identical outputs. Asynchronous on `stream`; no state, so concurrent calls on different
// outputs (and different workspaces) are safe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pdserve::kernels::cuda {

// Limits of these kernels (DeepSeek-V4 uses 256 or 384 experts and k = 6).
inline constexpr int64_t kMaxMoeExperts = 1024;
inline constexpr int64_t kMaxMoeTopK = 32;

enum class MoeScoring { kSoftmax, kSigmoid, kSqrtSoftplus };

// Routes rows tokens to k experts each, exactly as Moe::Route.
//   logits [rows, n_experts] fp32: x @ gate^T (the caller's GEMM).
//   scoring: the score function f above. Scores are computed as the CPU reference does, with exp
//     and log1p evaluated in fp64 and rounded to fp32 (the correctly rounded fp32 result that
//     glibc's expf / log1pf return); the softmax sums its fp32 exponentials in fp64.
//   correction_bias [n_experts] fp32 (routed layers; steers selection only); nullptr = all zeros.
//   tid2eid [vocab, k] int32 and token_ids [rows] int32 (hash layers): when tid2eid is non-null
//     the picks are tid2eid[token_ids[r] * k + j] and correction_bias is ignored. token_ids must
//     index rows of tid2eid (the caller validates them against the vocabulary); a negative token
//     id picks nothing (experts -1). A picked id outside [0, n_experts), written through to
//     `experts` unchanged, gets weight 0 and adds nothing to the sum (moe_experts skips it).
//   routed_scaling_factor: fp32.
//   experts [rows, k] int32 out: row r's picks in pick order (top-k: best first).
//   weights [rows, k] fp32 out: the weights of those picks.
// Requires rows >= 0, 1 <= n_experts <= kMaxMoeExperts, 1 <= k <= kMaxMoeTopK and, for top-k
// routing, k <= n_experts. NaN scores are not handled specially: the picks stay deterministic but
// need not match the CPU reference's. rows == 0 writes nothing. Returns cudaErrorInvalidValue on
// bad arguments (including null pointers when rows > 0), else the launch status.
cudaError_t moe_route(const float* logits, int64_t rows, int64_t n_experts, int64_t k,
                      MoeScoring scoring, const float* correction_bias, const int32_t* tid2eid,
                      const int32_t* token_ids, float routed_scaling_factor, int32_t* experts,
                      float* weights, cudaStream_t stream);

// Bytes of device workspace moe_experts needs for rows x k picks and intermediate size inter: the
// picks grouped by expert, the fp32 intermediate activations [rows * k, inter] and the fp32
// per-pick contributions to a chunk of max(inter, 512) output columns [rows * k, chunk]; about
// 4 * rows * k * (inter + max(inter, 512)) bytes. 0 for negative sizes or sizes past the limits
// of moe_experts. Host only; no CUDA call.
size_t moe_experts_workspace_bytes(int64_t rows, int64_t k, int64_t inter);

// Adds the routed experts' outputs to out (the shared expert's output is already there):
//   out[r, :] += sum_j weights[r, j] * down_e(ClampedSwiGlu(gate_e x_r, up_e x_r, swiglu_limit)),
//   e = experts[r, j]
// Layouts and dtypes:
//   x [rows, hidden] bf16 (post-attention-norm activations, rounded to bf16 by the caller);
//   gate_up [n_experts, 2 * inter, hidden] bf16 (rows 0 .. inter-1 = gate, inter .. 2inter-1 = up);
//   down [n_experts, hidden, inter] bf16;
//   experts, weights [rows, k] (moe_route's outputs; int32, fp32);
//   out [rows, hidden] fp32, accumulated into.
//   workspace: at least moe_experts_workspace_bytes(rows, k, inter) bytes of device memory,
//     16-byte aligned; its contents on entry do not matter.
// Math: bf16 x bf16 products accumulated in fp32; the activation gate / up -> ClampedSwiGlu
// (std::min / std::clamp semantics, as kernels/cuda/activations.cuh) stays fp32 and feeds the
// down projection in fp32; each pick's contribution weight * down_e(...) is fp32, and a row's
// contributions are added to out one at a time in ascending expert order, then ascending j (the
// CPU reference's order). Weights of experts nobody picked are never read, so NaN there cannot
// leak. An expert id outside [0, n_experts) is skipped: it reads nothing and adds nothing.
// Speed: built for decode (rows 1..256): the picks are grouped by expert in tiles of up to 8, so
// each expert's weights are streamed once per tile (16-byte bf16 loads, one warp per 4 weight
// rows, CUDA-core fp32 FMAs). Large rows (prefill) are correct but not fast: every further tile
// of an expert reads its weights again (from L2) and no tensor cores are used. Measured on one
// H200 (hidden 4096, inter 2048, 256 experts, k 6, random picks): rows 1 / 16 / 64 / 256 take
// 120 / 1061 / 2553 / 6685 us, i.e. the picked experts' weights at 2.5 / 4.0 / 3.8 / 1.9 TB/s;
// rows 4096 take 131 ms (CUDA-core bound). At the kjv-v4-tiny shape (256, 256, 8 experts, k 2):
// 19 us for 1 row, 42 us for 256.
// Requires rows >= 0, hidden >= 0, inter >= 0, 1 <= k <= kMaxMoeTopK, 1 <= n_experts <=
// kMaxMoeExperts, rows * k < 2^31 and every tensor under 2^62 elements. rows, hidden or inter of
// 0 adds nothing. Returns cudaErrorInvalidValue on bad arguments (including null pointers when
// there is work, or a workspace that is too small or misaligned), else the launch status.
cudaError_t moe_experts(const __nv_bfloat16* x, int64_t rows, int64_t hidden, int64_t inter,
                        int64_t k, int64_t n_experts, const __nv_bfloat16* gate_up,
                        const __nv_bfloat16* down, const int32_t* experts, const float* weights,
                        float swiglu_limit, void* workspace, size_t workspace_bytes, float* out,
                        cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
