// Issue 26's figures for the CUDA engine's paged decode state (engine/gpu/gpu_model.h,
// GpuModelOptions::paged_state), printed as markdown tables on stdout (progress on stderr):
//
//   capacity: concurrent requests of 8K, 32K and 128K tokens whose decode state fits one H200
//     at DeepSeek-V4-Flash shapes (--flash-config, 43 layers), before (slot layout: every slot
//     sized for the server's max_context, --max-context) and after paging (each request holds
//     the pages of its own tokens): engine/paged_state_plan.h's arithmetic over the H200's
//     bytes less the runtime allowance. Weights, activations and graphs are not counted
//     (V4-Flash's weights do not fit one H200; an expert-parallel rank's free memory is the
//     budget that applies there). Needs no GPU.
//   consistency: the plan's pool bytes against what a GpuModel of --model reports
//     (GpuModel::StatePages), paged and slot layout.
//   tpot: p50 / p90 ms of a graph decode step (logits to the host, as DecodeStep) on --model at
//     each batch of --batches, every sequence prefilled with --prompt tokens first, slot layout
//     against paged state.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_split.h"
#include "engine/config.h"
#include "engine/gpu/gpu_model.h"
#include "engine/memory_plan.h"
#include "engine/paged_state_plan.h"
#include "engine/weights.h"

namespace pdserve {
namespace {

using engine::gpu::GpuModel;
using engine::gpu::GpuModelOptions;

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

void Capacity(const engine::ModelConfig& flash, int64_t max_context) {
  const int64_t budget = engine::kH200Bytes - engine::kRuntimeAllowance;
  const engine::PagedStateBytes b = engine::GpuPagedStateBytes(flash);
  std::printf(
      "\n| V4-Flash (%lld layers), server max_context %lld, state budget %.1f GiB, fixed per "
      "request %.1f MiB | request state (MiB) | requests that fit: slot layout | paged |\n"
      "|---|---|---|---|\n",
      static_cast<long long>(flash.num_hidden_layers), static_cast<long long>(max_context),
      static_cast<double>(budget) / (1 << 30), static_cast<double>(b.per_slot) / (1 << 20));
  for (int64_t tokens : {int64_t{8192}, int64_t{32768}, int64_t{131072}}) {
    if (tokens > max_context) {
      std::printf("| %lldK-token requests | past max_context | - | - |\n",
                  static_cast<long long>(tokens / 1024));
      continue;
    }
    const int64_t before =
        engine::ConcurrentRequestsThatFit(flash, tokens, max_context, budget, false);
    const int64_t after =
        engine::ConcurrentRequestsThatFit(flash, tokens, max_context, budget, true);
    std::printf("| %lldK-token requests | %.1f | %lld | %lld |\n",
                static_cast<long long>(tokens / 1024),
                static_cast<double>(b.Request(tokens)) / (1 << 20), static_cast<long long>(before),
                static_cast<long long>(after));
  }
}

std::unique_ptr<GpuModel> Make(const engine::ModelConfig& config, const engine::Weights& weights,
                               int64_t slots, int64_t max_context, bool paged) {
  GpuModelOptions o;
  o.slots = slots;
  o.max_context = max_context;
  o.max_chunk = 256;
  o.paged_state = paged;
  auto gpu = GpuModel::Create(config, weights, o);
  if (!gpu.ok()) {
    std::fprintf(stderr, "GpuModel::Create: %s\n", gpu.status().ToString().c_str());
    return nullptr;
  }
  return std::move(*gpu);
}

int Consistency(const engine::ModelConfig& config, GpuModel& gpu, bool paged) {
  int64_t engine_pages = 0;
  for (const engine::gpu::StatePageKind& k : gpu.StatePages()) {
    engine_pages += (k.pages_total + 1) * k.bytes_per_page;
  }
  int64_t plan_pages = 0;
  for (const auto& [rate, page] : engine::GpuPagedStateBytes(config).page_bytes) {
    plan_pages += (engine::PagedPoolPages(rate, gpu.slots(), gpu.max_context(), 0) + 1) * page;
  }
  const bool same = engine_pages == plan_pages;
  std::printf("| %s | %lld | %lld | %s |\n", paged ? "paged" : "slot layout",
              static_cast<long long>(engine_pages), static_cast<long long>(plan_pages),
              same ? "yes" : "NO");
  return same ? 0 : 1;
}

// Median / p90 ms of `steps` decode steps over `batch` slots prefilled with `prompt` tokens.
std::pair<double, double> Tpot(GpuModel& gpu, int64_t batch, int64_t prompt, int steps) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> id(2, static_cast<int32_t>(gpu.config().vocab_size - 1));
  std::vector<int64_t> slots;
  std::vector<int32_t> tokens;
  for (int64_t s = 0; s < batch; ++s) {
    if (!gpu.ResetSlot(s).ok()) return {-1, -1};
    for (int64_t at = 0; at < prompt; at += gpu.max_chunk()) {
      std::vector<int32_t> chunk(static_cast<size_t>(std::min(gpu.max_chunk(), prompt - at)));
      for (int32_t& t : chunk) t = id(rng);
      if (!gpu.Forward(s, chunk).ok()) return {-1, -1};
    }
    slots.push_back(s);
    tokens.push_back(id(rng));
  }
  std::vector<double> ms;
  for (int step = 0; step < steps + 3; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    auto logits = gpu.DecodeStep(slots, tokens, /*use_graph=*/true);
    const auto t1 = std::chrono::steady_clock::now();
    if (!logits.ok()) {
      std::fprintf(stderr, "DecodeStep: %s\n", logits.status().ToString().c_str());
      return {-1, -1};
    }
    if (step >= 3) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    for (int32_t& t : tokens) t = id(rng);
  }
  return {Percentile(ms, 0.5), Percentile(ms, 0.9)};
}

int Main(int argc, char** argv) {
  CLI::App app{"paged_state_bench: issue 26's capacity table and TPOT, slot layout vs paged"};
  std::string flash_dir = "tests/fixtures/v4_configs/flash";
  std::string model_dir = "models/kjv-v4-wide";
  std::string batches_arg = "1,16,64,128";
  int64_t max_context = 131072;
  int64_t prompt = 512;
  int steps = 64;
  bool capacity_only = false;
  app.add_option("--flash-config", flash_dir, "directory of the V4-Flash config.json");
  app.add_option("--model", model_dir, "model directory for consistency and TPOT");
  app.add_option("--batches", batches_arg, "decode batches, comma-separated");
  app.add_option("--max-context", max_context, "the server's max_context for the capacity table");
  app.add_option("--prompt", prompt, "tokens prefilled per sequence before timing");
  app.add_option("--steps", steps, "timed decode steps per batch");
  app.add_flag("--capacity-only", capacity_only, "print the capacity table only (no GPU)");
  CLI11_PARSE(app, argc, argv);

  auto flash = engine::ModelConfig::Load(flash_dir);
  if (!flash.ok()) {
    std::fprintf(stderr, "%s\n", flash.status().ToString().c_str());
    return 1;
  }
  Capacity(*flash, max_context);
  if (capacity_only) return 0;

  auto config = engine::ModelConfig::Load(model_dir);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  auto weights = engine::Weights::Load(model_dir, *config);
  if (!weights.ok()) {
    std::fprintf(stderr, "%s\n", weights.status().ToString().c_str());
    return 1;
  }
  std::vector<int64_t> batches;
  for (absl::string_view b : absl::StrSplit(batches_arg, ',')) {
    batches.push_back(std::stoll(std::string(b)));
  }
  const int64_t slots = *std::max_element(batches.begin(), batches.end());
  const int64_t context = std::min<int64_t>(config->max_position_embeddings, 4096);
  int failures = 0;
  std::printf("\n| %s state pools | engine bytes | plan bytes | equal |\n|---|---|---|---|\n",
              model_dir.c_str());
  std::vector<std::vector<std::pair<double, double>>> tpot(2);
  for (bool paged : {false, true}) {
    auto gpu = Make(*config, *weights, slots, context, paged);
    if (gpu == nullptr) return 1;
    failures += Consistency(*config, *gpu, paged);
    for (int64_t batch : batches) {
      std::fprintf(stderr, "%s batch %lld\n", paged ? "paged" : "slot",
                   static_cast<long long>(batch));
      tpot[paged ? 1 : 0].push_back(Tpot(*gpu, batch, prompt, steps));
    }
  }
  std::printf(
      "\n| %s, prompt %lld, graph decode | TPOT p50 ms slot layout | paged | p90 slot | "
      "p90 paged |\n|---|---|---|---|---|\n",
      model_dir.c_str(), static_cast<long long>(prompt));
  for (size_t i = 0; i < batches.size(); ++i) {
    std::printf("| batch %lld | %.3f | %.3f | %.3f | %.3f |\n", static_cast<long long>(batches[i]),
                tpot[0][i].first, tpot[1][i].first, tpot[0][i].second, tpot[1][i].second);
    if (tpot[0][i].first < 0 || tpot[1][i].first < 0) ++failures;
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) { return pdserve::Main(argc, argv); }
