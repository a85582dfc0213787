// Sinkhorn-Knopp projection of hyper-connection mixing matrices onto (approximately) doubly
// stochastic matrices on the GPU, fp32, a batch of independent n x n matrices (one per token).
//
// Math (DeepSeek-V4 paper §2.2 (manifold-constrained hyper-connections); transformers 5.17
// modeling_deepseek_v4.py, DeepseekV4HyperConnection.forward; CPU reference
// kernels/cpu/sinkhorn.h, matched operation for operation):
//   M = softmax_rows(logits) + eps;  M /= (column sums + eps)
//   repeat iters - 1 times: M /= (row sums + eps);  M /= (column sums + eps)
// The row softmax is kernels/cpu/softmax.h's: max by fmax (NaN ignored), exp(x - max) in fp32,
// sum in fp64, one fp32 reciprocal; an all -inf row becomes zeros (then eps). Row and column sums
// are fp32 in index order and the normalizations divide, as the CPU reference does.
//
// Layout: m [count, n, n] row-major, logits in, projected matrices out (in place). The engine calls
// it with n = hc_mult (4), iters = hc_sinkhorn_iters (20), eps = hc_eps.
//
// CUDA-graph safe: no allocation, no synchronization; the launch shape depends only on (count, n).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kMaxSinkhornN = 32;

// Which kernel runs; all are the same operations in the same order per entry, so their outputs
// are bit-identical (tests/kernels_cuda/sinkhorn_test.cc). kAuto = kEntries for n = 2 and 4
// (one entry per lane, a group of n x n lanes a matrix; on an H100, 2026-12-06: 3.7-3.9 us a
// launch at 1-1024 matrices against kRowRegisters' 7.7-8.2, docs/perf.md), kRowRegisters for
// n = 8 (lane j of a group of n holds row j in registers, column sums gathered by shuffles in row
// order), else kSharedMemory (the matrix in shared memory, lane j normalizes row j, then column
// j). kEntries asked for with another n runs as kAuto.
enum class SinkhornVariant { kAuto, kEntries, kRowRegisters, kSharedMemory };

// count >= 0; 1 <= n <= kMaxSinkhornN; iters <= 1 stops after the first column normalization, as
// the reference's loop does. count == 0 writes nothing. Returns cudaErrorInvalidValue on bad
// arguments (including a null m when count > 0), else the launch status. Asynchronous on
// `stream`; no state, so concurrent calls on different matrices are safe.
cudaError_t sinkhorn_project(float* m, int64_t count, int64_t n, int64_t iters, float eps,
                             cudaStream_t stream, SinkhornVariant variant = SinkhornVariant::kAuto);

}  // namespace pdserve::kernels::cuda
