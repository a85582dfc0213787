// The weights as the CUDA engine holds them (engine/gpu/gpu_model_load.cc): every projection,
// the experts, the embedding and lm_head rounded to bf16 (round to nearest even); norms,
// hyper-connection mixes, the router, biases and sinks kept fp32. Shared by the CPU precision
// study (tests/engine/bf16_storage_test.cc) and the GPU tests (tests/engine_gpu).
#pragma once

#include <string>
#include <utility>

#include "engine/quant.h"
#include "engine/tensor.h"
#include "engine/weights.h"

namespace pdserve::engine {

inline Weights RoundedLikeGpu(const Weights& w) {
  Weights out = w;
  for (const auto& [name, tensor] : w.all()) {
    const bool projection = name.ends_with("_proj.weight") || name.ends_with("_proj");
    if (projection || name == "model.embed_tokens.weight" || name == "lm_head.weight") {
      Tensor rounded = tensor;
      RoundToBf16(rounded.ptr(), rounded.numel());
      out.Set(name, std::move(rounded));
    }
  }
  return out;
}

}  // namespace pdserve::engine
