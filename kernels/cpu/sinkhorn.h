// Sinkhorn-Knopp projection of a hyper-connection mixing matrix onto (approximately) doubly
// stochastic matrices, float32.
//
// Math (transformers 5.17 modeling_deepseek_v4.py, DeepseekV4HyperConnection.forward; paper §2.2):
//   M = softmax_rows(logits) + eps;  M /= (column sums + eps)
//   repeat iters - 1 times: M /= (row sums + eps); M /= (column sums + eps)
// Thread-safe (no shared state).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// m: [n, n] row-major logits in, the projected matrix out. iters <= 1 stops after the first
// column normalization, as the reference's loop does.
void SinkhornProject(float* m, int64_t n, int64_t iters, float eps);

}  // namespace pdserve::kernels::cpu
