// Manifold-constrained hyper-connections (mHC) of DeepSeek-V4 on the GPU, fp32 throughout: the
// per-token mixing weights, the collapse of the residual streams into a sublayer input, the
// stream update after the sublayer, and the final head's collapse.
//
// Math (DeepSeek-V4 paper §2.2 eq. 8; transformers 5.17 modeling_deepseek_v4.py,
// DeepseekV4HyperConnection / DeepseekV4HyperHead; CPU reference engine/hyper_connection.cc,
// matched operation for operation), for one token with mix = rms(flatten(streams)) fn^T, which the
// caller computes (rms_norm unweighted, then a GEMM):
//   pre_j  = sigmoid(mix_j * scale0 + base_j) + eps
//   post_j = 2 * sigmoid(mix_{hc+j} * scale1 + base_{hc+j})
//   comb   = SinkhornProject(mix_{2hc..} * scale2 + base_{2hc..}) as [hc, hc]  (kernels/cuda/
//            sinkhorn.cuh, iters and eps as given)
//   collapsed = sum_j pre_j * streams_j                          (j ascending, from 0.0f)
//   streams'_k = post_k * y + sum_j comb[j][k] * streams_j       (j ascending)
// sigmoid(x) = 1 / (1 + exp(-x)). Products and sums are rounded separately (no fused multiply-add)
// and summed in the CPU's order, so results differ from it only by the ulp of exp.
//
// Layouts (all fp32, contiguous): mix [rows, (2 + hc) * hc] (hyper_head: [rows, hc]); streams
// [rows, hc, hidden]; base [(2 + hc) * hc] (hyper_head: [hc]); scale [3] (hyper_head: [1]), in
// device memory; post [rows, hc]; comb [rows, hc, hc]; collapsed / out / y [rows, hidden].
//
// Errors: cudaErrorInvalidValue on bad arguments (rows or hidden < 0, hc outside [1,
// kMaxSinkhornN], null pointers when there is work, sizes past 2^62 elements), else the launch
// status. rows == 0 or hidden == 0 launches nothing (hyper_connection_pre still writes post and
// comb when rows > 0 and hidden == 0).
//
// kernels/cuda/hyper_connection_fused.cuh does the whole pre-mix (the RMSNorm and the GEMM of
// mix folded in, the sublayer's RMSNorm after) in two launches.
//
// Asynchronous on `stream`; no state, so concurrent calls on different outputs are safe. CUDA-graph
// safe: no allocation, no synchronization; launch shapes depend only on (rows, hc, hidden).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/sinkhorn.cuh"

namespace pdserve::kernels::cuda {

// Mixing weights and collapsed input of one hyper-connection site: writes post, comb (Sinkhorn-
// projected) and collapsed. `streams` is only read. Two launches (mixing + collapse, then
// sinkhorn_project on comb in place).
cudaError_t hyper_connection_pre(const float* mix, const float* streams, int64_t rows, int64_t hc,
                                 int64_t hidden, const float* base, const float* scale, float eps,
                                 int64_t sinkhorn_iters, float* post, float* comb, float* collapsed,
                                 cudaStream_t stream);

// Stream update after the sublayer, in place on `streams`: every old stream value of a token is
// read before any new one of that token is written. `y` is the sublayer output; it must not alias
// `streams`.
cudaError_t hyper_connection_post(const float* post, const float* comb, const float* y,
                                  int64_t rows, int64_t hc, int64_t hidden, float* streams,
                                  cudaStream_t stream);

// Final head: out[r] = sum_j (sigmoid(mix[r, j] * scale[0] + base[j]) + eps) * streams[r, j].
cudaError_t hyper_head(const float* mix, const float* streams, int64_t rows, int64_t hc,
                       int64_t hidden, const float* base, const float* scale, float eps, float* out,
                       cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
