// Issue 11's prefill-side measurement (docs/perf.md, "Several GPUs"): how long a CUDA prefill's
// state takes to reach the request's pages once the forward is done, through the whole-slot
// export the prefill worker used before (GpuModel::ExportState, then PagedState::StoreLayer layer
// by layer) and through the staged one it uses now (runtime::StoreSlotStaged, what
// GpuPrefillEngine::Run calls after its forward: per-layer device-to-host copies into pinned
// buffers, each layer stored as soon as its copy lands), on one GPU; and device-to-host bandwidth
// into pinned and into pageable memory.
//
// Models: the bundled model (--model) with its whole context prefilled by GpuPrefillEngine; and a
// model with DeepSeek-V4-Flash attention shapes (head_dim 512, indexer 64 x 128, window 128, CSA
// rate 4 and HCA rate 128 alternating: bench/ep/flash_shapes.h), --random-layers layers, small
// MoE (the state does not depend on it), random weights, a --context token slot holding a random
// state (ImportState) at each of --positions: a GPU prefill of 64K tokens at these shapes would
// take far longer than the copies measured (the prefill kernels are the any-shape ones).
//
// Per row (median of --repeats): the state's bytes in device dtypes; the bytes the staged export
// copied; old: ExportState ms + the stores' ms, and when the first / last layer was stored (ms
// after the export began); new: the same two instants (the worker posts a layer at
// layer_stored). For the random model also the decode side: ImportState of the same state, plain
// and through two pinned buffers (median ms). Prints markdown rows on stdout, progress on stderr.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "bench/ep/flash_shapes.h"
#include "common/status.h"
#include "engine/config.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/gpu_model.h"
#include "engine/random_weights.h"
#include "engine/ring_state.h"
#include "engine/weights.h"
#include "runtime/cuda/gpu_prefill_engine.h"
#include "runtime/paged_state.h"
#include "runtime/prefill_engine.h"
#include "serving/page_pool.h"

namespace pdserve::bench {
namespace {

using engine::gpu::GpuModel;

struct Flags {
  std::string model = "models/kjv-v4-tiny";
  int64_t random_layers = 43;
  int64_t context = 65536;
  std::string positions = "65536,4096";
  int64_t repeats = 5;
  int64_t copy_mib = 1024;
};

double Ms(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// Bytes of a state in the device's dtypes: window rows, entries and indexer keys bf16, the
// compressors' partial windows and overlaps fp32.
size_t StateBytes(const engine::ModelState& state) {
  size_t bytes = 0;
  for (const engine::LayerState& l : state.layers) {
    bytes += 2 * l.window_kv.data.size();
    for (const engine::CompressorState* c : {&l.compressor, &l.indexer}) {
      bytes += 2 * c->entries.data.size() +
               4 * (c->buffer_kv.data.size() + c->buffer_gate.data.size() +
                    c->overlap_kv.data.size() + c->overlap_gate.data.size());
    }
  }
  return bytes;
}

// Slot 0 of `gpu` as it is now, into fresh pages, both ways, --repeats times; one table row.
absl::Status Measure(const std::string& name, GpuModel& gpu, const Flags& flags) {
  const engine::ModelConfig& config = gpu.config();
  const int64_t position = gpu.Position(0);
  PDSERVE_ASSIGN_OR_RETURN(const serving::StateLayout layout, runtime::LayoutForModel(config));
  PDSERVE_ASSIGN_OR_RETURN(auto pool,
                           serving::PagePool::Create(layout.PoolOptions(2, 2 * position)));
  PDSERVE_ASSIGN_OR_RETURN(const serving::PageTable old_table,
                           pool->Allocate(1, layout.Demand(position)));
  PDSERVE_ASSIGN_OR_RETURN(const serving::PageTable new_table,
                           pool->Allocate(2, layout.Demand(position)));
  PDSERVE_ASSIGN_OR_RETURN(const runtime::SequencePages old_pages,
                           runtime::MapPages(*pool, old_table));
  PDSERVE_ASSIGN_OR_RETURN(const runtime::SequencePages new_pages,
                           runtime::MapPages(*pool, new_table));
  const runtime::PagedState paged(config, layout, position);
  // The prefill engine's default staging.
  const int64_t layers = config.num_hidden_layers;
  const auto fit = static_cast<int64_t>(runtime::GpuPrefillEngine::kStagingBudgetBytes /
                                        gpu.StagingLayerBytes());
  PDSERVE_ASSIGN_OR_RETURN(auto staging, gpu.NewStateStaging(std::clamp<int64_t>(
                                             fit, std::min<int64_t>(2, layers), layers)));
  std::vector<double> export_ms, store_ms, old_first, old_last, new_first, new_last;
  size_t state_bytes = 0;
  size_t copied = 0;
  for (int64_t r = 0; r < flags.repeats; ++r) {
    Clock::time_point start = Clock::now();
    Clock::time_point first;
    PDSERVE_ASSIGN_OR_RETURN(const engine::ModelState state, gpu.ExportState(0));
    const Clock::time_point exported = Clock::now();
    for (int64_t l = 0; l < layers; ++l) {
      PDSERVE_RETURN_IF_ERROR(
          paged.StoreLayer(l, state.layers[static_cast<size_t>(l)], position, 0, old_pages));
      if (l == 0) first = Clock::now();
    }
    const Clock::time_point stored = Clock::now();
    export_ms.push_back(Ms(start, exported));
    store_ms.push_back(Ms(exported, stored));
    old_first.push_back(Ms(start, first));
    old_last.push_back(Ms(start, stored));
    state_bytes = StateBytes(state);

    const size_t copied_before = staging->copied_bytes();
    start = Clock::now();
    PDSERVE_RETURN_IF_ERROR(
        runtime::StoreSlotStaged(gpu, 0, *staging, paged, new_pages, [&](int64_t layer) {
          if (layer == 0) first = Clock::now();
          return absl::OkStatus();
        }));
    new_last.push_back(Ms(start, Clock::now()));
    new_first.push_back(Ms(start, first));
    copied = staging->copied_bytes() - copied_before;
  }
  std::printf(
      "| %s | %lld / %lld | %lld | %lld x %.1f MiB | %.1f | %.1f | %.2f + %.2f | %.2f / %.2f | "
      "%.2f / %.2f |\n",
      name.c_str(), static_cast<long long>(position), static_cast<long long>(gpu.max_context()),
      static_cast<long long>(layers), static_cast<long long>(staging->buffers()),
      static_cast<double>(gpu.StagingLayerBytes()) / (1 << 20),
      static_cast<double>(state_bytes) / 1e6, static_cast<double>(copied) / 1e6, Median(export_ms),
      Median(store_ms), Median(old_first), Median(old_last), Median(new_first), Median(new_last));
  std::fflush(stdout);
  return absl::OkStatus();
}

// Device-to-host GB/s (1e9 B/s) of one cudaMemcpyAsync of `mib` MiB into pinned and into pageable
// memory, median of 5 after a warm-up.
absl::Status CopyRates(int64_t mib) {
  const size_t n = static_cast<size_t>(mib) << 20;
  engine::gpu::DeviceArray<unsigned char> device;
  PDSERVE_RETURN_IF_ERROR(device.Allocate(n));
  PDSERVE_RETURN_IF_ERROR(device.Fill(0x5A));
  engine::gpu::PinnedArray<unsigned char> pinned;
  PDSERVE_RETURN_IF_ERROR(pinned.Allocate(n));
  std::vector<unsigned char> pageable(n, 1);
  cudaStream_t stream = nullptr;
  PDSERVE_CUDA_RETURN(cudaStreamCreate(&stream));
  auto rate = [&](void* host, double* gbps) -> absl::Status {
    std::vector<double> s;
    for (int i = 0; i < 6; ++i) {
      const Clock::time_point start = Clock::now();
      PDSERVE_CUDA_RETURN(cudaMemcpyAsync(host, device.get(), n, cudaMemcpyDeviceToHost, stream));
      PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
      if (i > 0) s.push_back(Seconds(start));
    }
    *gbps = static_cast<double>(n) / Median(s) / 1e9;
    return absl::OkStatus();
  };
  double to_pinned = 0;
  double to_pageable = 0;
  absl::Status status = rate(pinned.get(), &to_pinned);
  if (status.ok()) status = rate(pageable.data(), &to_pageable);
  cudaStreamDestroy(stream);
  PDSERVE_RETURN_IF_ERROR(status);
  std::printf("| device -> host, %lld MiB | pinned %.1f GB/s | pageable %.1f GB/s |\n",
              static_cast<long long>(mib), to_pinned, to_pageable);
  return absl::OkStatus();
}

// The bundled model with its whole context prefilled by the CUDA prefill engine.
absl::Status Bundled(const Flags& flags) {
  PDSERVE_ASSIGN_OR_RETURN(const engine::ModelConfig config,
                           engine::ModelConfig::Load(flags.model));
  PDSERVE_ASSIGN_OR_RETURN(const engine::Weights weights,
                           engine::Weights::Load(flags.model, config));
  const int64_t context = config.max_position_embeddings;
  engine::gpu::GpuModelOptions options;
  options.slots = 1;
  options.max_context = context;
  options.max_chunk = 256;
  PDSERVE_ASSIGN_OR_RETURN(auto gpu, GpuModel::Create(config, weights, options));
  PDSERVE_ASSIGN_OR_RETURN(auto engine, runtime::GpuPrefillEngine::Create(gpu.get(), 64));
  PDSERVE_ASSIGN_OR_RETURN(const serving::StateLayout layout, runtime::LayoutForModel(config));
  PDSERVE_ASSIGN_OR_RETURN(auto pool, serving::PagePool::Create(layout.PoolOptions(1, context)));
  PDSERVE_ASSIGN_OR_RETURN(const serving::PageTable table,
                           pool->Allocate(1, layout.Demand(context)));
  PDSERVE_ASSIGN_OR_RETURN(const runtime::SequencePages pages, runtime::MapPages(*pool, table));
  std::vector<int32_t> prompt(static_cast<size_t>(context));
  for (int64_t i = 0; i < context; ++i) {
    prompt[static_cast<size_t>(i)] = static_cast<int32_t>((31 * i + 5) % config.vocab_size);
  }
  auto ok = [](int64_t) { return absl::OkStatus(); };
  PDSERVE_RETURN_IF_ERROR(
      engine->Run(prompt, runtime::PagedState(config, layout, context), pages, ok, ok).status());
  return Measure(flags.model, *gpu, flags);
}

absl::Status RandomModel(const Flags& flags) {
  engine::ModelConfig config = FlashShapes(flags.random_layers, 32768);
  config.n_routed_experts = 8;
  config.moe_intermediate_size = 256;
  const Clock::time_point made = Clock::now();
  const engine::Weights weights = engine::FastRandomWeights(config, 1);
  engine::gpu::GpuModelOptions options;
  options.slots = 1;
  options.max_context = flags.context;
  options.max_chunk = 64;
  PDSERVE_ASSIGN_OR_RETURN(auto gpu, GpuModel::Create(config, weights, options));
  std::fprintf(stderr, "random model of %lld layers ready in %.1f s\n",
               static_cast<long long>(flags.random_layers), Seconds(made));
  // The decode side's import of the same states: the plain ImportState (pageable, one blocking
  // transfer) and through two pinned layer buffers (what the GPU decode runner uses).
  PDSERVE_ASSIGN_OR_RETURN(auto staging, gpu->NewStateStaging(2));
  std::vector<std::string> imports;
  for (absl::string_view p : absl::StrSplit(flags.positions, ',')) {
    const int64_t position = std::stoll(std::string(p));
    const engine::ModelState state = RandomRingState(gpu->config(), gpu->max_context(), position);
    PDSERVE_RETURN_IF_ERROR(gpu->ImportState(0, state));
    PDSERVE_RETURN_IF_ERROR(Measure("V4-Flash attention shapes, random state", *gpu, flags));
    std::vector<double> plain, staged;
    for (int64_t r = 0; r < flags.repeats; ++r) {
      const Clock::time_point a = Clock::now();
      PDSERVE_RETURN_IF_ERROR(gpu->ImportState(0, state));
      const Clock::time_point b = Clock::now();
      PDSERVE_RETURN_IF_ERROR(gpu->ImportState(0, state, staging.get()));
      const Clock::time_point c = Clock::now();
      plain.push_back(Ms(a, b));
      staged.push_back(Ms(b, c));
    }
    char row[256];
    std::snprintf(row, sizeof(row), "| %lld / %lld | %lld | %.1f | %.1f |",
                  static_cast<long long>(position), static_cast<long long>(flags.context),
                  static_cast<long long>(flags.random_layers), Median(plain), Median(staged));
    imports.push_back(row);
  }
  std::printf(
      "\n| decode-side import: position / slot context | layers | ImportState ms | "
      "through 2 pinned buffers ms |\n| --- | --- | --- | --- |\n");
  for (const std::string& row : imports) std::printf("%s\n", row.c_str());
  return absl::OkStatus();
}

absl::Status Run(const Flags& flags) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    return absl::FailedPreconditionError("no CUDA device");
  }
  PDSERVE_RETURN_IF_ERROR(CopyRates(flags.copy_mib));
  std::printf(
      "| model | position / slot context | layers | staging | state MB | staged copy MB | old: "
      "export + stores ms | old: first / last layer stored ms | new: first / last layer stored "
      "ms |\n");
  if (!flags.model.empty()) PDSERVE_RETURN_IF_ERROR(Bundled(flags));
  if (flags.random_layers > 0) PDSERVE_RETURN_IF_ERROR(RandomModel(flags));
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::bench

int main(int argc, char** argv) {
  pdserve::bench::Flags flags;
  CLI::App app("A CUDA prefill's state to its pages: whole-slot export vs staged per layer");
  app.add_option("--model", flags.model, "Model measured at its whole context ('': none)");
  app.add_option("--random-layers", flags.random_layers, "V4-Flash-shaped layers (0: none)");
  app.add_option("--context", flags.context, "Its slot's context (at most 65536)");
  app.add_option("--positions", flags.positions, "Its state positions, comma-separated");
  app.add_option("--repeats", flags.repeats, "Exports timed per row (median)");
  app.add_option("--copy-mib", flags.copy_mib, "Bytes of the bandwidth copy, MiB");
  CLI11_PARSE(app, argc, argv);
  const absl::Status status = pdserve::bench::Run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "staging_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
