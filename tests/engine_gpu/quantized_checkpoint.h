// The bundled model FP8-quantized by tools/make_real_format_checkpoint.py for the CUDA engine's
// FP8 tests (gpu_fp8_weights_test.cc, gpu_fused_projections_test.cc): written once per process
// under the test temp directory, or PDSERVE_FP8_CHECKPOINT names one written elsewhere.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include "engine/config.h"
#include "engine/weights.h"
#include "tests/engine_gpu/gpu_test_models.h"

namespace pdserve::engine::gpu {

// The quantized checkpoint's directory, written once per process (or PDSERVE_FP8_CHECKPOINT).
inline std::string QuantizedCheckpoint() {
  static const std::string dir = [] {
    const char* env = std::getenv("PDSERVE_FP8_CHECKPOINT");
    if (env != nullptr && *env != '\0') return std::string(env);
    const std::filesystem::path out =
        std::filesystem::path(::testing::TempDir()) / "pdserve_fp8_kjv_v4_tiny";
    std::filesystem::remove_all(out);
    const std::string command = "python3 \"" +
                                (SourceDir() / "tools/make_real_format_checkpoint.py").string() +
                                "\" --out \"" + out.string() + "\" --quantize-from \"" +
                                (SourceDir() / "models/kjv-v4-tiny").string() + "\" > /dev/null";
    return std::system(command.c_str()) == 0 ? out.string() : std::string();
  }();
  return dir;
}

// A quantized checkpoint's config and weights: `full` as Weights::Load gives them (every tensor
// dequantized to float32; only when with_full), `slim` without the tensors the GPU reads in their
// stored precision (skip_fp8_matrices, skip_quantized_experts).
struct Quantized {
  ModelConfig config;
  std::optional<Weights> full, slim;
};

inline void LoadQuantized(const std::string& dir, bool with_full, Quantized* q) {
  auto config = ModelConfig::Load(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  q->config = *config;
  if (with_full) {
    auto full = Weights::Load(dir, q->config);
    ASSERT_TRUE(full.ok()) << full.status();
    q->full = std::move(*full);
  }
  WeightsLoadOptions slim_options;
  slim_options.skip_fp8_matrices = true;
  slim_options.skip_quantized_experts = true;
  auto slim = Weights::Load(dir, q->config, slim_options);
  ASSERT_TRUE(slim.ok()) << slim.status();
  q->slim = std::move(*slim);
}

}  // namespace pdserve::engine::gpu
