// `pdserve decode`: a decode worker (pdserve.worker.v1.DecodeWorker) of a deployment.
//
//   pdserve decode --config F [--name NAME] [--port N] [--metrics-port N] [--max-batch N]
//                  [--pool-tokens T] [--drain-timeout-ms MS]
//
// Serves the gRPC service on the config entry's host:port (the first decode entry, or NAME),
// /metrics and /health on its metrics_port, until SIGINT or SIGTERM: then it drains (Health says
// DRAINING, new work gets UNAVAILABLE, running requests get --drain-timeout-ms, default 30 s, to
// finish; streams still open then end with finish_reason "error", "worker shutting down") and
// exits 0. With backend cuda the entry's `state_tokens` (auto: engine::AutoStateTokens) sizes the
// GPU engine's paged state pools and Reserve reserves each request's pages there. The model comes
// from the config's model section, the lease from transfer.lease_ms, the degeneration action from
// guards.degeneration_action, paranoid mode and the canary from guards.paranoid /
// guards.canary_every, the reference switches from guards.reference_kernels (docs/guards.md).
// UCX_TLS picks the transport; PDSERVE_TEST_SCRAMBLE_INDEXER=1 is a test-only wrong indexer,
// decode/test_faults.h the test-only stalled loop.
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "cli/command_registry.h"
#include "cli/cuda_ipc_setup.h"
#include "cli/memory_check.h"
#include "common/fatal_signal.h"
#include "common/status.h"
#include "decode/decode_worker.h"
#include "kvtransfer/ucx/ucx_lane.h"
#include "spdlog/spdlog.h"
#ifdef PDSERVE_HAVE_CUDA_BACKEND
#include "runtime/cuda/gpu_backend.h"
#endif
#include "worker/worker_process.h"

namespace pdserve::cli {
namespace {

struct DecodeFlags {
  worker::WorkerFlags worker;
  int64_t max_batch = 64;
  int64_t pool_tokens = 0;
};

absl::Status RunDecode(const DecodeFlags& flags) {
  worker::LogToStderr("decode");
  worker::BlockStopSignals();
  PDSERVE_ASSIGN_OR_RETURN(worker::WorkerEntry entry,
                           worker::LoadWorkerEntry(flags.worker, "decode"));
  const WorkerPlanOptions plan =
      WithCudaIpc(WorkerPlanOptions{.max_batch = flags.max_batch, .pool_tokens = flags.pool_tokens},
                  entry.deploy);
  // `state_tokens: auto`: what the memory plan leaves free; then, before anything loads, a cuda
  // worker whose GPUs cannot hold it is refused (`pdserve plan`).
  const bool auto_state = entry.worker.state_tokens == config::kAutoStateTokens;
  PDSERVE_ASSIGN_OR_RETURN(entry.worker.state_tokens,
                           ResolveStateTokens(entry.worker, entry.model_dir, plan));
  if (auto_state) {
    spdlog::info(
        "state_tokens auto: {} tokens of paged device state (the memory plan's {} GiB "
        "GPU less weights, activations, graphs and allowances, less a {}% margin)",
        entry.worker.state_tokens, plan.gpu_bytes / engine::kGiB,
        static_cast<int>(engine::kAutoStateMargin * 100));
  }
  PDSERVE_RETURN_IF_ERROR(CheckWorkerMemory(entry.worker, entry.model_dir, plan));
  decode::DecodeWorkerOptions options;
  options.model_dir = entry.model_dir;
  options.model_name = entry.model_name;
  options.max_batch = flags.max_batch;
  options.pool_tokens = flags.pool_tokens;
  options.lease = absl::Milliseconds(entry.deploy.lease_ms);
  options.transfer_lanes = entry.deploy.transfer_lanes > 0
                               ? entry.deploy.transfer_lanes
                               : kv::DefaultTransferLanes(std::thread::hardware_concurrency());
  PDSERVE_ASSIGN_OR_RETURN(options.transfer_ucx_protocols,
                           kv::ParseUcxProtocols(entry.deploy.transfer_ucx_protocols));
  options.transfer_register_pages = entry.deploy.transfer_register_pages;
  options.transfer_shm_pull = entry.deploy.transfer_shm_pull;
  // A CUDA engine's state pages are copied to host memory and sent from (landed in) there.
  options.transfer_path = entry.worker.backend == "cuda" ? "host-staged" : "host";
  options.runner.degeneration = entry.deploy.guards.degeneration_action == "stop"
                                    ? runtime::DegenerationAction::kStop
                                    : runtime::DegenerationAction::kFlag;
  options.runner.paranoid = entry.deploy.guards.paranoid;
  options.runner.early_import = entry.deploy.transfer_early_import;
  options.canary_every = entry.deploy.guards.canary_every;
  options.runner.canary_tolerance = entry.deploy.guards.canary_tolerance;
  options.faults = decode::TestFaults::FromEnvironment();
  PDSERVE_ASSIGN_OR_RETURN(options.model,
                           worker::WorkerModelOptions(entry.deploy, entry.worker.backend));
  if (entry.worker.backend == "cuda") {
#ifdef PDSERVE_HAVE_CUDA_BACKEND
    // LoadWorkerEntry set CUDA_VISIBLE_DEVICES to the worker's GPUs: devices 0 .. n-1 here,
    // one rank each (several: one expert-parallel group, NCCL where it loads).
    runtime::GpuBackendOptions gpu;
    PDSERVE_ASSIGN_OR_RETURN(gpu.devices, worker::CudaDevices(entry.worker));
    spdlog::info(
        "backend cuda: decode on CUDA_VISIBLE_DEVICES={}, {} rank(s) (runtime::GpuStepRunner)",
        entry.worker.gpus, gpu.devices.size());
    gpu.reference_pieces = options.model.reference_pieces;
    gpu.indexer_fault = options.model.indexer_fault;
    if (entry.worker.weights == "fp8") gpu.weight_format = engine::gpu::WeightFormat::kFp8Block;
    if (entry.worker.fp8_activations == "fp8") {
      gpu.fp8_activations = engine::gpu::Fp8Activations::kFp8;
    }
    options.runner_factory = runtime::GpuRunnerFactory(gpu);
    options.device_landing = DecodeCudaIpc(entry.deploy);
    // Reserve counts the GPU engine's device page pools (state_tokens; 0: every slot full).
    options.device_state_tokens = entry.worker.state_tokens;
    if (entry.worker.state_tokens > 0) {
      spdlog::info("paged device state: {} tokens over all requests (state_tokens)",
                   entry.worker.state_tokens);
    }
#else
    return absl::FailedPreconditionError(
        "backend cuda: this pdserve was built without the CUDA backend (-DPDSERVE_CUDA=OFF, or no "
        "nvcc at configure time)");
#endif
  }
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<decode::DecodeWorker> service,
                           decode::DecodeWorker::Create(options));
  worker::WorkerHooks hooks;
  decode::DecodeWorker* w = service.get();
  hooks.metrics_text = [w] { return w->MetricsText(); };
  hooks.healthy = [] { return true; };
  hooks.loops = {&w->progress()};
  hooks.draining = [w] { w->BeginDrain(); };
  hooks.stopping = [w](absl::Duration timeout) { w->Drain(timeout); };
  absl::Status status = worker::RunWorker(entry, "decode", service.get(),
                                          pdserve::worker::v1::DecodeWorker::service_full_name(),
                                          hooks, flags.worker.drain_timeout_ms);
  service->Stop();
  return status;
}

const CommandRegistrar kRegistrar([](CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<DecodeFlags>();
  CLI::App* cmd = app.add_subcommand("decode", "Run a decode worker of a PD deployment");
  cmd->add_option("--config", flags->worker.config_path, "Deploy config YAML")->required();
  cmd->add_option("--name", flags->worker.name, "Decode worker entry (default: the first)");
  cmd->add_option("--port", flags->worker.port, "Override the entry's gRPC port (0: any free port)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--metrics-port", flags->worker.metrics_port,
                  "Override the entry's metrics port (0: no HTTP endpoint)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--drain-timeout-ms", flags->worker.drain_timeout_ms,
                  "On SIGTERM / SIGINT: how long running requests may take to finish")
      ->capture_default_str()
      ->check(NonNegative());
  cmd->add_option("--max-batch", flags->max_batch, "Requests holding pages at once")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--pool-tokens", flags->pool_tokens,
                  "Tokens of state the page pool holds (0: max-batch * context length)")
      ->capture_default_str()
      ->check(NonNegative());
  cmd->callback([flags, exit_code] {
    common::IgnoreBrokenPipe();  // a log reader that went away must not stop a server
    const absl::Status status = RunDecode(*flags);
    if (!status.ok()) {
      std::fprintf(stderr, "pdserve decode: %s\n", status.ToString().c_str());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace pdserve::cli
