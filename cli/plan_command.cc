// `pdserve plan --config F`: the memory plan of every backend-cuda worker of a deployment
// (engine/memory_plan.h): per GPU the bytes for weights, state, activations and CUDA graphs in the
// checkpoint's stored precision and as today's CUDA engine holds them, the largest batch x context
// that fit, and the host page pool. Exit status 1, with the reason on stderr, when a worker does
// not fit as the engine is today; 0 otherwise. Nothing is loaded: config.json and the
// safetensors headers are read.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cli/command_registry.h"
#include "cli/memory_check.h"
#include "common/deploy_config.h"
#include "common/status.h"
#include "engine/memory_plan.h"
#include "runtime/cuda_ipc_memory.h"

namespace pdserve::cli {

namespace {
// GPU state bytes past which WorkerPlanRequest refuses (the plan's sums stay far from 2^63).
constexpr int64_t kMaxPlanStateBytes = int64_t{1} << 58;
}  // namespace

absl::StatusOr<engine::PlanRequest> WorkerPlanRequest(const config::WorkerConfig& worker,
                                                      const engine::ModelConfig& config,
                                                      const WorkerPlanOptions& options) {
  PDSERVE_ASSIGN_OR_RETURN(std::vector<int> gpus, config::ParseGpuList(worker.gpus));
  // Past these the plan's byte sums overflow (a batch of 1e11 planned -6.9e9 GiB and "fits").
  if (!options.prefill && options.max_batch > kMaxPlanBatch) {
    return absl::InvalidArgumentError(absl::StrCat(worker.name, ": --max-batch ", options.max_batch,
                                                   " is more than ", kMaxPlanBatch,
                                                   " (the plan's limit)"));
  }
  if (options.max_context > config.max_position_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat(worker.name, ": --max-context ", options.max_context,
                     " is more than the model's context (max_position_embeddings ",
                     config.max_position_embeddings, ")"));
  }
  engine::PlanRequest q;
  q.worker = worker.name;
  q.prefill = options.prefill;
  q.world = static_cast<int>(gpus.size());
  q.max_batch = options.prefill ? 1 : options.max_batch;
  q.gpu_bytes = options.gpu_bytes;
  q.fp8_weights = worker.weights == "fp8";
  q.fp8_activations = worker.fp8_activations == "fp8";
  // No deploy key: the worker's engine takes the option from its environment.
  q.fp8_shared_act_quant = engine::SharedActQuantOption(false);
  // Activations for the worker's prefill chunk (runtime::GpuMaxChunk), else the default 256 rows.
  if (worker.prefill_chunk > 0) q.max_chunk = worker.prefill_chunk;
  // The flag, else the decode worker's own key.
  q.state_tokens = options.prefill            ? 0
                   : options.state_tokens > 0 ? options.state_tokens
                                              : std::max<int64_t>(worker.state_tokens, 0);
  const int64_t pool = options.pool_tokens > 0 ? options.pool_tokens
                                               : options.max_batch * config.max_position_embeddings;
  q.max_context = options.max_context > 0 ? options.max_context
                  : options.prefill       ? config.max_position_embeddings
                                          : std::min(config.max_position_embeddings, pool);
  // A model whose context is 2^32 tokens at a batch of 2^20 still overflows the state's bytes.
  const int64_t slots = (q.max_batch + std::max(q.world, 1) - 1) / std::max(q.world, 1) + 1;
  if (static_cast<double>(slots) *
          static_cast<double>(engine::GpuSlotStateBytes(config, q.max_context).total()) >
      static_cast<double>(kMaxPlanStateBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        worker.name, ": ", slots - 1, " slot(s) of ", q.max_context,
        " tokens need more than 2^58 bytes of state per GPU (the plan's limit); lower --max-batch "
        "or --max-context"));
  }
  PDSERVE_ASSIGN_OR_RETURN(
      const runtime::CudaIpcMemory ipc,
      runtime::PlanCudaIpcMemory(config, options.transfer_cuda_ipc, options.cuda_ipc_arena_tokens,
                                 worker.backend, options.prefill, q.world,
                                 options.transfer_early_import));
  q.cuda_ipc_arena_bytes = ipc.arena_bytes;
  q.cuda_ipc_pool_bytes = ipc.pool_bytes;
  q.cuda_ipc_tokens = ipc.tokens;
  return q;
}

WorkerPlanOptions WithCudaIpc(WorkerPlanOptions options, const config::DeployConfig& deploy) {
  options.transfer_cuda_ipc = config::EffectiveCudaIpc(deploy);
  options.cuda_ipc_arena_tokens = config::CudaIpcArenaTokens(deploy);
  options.transfer_early_import = deploy.transfer_early_import;
  return options;
}

absl::Status CheckWorkerMemory(const config::WorkerConfig& worker, const std::string& model_dir,
                               const WorkerPlanOptions& options) {
  if (worker.backend != "cuda") return absl::OkStatus();
  PDSERVE_ASSIGN_OR_RETURN(engine::ModelConfig config, engine::ModelConfig::Load(model_dir));
  PDSERVE_ASSIGN_OR_RETURN(engine::WeightBytes weights, engine::PlanWeightBytes(model_dir, config));
  PDSERVE_ASSIGN_OR_RETURN(engine::PlanRequest q, WorkerPlanRequest(worker, config, options));
  return engine::CheckPlanFits(config, weights, q);
}

absl::StatusOr<int64_t> ResolveStateTokens(const config::WorkerConfig& worker,
                                           const std::string& model_dir,
                                           const WorkerPlanOptions& options) {
  if (worker.state_tokens != config::kAutoStateTokens) return worker.state_tokens;
  PDSERVE_ASSIGN_OR_RETURN(engine::ModelConfig config, engine::ModelConfig::Load(model_dir));
  PDSERVE_ASSIGN_OR_RETURN(engine::WeightBytes weights, engine::PlanWeightBytes(model_dir, config));
  config::WorkerConfig fixed = worker;
  fixed.state_tokens = 0;
  PDSERVE_ASSIGN_OR_RETURN(engine::PlanRequest q, WorkerPlanRequest(fixed, config, options));
  return engine::AutoStateTokens(config, weights, q);
}

namespace {

// HBM per GPU that --gpu-memory-gib accepts at most (1 PiB; an H200 has 140 GiB).
constexpr int64_t kMaxGpuMemoryGib = int64_t{1} << 20;

struct PlanFlags {
  std::string config_path;
  std::string model_dir;  // overrides the deploy config's model.path
  WorkerPlanOptions options;
  double gpu_memory_gib = 140.0;
};

absl::StatusOr<bool> RunPlan(PlanFlags flags) {
  // NaN, infinity or a figure past int64 bytes would cast to nonsense (-8589934592 GiB).
  if (!(flags.gpu_memory_gib > 0 &&
        flags.gpu_memory_gib <= static_cast<double>(kMaxGpuMemoryGib))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu-memory-gib: must be in (0, ", kMaxGpuMemoryGib, "], got ", flags.gpu_memory_gib));
  }
  PDSERVE_ASSIGN_OR_RETURN(config::DeployConfig deploy,
                           config::LoadDeployConfig(flags.config_path));
  const std::string model_dir = flags.model_dir.empty() ? deploy.model_path : flags.model_dir;
  PDSERVE_ASSIGN_OR_RETURN(engine::ModelConfig config, engine::ModelConfig::Load(model_dir));
  PDSERVE_ASSIGN_OR_RETURN(engine::WeightBytes weights, engine::PlanWeightBytes(model_dir, config));
  flags.options.gpu_bytes = static_cast<int64_t>(flags.gpu_memory_gib * engine::kGiB);
  flags.options = WithCudaIpc(flags.options, deploy);
  std::printf("model %s: %lld layers, %lld routed experts\n", model_dir.c_str(),
              static_cast<long long>(config.num_hidden_layers),
              static_cast<long long>(config.n_routed_experts));
  bool fits = true;
  for (bool prefill : {true, false}) {
    for (const config::WorkerConfig& w : prefill ? deploy.prefill : deploy.decode) {
      if (w.backend != "cuda") {
        std::printf("%s: backend cpu: no GPU (host page pool and fp32 weights only)\n",
                    w.name.c_str());
        continue;
      }
      WorkerPlanOptions o = flags.options;
      o.prefill = prefill;
      config::WorkerConfig resolved = w;
      if (!prefill && o.state_tokens == 0 && w.state_tokens == config::kAutoStateTokens) {
        const absl::StatusOr<int64_t> tokens = ResolveStateTokens(w, model_dir, o);
        if (!tokens.ok()) {
          std::fprintf(stderr, "pdserve plan: refused: %s\n",
                       std::string(tokens.status().message()).c_str());
          fits = false;
          continue;
        }
        resolved.state_tokens = *tokens;
        std::printf(
            "%s: state_tokens auto: %lld tokens (the GPU less weights, activations, "
            "graphs and allowances, less a %d%% margin)\n",
            w.name.c_str(), static_cast<long long>(resolved.state_tokens),
            static_cast<int>(engine::kAutoStateMargin * 100));
      }
      PDSERVE_ASSIGN_OR_RETURN(engine::PlanRequest q, WorkerPlanRequest(resolved, config, o));
      std::printf("%s", engine::FormatPlan(config, weights, q).c_str());
      if (absl::Status s = engine::CheckPlanFits(config, weights, q); !s.ok()) {
        std::fprintf(stderr, "pdserve plan: refused: %s\n", std::string(s.message()).c_str());
        fits = false;
      }
    }
  }
  return fits;
}

const CommandRegistrar kPlan([](CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* cmd = app.add_subcommand("plan", "Memory plan of a deployment's GPU workers");
  cmd->add_option("--config", flags->config_path, "Deploy config YAML")->required();
  cmd->add_option("--model", flags->model_dir, "Model directory (default: the config's)");
  cmd->add_option("--max-batch", flags->options.max_batch, "Decode sequences (pdserve decode)")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--pool-tokens", flags->options.pool_tokens, "As pdserve decode --pool-tokens")
      ->check(NonNegative());
  cmd->add_option("--state-tokens", flags->options.state_tokens,
                  "Decode: tokens of paged device state (as pdserve serve --state-tokens; "
                  "default: each decode worker's state_tokens; 0: every slot full)")
      ->check(NonNegative());
  cmd->add_option("--max-context", flags->options.max_context,
                  "Tokens per sequence (default: what the worker uses today)")
      ->check(NonNegative());
  cmd->add_option("--gpu-memory-gib", flags->gpu_memory_gib, "HBM per GPU (H200: 140)")
      ->capture_default_str();
  cmd->callback([flags, exit_code] {
    const absl::StatusOr<bool> fits = RunPlan(*flags);
    if (!fits.ok()) std::fprintf(stderr, "pdserve plan: %s\n", fits.status().ToString().c_str());
    *exit_code = fits.ok() && *fits ? 0 : 1;
  });
});

}  // namespace
}  // namespace pdserve::cli
