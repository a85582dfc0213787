// The memory plan of one deploy-config worker (engine/memory_plan.h), shared by `pdserve plan`
// and the start of `pdserve prefill` / `pdserve decode`, which refuse, before loading anything, a
// backend-cuda worker whose GPUs cannot hold it. Thread-safe: reads files only.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/deploy_config.h"
#include "engine/memory_plan.h"

namespace pdserve::cli {

// The largest decode --max-batch the plan takes (WorkerPlanRequest refuses more: its byte sums
// would overflow).
inline constexpr int64_t kMaxPlanBatch = int64_t{1} << 20;

struct WorkerPlanOptions {
  bool prefill = false;
  int64_t max_batch = 64;   // decode: `pdserve decode --max-batch`
  int64_t pool_tokens = 0;  // decode: `--pool-tokens` (0: max_batch * context length)
  int64_t max_context = 0;  // 0: what today's worker uses (see WorkerPlanRequest)
  // decode: paged device state tokens (`pdserve serve --state-tokens`; 0: the worker's own
  // state_tokens, which must be resolved (ResolveStateTokens) when it is auto).
  int64_t state_tokens = 0;
  int64_t gpu_bytes = engine::kH200Bytes;
  // The deploy config's transfer.cuda_ipc and config::CudaIpcArenaTokens (WithCudaIpc):
  // the arena / device page pool the worker allocates (runtime::PlanCudaIpcMemory). `pdserve
  // serve` (no transfer) leaves them off.
  std::string transfer_cuda_ipc = "off";
  int64_t cuda_ipc_arena_tokens = 0;
  bool transfer_early_import = true;  // transfer.early_import: a decode worker's pool needs it
};

// `options` with the transfer.cuda_ipc settings of `deploy`.
WorkerPlanOptions WithCudaIpc(WorkerPlanOptions options, const config::DeployConfig& deploy);

// The request today's worker makes of its GPUs: prefill one slot per rank of
// max_position_embeddings tokens; decode ceil(max_batch / GPUs) slots per rank of
// min(max_position_embeddings, pool_tokens) tokens (runtime/cuda/gpu_backend.cc), unless
// options.max_context is set; plus the CUDA IPC memory of options' transfer.cuda_ipc.
// InvalidArgument for a bad `gpus` value.
absl::StatusOr<engine::PlanRequest> WorkerPlanRequest(const config::WorkerConfig& worker,
                                                      const engine::ModelConfig& config,
                                                      const WorkerPlanOptions& options);

// OK for a cpu worker; for a cuda worker engine::CheckPlanFits over the model's config.json and
// checkpoint headers (ResourceExhausted naming what to change), or the files' errors.
absl::Status CheckWorkerMemory(const config::WorkerConfig& worker, const std::string& model_dir,
                               const WorkerPlanOptions& options);

// The paged device state tokens a decode (or `pdserve serve`) worker's GPU engine gets:
// worker.state_tokens, or for config::kAutoStateTokens engine::AutoStateTokens of the worker's
// plan (WorkerPlanRequest with `options`) over the model's config.json and checkpoint headers.
// Errors: the files', WorkerPlanRequest's, AutoStateTokens' (no room for paged state).
absl::StatusOr<int64_t> ResolveStateTokens(const config::WorkerConfig& worker,
                                           const std::string& model_dir,
                                           const WorkerPlanOptions& options);

}  // namespace pdserve::cli
