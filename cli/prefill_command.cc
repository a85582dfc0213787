// `pdserve prefill`: a prefill worker (pdserve.worker.v1.PrefillWorker) of a deployment.
//
//   pdserve prefill --config F [--name NAME] [--port N] [--metrics-port N]
//                   [--drain-timeout-ms MS]
//
// Serves the gRPC service on the config entry's host:port (the first prefill entry, or NAME),
// /metrics and /health on its metrics_port, until SIGINT or SIGTERM: then it drains (Health says
// DRAINING, new work gets UNAVAILABLE, running requests get --drain-timeout-ms, default 30 s, to
// finish; streams still open then end with finish_reason "error", "worker shutting down") and
// exits 0. The model comes from the config's model section, the engine from the entry's backend
// (cpu, or cuda on its GPUs: runtime/cuda; several GPUs make one expert-parallel group), the
// reference switches from guards.reference_kernels. UCX_TLS picks the transport as for every UCX
// program. TEST-ONLY environment switches: prefill/test_faults.h.
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
#include "kvtransfer/ucx/ucx_lane.h"
#include "prefill/prefill_worker.h"
#include "spdlog/spdlog.h"
#ifdef PDSERVE_HAVE_CUDA_BACKEND
#include "runtime/cuda/gpu_prefill_engine.h"
#endif
#include "worker/worker_process.h"

namespace pdserve::cli {
namespace {

absl::Status RunPrefill(const worker::WorkerFlags& flags, int64_t max_waiting) {
  worker::LogToStderr("prefill");
  worker::BlockStopSignals();
  PDSERVE_ASSIGN_OR_RETURN(worker::WorkerEntry entry, worker::LoadWorkerEntry(flags, "prefill"));
  // Before anything loads: a cuda worker whose GPUs cannot hold it is refused (`pdserve plan`).
  PDSERVE_RETURN_IF_ERROR(
      CheckWorkerMemory(entry.worker, entry.model_dir,
                        WithCudaIpc(WorkerPlanOptions{.prefill = true}, entry.deploy)));
  prefill::PrefillWorkerOptions options;
  options.model_dir = entry.model_dir;
  options.model_name = entry.model_name;
  options.faults = prefill::TestFaults::FromEnvironment();
  options.max_waiting = max_waiting;
  options.transfer_lanes = entry.deploy.transfer_lanes > 0
                               ? entry.deploy.transfer_lanes
                               : kv::DefaultTransferLanes(std::thread::hardware_concurrency());
  PDSERVE_ASSIGN_OR_RETURN(options.transfer_ucx_protocols,
                           kv::ParseUcxProtocols(entry.deploy.transfer_ucx_protocols));
  options.transfer_register_pages = entry.deploy.transfer_register_pages;
  options.transfer_shm_pull = entry.deploy.transfer_shm_pull;
  // A CUDA engine's state pages are copied to host memory and sent from (landed in) there.
  options.transfer_path = entry.worker.backend == "cuda" ? "host-staged" : "host";
  PDSERVE_ASSIGN_OR_RETURN(options.model,
                           worker::WorkerModelOptions(entry.deploy, entry.worker.backend));
  if (entry.worker.backend == "cuda") {
#ifdef PDSERVE_HAVE_CUDA_BACKEND
    // LoadWorkerEntry set CUDA_VISIBLE_DEVICES to the worker's GPUs: devices 0 .. n-1 here,
    // one rank each (several: one expert-parallel group, NCCL where it loads).
    runtime::GpuBackendOptions gpu;
    PDSERVE_ASSIGN_OR_RETURN(gpu.devices, worker::CudaDevices(entry.worker));
    spdlog::info(
        "backend cuda: prefill on CUDA_VISIBLE_DEVICES={}, {} rank(s) (runtime::GpuPrefillEngine)",
        entry.worker.gpus, gpu.devices.size());
    gpu.reference_pieces = options.model.reference_pieces;
    gpu.indexer_fault = options.model.indexer_fault;
    if (entry.worker.weights == "fp8") gpu.weight_format = engine::gpu::WeightFormat::kFp8Block;
    if (entry.worker.fp8_activations == "fp8") {
      gpu.fp8_activations = engine::gpu::Fp8Activations::kFp8;
    }
    gpu.prefill_chunk = entry.worker.prefill_chunk;
    spdlog::info("backend cuda: prompts cut at every {} tokens (prefill_chunk{})",
                 runtime::GpuPrefillBlock(gpu, options.prefill_block),
                 entry.worker.prefill_chunk > 0 ? "" : " not set");
    options.engine_factory = runtime::GpuPrefillEngineFactory(gpu);
    options.device_arena = PrefillCudaIpc(entry.deploy);
#else
    return absl::FailedPreconditionError(
        "backend cuda: this pdserve was built without the CUDA backend (-DPDSERVE_CUDA=OFF, or no "
        "nvcc at configure time)");
#endif
  }
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<prefill::PrefillWorker> service,
                           prefill::PrefillWorker::Create(options));
  worker::WorkerHooks hooks;
  prefill::PrefillWorker* w = service.get();
  hooks.metrics_text = [w] { return w->MetricsText(); };
  hooks.healthy = [] { return true; };
  hooks.loops = {&w->progress()};
  hooks.draining = [w] { w->BeginDrain(); };
  hooks.stopping = [w](absl::Duration timeout) { w->Drain(timeout); };
  return worker::RunWorker(entry, "prefill", service.get(),
                           pdserve::worker::v1::PrefillWorker::service_full_name(), hooks,
                           flags.drain_timeout_ms);
}

const CommandRegistrar kRegistrar([](CLI::App& app, int* exit_code) {
  auto flags = std::make_shared<worker::WorkerFlags>();
  CLI::App* cmd = app.add_subcommand("prefill", "Run a prefill worker of a PD deployment");
  cmd->add_option("--config", flags->config_path, "Deploy config YAML")->required();
  cmd->add_option("--name", flags->name, "Prefill worker entry (default: the first)");
  cmd->add_option("--port", flags->port, "Override the entry's gRPC port (0: any free port)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--metrics-port", flags->metrics_port,
                  "Override the entry's metrics port (0: no HTTP endpoint)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--drain-timeout-ms", flags->drain_timeout_ms,
                  "On SIGTERM / SIGINT: how long running prefills may take to finish")
      ->capture_default_str()
      ->check(NonNegative());
  auto max_waiting = std::make_shared<int64_t>(256);
  cmd->add_option("--max-waiting", *max_waiting,
                  "Prefills that may wait for their turn; more get RESOURCE_EXHAUSTED (429)")
      ->capture_default_str()
      ->check(Positive());
  cmd->callback([flags, max_waiting, exit_code] {
    common::IgnoreBrokenPipe();  // a log reader that went away must not stop a server
    const absl::Status status = RunPrefill(*flags, *max_waiting);
    if (!status.ok()) {
      std::fprintf(stderr, "pdserve prefill: %s\n", status.ToString().c_str());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace pdserve::cli
