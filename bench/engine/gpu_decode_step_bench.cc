// Decode-step time of the CUDA engine with its projections unfused and fused
// (GpuModelOptions::fused_projections, engine/fused_projections.h), in one run: for each batch of
// --batches, that many requests are prefilled with --prompt tokens, then --steps graph decode
// steps (after 3 warm-up steps) run with the logits left on the device (DecodeStepOnDevice) and
// the stream synchronized after each step. Per step: the device time between CUDA events around
// the call on the model's stream (the metadata copies and the graph) and the host wall time of
// the call and its synchronization (what a server's step loop waits); medians.
//
// Models:
//   --model DIR (default models/kjv-v4-tiny): a checkpoint; --weights bf16 | fp8 (kFp8Block, the
//     checkpoint's FP8 tensors on the device, e.g. one written by tools/make_real_format_
//     checkpoint.py) and --activations bf16 | fp8 (W8A16 / W8A8).
//   --flash-layers N (> 0): random bf16 weights in V4-Flash layer shapes (bench/ep/flash_shapes.h)
//     with N layers, --experts routed experts (default 16: the host holds every weight in fp32)
//     and --vocab tokens; --model and --weights are then ignored.
//
// --prefill N (> 0): instead of decode steps, a prompt of N tokens in one Forward call (the last
// row's logits to the host, ChunkLogits::kLastRow) from an empty slot, eager, 1 warm-up and
// --steps timed calls: the device time between CUDA events around the call and the wall time;
// medians (e.g. W8A8 prefill with PDSERVE_FP8_SHARED_ACT_QUANT=0 / 1). Rows say "prefill N";
// stderr gets a "prefill logits" line per row (the last row's top 5 and sum, to compare runs).
//
// --projections both | fused | unfused: time both layouts (default) or one (e.g. under a
// profiler, where the other's kernels would only add to the listing). --profile-timed: the
// timed calls between cudaProfilerStart and cudaProfilerStop (for ncu --profile-from-start off).
//
// The hyper-connection pre-mix follows GpuModelOptions::fused_hc_pre's default (off) unless
// PDSERVE_FUSED_HC_PRE=1 (or 0) is in the environment; stderr says which ran ("hc pre: fused").
//
// Prints one markdown row per (fused, batch) and nothing else on stdout; needs a CUDA device.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/ep/flash_shapes.h"
#include "common/status.h"
#include "engine/config.h"
#include "engine/gpu/gpu_model.h"
#include "engine/random_weights.h"
#include "engine/tensor.h"
#include "engine/weights.h"

namespace pdserve::bench {
namespace {

using engine::gpu::GpuModel;

struct Flags {
  std::string model = "models/kjv-v4-tiny";
  std::string weights = "bf16";
  std::string activations = "bf16";
  int64_t flash_layers = 0;
  std::string projections = "both";  // both | fused | unfused
  bool profile_timed = false;        // cudaProfilerStart / Stop around the timed calls
  int64_t experts = 16;
  int64_t vocab = 8192;
  std::string batches = "1,8,32";
  int64_t prompt = 64;
  int64_t steps = 30;
  int64_t prefill = 0;
};

struct StepTimes {
  double device_us = 0.0;
  double wall_us = 0.0;
};

// Median device time (CUDA events around `call` on `stream`) and wall time (the call and the
// stream's synchronization) of `timed` calls after `warm` untimed ones; `before(t)` runs untimed
// before call t.
absl::StatusOr<StepTimes> TimeCalls(cudaStream_t stream, int64_t warm, int64_t timed,
                                    bool profile_timed,
                                    const std::function<absl::Status(int64_t)>& before,
                                    const std::function<absl::Status(int64_t)>& call) {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    return absl::InternalError("cudaEventCreate");
  }
  std::vector<double> device, wall;
  absl::Status status;
  for (int64_t t = 0; t < warm + timed && status.ok(); ++t) {
    status = before(t);
    if (!status.ok()) break;
    if (profile_timed && t == warm) cudaProfilerStart();
    const Clock::time_point began = Clock::now();
    cudaEventRecord(start, stream);
    status = call(t);
    cudaEventRecord(stop, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) status = absl::InternalError("sync");
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    if (t >= warm) {
      device.push_back(1000.0 * ms);
      wall.push_back(1e6 * Seconds(began));
    }
  }
  if (profile_timed) cudaProfilerStop();
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  PDSERVE_RETURN_IF_ERROR(status);
  return StepTimes{Median(device), Median(wall)};
}

std::vector<int32_t> Prompt(int64_t tokens, int64_t vocab) {
  std::vector<int32_t> prompt(static_cast<size_t>(tokens));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((7 + 13 * i) % vocab);
  return prompt;
}

absl::StatusOr<StepTimes> TimeDecode(GpuModel& gpu, int64_t batch, const Flags& flags) {
  const int64_t vocab = gpu.config().vocab_size;
  const std::vector<int32_t> prompt = Prompt(flags.prompt, vocab);
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < batch; ++s) {
    PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(s));
    PDSERVE_RETURN_IF_ERROR(gpu.Forward(s, prompt).status());
    slots.push_back(s);
  }
  return TimeCalls(
      static_cast<cudaStream_t>(gpu.cuda_stream()), 3, flags.steps, flags.profile_timed,
      [](int64_t) { return absl::OkStatus(); },
      [&](int64_t t) {
        const std::vector<int32_t> tokens(slots.size(), static_cast<int32_t>((100 + t) % vocab));
        return gpu.DecodeStepOnDevice(slots, tokens, /*use_graph=*/true).status();
      });
}

// The prefill's last-row logits in brief (stderr), to compare runs with different kernels:
// argmax, the five largest ids, the sum (fp32, ascending index), NaN count.
absl::Status PrintPrefillLogits(GpuModel& gpu, const Flags& flags, const std::string& what) {
  const std::vector<int32_t> prompt = Prompt(flags.prefill, gpu.config().vocab_size);
  PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(0));
  PDSERVE_ASSIGN_OR_RETURN(const engine::Tensor logits,
                           gpu.Forward(0, prompt, 0, engine::gpu::ChunkLogits::kLastRow));
  std::vector<int64_t> order(static_cast<size_t>(logits.numel()));
  std::iota(order.begin(), order.end(), 0);
  const float* v = logits.ptr();
  const auto top = std::min<size_t>(5, order.size());
  std::partial_sort(order.begin(), order.begin() + top, order.end(),
                    [v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  float sum = 0.0f;
  int64_t nan = 0;
  for (int64_t i = 0; i < logits.numel(); ++i) {
    nan += std::isnan(v[i]) ? 1 : 0;
    if (!std::isnan(v[i])) sum += v[i];
  }
  std::fprintf(stderr, "prefill logits %s: top", what.c_str());
  for (size_t i = 0; i < top; ++i) {
    std::fprintf(stderr, " %lld (%.4f)", static_cast<long long>(order[i]), v[order[i]]);
  }
  std::fprintf(stderr, ", sum %.4f, NaN %lld\n", sum, static_cast<long long>(nan));
  return absl::OkStatus();
}

// --prefill: median device and wall time of a flags.prefill-token Forward from an empty slot 0.
absl::StatusOr<StepTimes> TimePrefill(GpuModel& gpu, const Flags& flags) {
  const std::vector<int32_t> prompt = Prompt(flags.prefill, gpu.config().vocab_size);
  const auto stream = static_cast<cudaStream_t>(gpu.cuda_stream());
  return TimeCalls(
      stream, 1, flags.steps, flags.profile_timed,
      [&](int64_t) -> absl::Status {
        PDSERVE_RETURN_IF_ERROR(gpu.ResetSlot(0));
        if (cudaStreamSynchronize(stream) != cudaSuccess) return absl::InternalError("sync");
        return absl::OkStatus();
      },
      [&](int64_t) {
        return gpu.Forward(0, prompt, 0, engine::gpu::ChunkLogits::kLastRow).status();
      });
}

absl::Status Run(const Flags& flags) {
  std::vector<int64_t> batches;
  for (absl::string_view b : absl::StrSplit(flags.batches, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(b, &v) || v < 1) {
      return absl::InvalidArgumentError("--batches: not a list of positive integers");
    }
    batches.push_back(v);
  }
  if (flags.steps < 1 || flags.prompt < 1 || flags.prefill < 0) {
    return absl::InvalidArgumentError("--steps and --prompt must be positive, --prefill >= 0");
  }
  if (flags.projections != "both" && flags.projections != "fused" &&
      flags.projections != "unfused") {
    return absl::InvalidArgumentError("--projections: both, fused or unfused");
  }
  const int64_t slots = *std::max_element(batches.begin(), batches.end());
  engine::ModelConfig config;
  std::optional<engine::Weights> weights;
  engine::gpu::GpuModelOptions options;
  std::string what;
  if (flags.flash_layers > 0) {
    config = FlashShapes(flags.flash_layers, flags.vocab);
    config.n_routed_experts = flags.experts;
    config.num_experts_per_tok = std::min<int64_t>(config.num_experts_per_tok, flags.experts);
    weights = engine::FastRandomWeights(config, 1);
    what = "V4-Flash x" + std::to_string(flags.flash_layers) + " bf16";
  } else {
    PDSERVE_ASSIGN_OR_RETURN(config, engine::ModelConfig::Load(flags.model));
    const bool fp8 = flags.weights == "fp8";
    engine::WeightsLoadOptions load;
    load.skip_fp8_matrices = fp8;
    load.skip_quantized_experts = fp8;
    PDSERVE_ASSIGN_OR_RETURN(weights, engine::Weights::Load(flags.model, config, load));
    if (fp8) {
      options.weight_format = engine::gpu::WeightFormat::kFp8Block;
      options.checkpoint_dir = flags.model;
      if (flags.activations == "fp8") {
        options.fp8_activations = engine::gpu::Fp8Activations::kFp8;
      }
    }
    what = flags.model + " " + (fp8 ? (flags.activations == "fp8" ? "W8A8" : "W8A16") : "bf16");
  }
  options.slots = flags.prefill > 0 ? 1 : slots;
  options.max_chunk = std::max<int64_t>({flags.prompt, flags.prefill, 64});
  options.max_context = std::min<int64_t>(
      config.max_position_embeddings,
      std::max<int64_t>({512, flags.prompt + flags.steps + 8, flags.prefill + 8}));
  for (const bool fused : {false, true}) {
    if ((fused && flags.projections == "unfused") || (!fused && flags.projections == "fused")) {
      continue;
    }
    options.fused_projections = fused;
    PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<GpuModel> gpu,
                             GpuModel::Create(config, *weights, options));
    std::fprintf(stderr, "hc pre: %s\n", gpu->fused_hc_pre() ? "fused" : "unfused");
    if (flags.prefill > 0) {
      PDSERVE_ASSIGN_OR_RETURN(const StepTimes t, TimePrefill(*gpu, flags));
      std::printf("| %s | %s | prefill %lld | %.1f | %.1f |\n", what.c_str(),
                  fused ? "fused" : "unfused", static_cast<long long>(flags.prefill), t.device_us,
                  t.wall_us);
      std::fflush(stdout);
      PDSERVE_RETURN_IF_ERROR(
          PrintPrefillLogits(*gpu, flags, what + (fused ? " fused" : " unfused")));
      continue;
    }
    for (int64_t batch : batches) {
      PDSERVE_ASSIGN_OR_RETURN(const StepTimes t, TimeDecode(*gpu, batch, flags));
      std::printf("| %s | %s | %lld | %.1f | %.1f |\n", what.c_str(), fused ? "fused" : "unfused",
                  static_cast<long long>(batch), t.device_us, t.wall_us);
      std::fflush(stdout);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Flags flags;
  CLI::App app{"Decode-step time of the CUDA engine, projections unfused and fused"};
  app.add_option("--model", flags.model, "model directory");
  app.add_option("--weights", flags.weights, "bf16 or fp8 (kFp8Block)");
  app.add_option("--activations", flags.activations, "with --weights fp8: bf16 or fp8");
  app.add_option("--flash-layers", flags.flash_layers, "random V4-Flash-shaped layers (0: off)");
  app.add_option("--experts", flags.experts, "routed experts of the V4-Flash-shaped model");
  app.add_option("--vocab", flags.vocab, "vocabulary of the V4-Flash-shaped model");
  app.add_option("--batches", flags.batches, "decode batches, comma-separated");
  app.add_option("--prompt", flags.prompt, "prompt tokens per request");
  app.add_option("--steps", flags.steps, "timed decode steps per batch (prefill calls)");
  app.add_option("--projections", flags.projections,
                 "both (default), fused or unfused: which projection layouts to time");
  app.add_flag("--profile-timed", flags.profile_timed,
               "cudaProfilerStart / Stop around the timed calls only (ncu --profile-from-start "
               "off profiles just those)");
  app.add_option("--prefill", flags.prefill,
                 "time a prompt of this many tokens in one Forward instead of decode steps");
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = pdserve::bench::Run(flags);
  if (!s.ok()) {
    std::fprintf(stderr, "gpu_decode_step_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
