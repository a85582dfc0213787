#include "engine/hyper_connection.h"

#include <algorithm>

#include "kernels/cpu/activations.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/sinkhorn.h"

namespace pdserve::engine {

namespace cpu = ::pdserve::kernels::cpu;

namespace {

// mix[tokens, outputs] = rms(flatten(streams)) fn^T.
std::vector<float> Mix(const ModelConfig& config, const Tensor& fn, const float* streams,
                       int64_t tokens) {
  const int64_t flat = config.hc_mult * config.hidden_size;
  std::vector<float> normed(static_cast<size_t>(tokens * flat));
  cpu::RmsNorm(streams, nullptr, tokens, flat, static_cast<float>(config.rms_norm_eps),
               normed.data());
  const int64_t outputs = fn.dim(0);
  std::vector<float> mix(static_cast<size_t>(tokens * outputs));
  cpu::Linear(normed.data(), tokens, flat, fn.ptr(), outputs, mix.data());
  return mix;
}

// collapsed[t] = sum_j pre[t][j] * streams[t][j].
void Collapse(const float* pre, const float* streams, int64_t tokens, int64_t hc, int64_t hidden,
              float* collapsed) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* o = collapsed + t * hidden;
    std::fill(o, o + hidden, 0.0f);
    for (int64_t j = 0; j < hc; ++j) {
      const float p = pre[t * hc + j];
      const float* s = streams + (t * hc + j) * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] += p * s[c];
    }
  }
}

}  // namespace

HyperMix HyperConnectionPre(const ModelConfig& config, const HyperConnectionWeights& w,
                            const float* streams, int64_t tokens, float* collapsed) {
  const int64_t hc = config.hc_mult;
  const int64_t outputs = (2 + hc) * hc;
  const float eps = static_cast<float>(config.hc_eps);
  const std::vector<float> mix = Mix(config, *w.fn, streams, tokens);
  const float* base = w.base->ptr();
  const float* scale = w.scale->ptr();
  std::vector<float> pre(static_cast<size_t>(tokens * hc));
  HyperMix out;
  out.post.resize(static_cast<size_t>(tokens * hc));
  out.comb.resize(static_cast<size_t>(tokens * hc * hc));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* m = mix.data() + t * outputs;
    for (int64_t j = 0; j < hc; ++j) {
      pre[t * hc + j] = cpu::Sigmoid(m[j] * scale[0] + base[j]) + eps;
      out.post[t * hc + j] = 2.0f * cpu::Sigmoid(m[hc + j] * scale[1] + base[hc + j]);
    }
    float* comb = out.comb.data() + t * hc * hc;
    for (int64_t j = 0; j < hc * hc; ++j) comb[j] = m[2 * hc + j] * scale[2] + base[2 * hc + j];
    cpu::SinkhornProject(comb, hc, config.hc_sinkhorn_iters, eps);
  }
  Collapse(pre.data(), streams, tokens, hc, config.hidden_size, collapsed);
  return out;
}

void HyperConnectionPost(const ModelConfig& config, const HyperMix& mix, const float* sublayer_out,
                         int64_t tokens, float* streams) {
  const int64_t hc = config.hc_mult;
  const int64_t hidden = config.hidden_size;
  std::vector<float> old(static_cast<size_t>(hc * hidden));
  for (int64_t t = 0; t < tokens; ++t) {
    float* s = streams + t * hc * hidden;
    std::copy_n(s, hc * hidden, old.data());
    const float* comb = mix.comb.data() + t * hc * hc;
    const float* y = sublayer_out + t * hidden;
    for (int64_t k = 0; k < hc; ++k) {
      float* o = s + k * hidden;
      const float post = mix.post[t * hc + k];
      for (int64_t c = 0; c < hidden; ++c) o[c] = post * y[c];
      for (int64_t j = 0; j < hc; ++j) {
        const float cjk = comb[j * hc + k];
        const float* src = old.data() + j * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] += cjk * src[c];
      }
    }
  }
}

void HyperHead(const ModelConfig& config, const Tensor& hc_fn, const Tensor& hc_base,
               const Tensor& hc_scale, const float* streams, int64_t tokens, float* out) {
  const int64_t hc = config.hc_mult;
  const std::vector<float> mix = Mix(config, hc_fn, streams, tokens);
  std::vector<float> pre(static_cast<size_t>(tokens * hc));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < hc; ++j) {
      pre[t * hc + j] = cpu::Sigmoid(mix[t * hc + j] * hc_scale.ptr()[0] + hc_base.ptr()[j]) +
                        static_cast<float>(config.hc_eps);
    }
  }
  Collapse(pre.data(), streams, tokens, hc, config.hidden_size, out);
}

}  // namespace pdserve::engine
