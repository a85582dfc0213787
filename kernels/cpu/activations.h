// Pointwise activations used by DeepSeek-V4, float32. Thread-safe (no shared state).
//
// Sources: transformers 5.17 activations.py (silu, sigmoid, "sqrtsoftplus" = sqrt(softplus(x)))
// and modeling_deepseek_v4.py (DeepseekV4Experts._apply_gate, DeepseekV4MLP: SwiGLU with the
// gate clamped from above and the up projection clamped to [-limit, limit]).
#pragma once

#include <cmath>
#include <cstdint>

namespace pdserve::kernels::cpu {

inline float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float Silu(float x) { return x * Sigmoid(x); }
// torch.nn.functional.softplus with its default threshold 20 (linear above it).
inline float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
inline float SqrtSoftplus(float x) { return std::sqrt(Softplus(x)); }

// out[i] = silu(min(gate[i], limit)) * clamp(up[i], -limit, limit) for i < n.
// `out` may alias `gate` or `up`.
void ClampedSwiGlu(const float* gate, const float* up, int64_t n, float limit, float* out);

}  // namespace pdserve::kernels::cpu
