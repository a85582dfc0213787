// Manifold-constrained hyper-connections (mHC) of DeepSeek-V4 (CPU backend, float32).
//
// The residual is hc_mult parallel streams per token, [tokens, hc, hidden]. At each sublayer site
// (paper §2.2 eq. 8; transformers 5.17 modeling_deepseek_v4.py, DeepseekV4HyperConnection and
// DeepseekV4DecoderLayer):
//   mix = rms(flatten(streams)) fn^T                       [(2 + hc) * hc], unweighted RMSNorm
//   pre = sigmoid(mix[:hc] * scale0 + base[:hc]) + hc_eps;  post = 2 sigmoid(mix[hc:2hc] * scale1
//   + base[hc:2hc]);  comb = Sinkhorn(mix[2hc:] * scale2 + base[2hc:]) as [hc, hc]
//   collapsed = sum_j pre_j streams_j  -> the sublayer input (before its RMSNorm)
//   streams'_k = post_k * sublayer_out + sum_j comb[j][k] streams_j
// The final head (DeepseekV4HyperHead) collapses the streams with its own pre weights.
// Thread-safe (no shared state).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config.h"
#include "engine/tensor.h"

namespace pdserve::engine {

// One hyper-connection site: fn [(2 + hc) * hc, hc * hidden], base [(2 + hc) * hc], scale [3].
struct HyperConnectionWeights {
  const Tensor* fn = nullptr;
  const Tensor* base = nullptr;
  const Tensor* scale = nullptr;
};

// Mixing weights of one site for a batch of tokens.
struct HyperMix {
  std::vector<float> post;  // [tokens, hc]
  std::vector<float> comb;  // [tokens, hc, hc]
};

// streams: [tokens, hc, hidden]. Writes collapsed: [tokens, hidden] and returns post / comb.
HyperMix HyperConnectionPre(const ModelConfig& config, const HyperConnectionWeights& w,
                            const float* streams, int64_t tokens, float* collapsed);

// streams (in / out): [tokens, hc, hidden]; sublayer_out: [tokens, hidden].
void HyperConnectionPost(const ModelConfig& config, const HyperMix& mix, const float* sublayer_out,
                         int64_t tokens, float* streams);

// Final collapse: hc_fn [hc, hc * hidden], hc_base [hc], hc_scale [1]; out: [tokens, hidden].
void HyperHead(const ModelConfig& config, const Tensor& hc_fn, const Tensor& hc_base,
               const Tensor& hc_scale, const float* streams, int64_t tokens, float* out);

}  // namespace pdserve::engine
