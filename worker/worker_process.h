// The process around a worker's gRPC service (`pdserve prefill` / `pdserve decode`): picks the
// worker's entry from the deploy config, serves the service on the entry's host:port, serves
// GET /metrics, /health and /ready on metrics_port (common/metrics_http_server.h), tells systemd
// READY=1 and keeps its watchdog fed while the worker's loops make progress, and stops cleanly on
// SIGINT / SIGTERM.
//
// Thread-safety: BlockStopSignals before any thread starts; RunWorker from the main thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/deploy_config.h"
#include "common/progress_heartbeat.h"
#include "spdlog/spdlog.h"

namespace pdserve::worker {

// What `pdserve prefill|decode` was asked to run.
struct WorkerFlags {
  std::string config_path;
  std::string name;       // empty: the first worker of the role
  int port = -1;          // -1: the entry's port (0: any free port)
  int metrics_port = -1;  // -1: the entry's metrics_port (0: none)
  // --drain-timeout-ms: on SIGTERM / SIGINT, how long running requests may take to finish.
  int64_t drain_timeout_ms = 30000;
};

// The worker's place in the deployment.
struct WorkerEntry {
  config::DeployConfig deploy;
  config::WorkerConfig worker;  // port / metrics_port with the flags' overrides applied
  std::string model_dir;        // model.path resolved against the current directory
  std::string model_name;       // model.served_name, else the model directory's name
};

// Loads the config and picks the `role` ("prefill" / "decode") entry named flags.name. For a cuda
// worker it sets CUDA_VISIBLE_DEVICES to the entry's gpus (so they are devices 0 .. n-1 here:
// CudaDevices); in every process NCCL_NVLS_ENABLE=0. Errors: the config's InvalidArgument;
// NotFound for an unknown name.
absl::StatusOr<WorkerEntry> LoadWorkerEntry(const WorkerFlags& flags, const std::string& role);

// The CUDA device ordinals of a cuda worker's GPUs once LoadWorkerEntry set CUDA_VISIBLE_DEVICES:
// 0 .. n-1 for n GPUs in `gpus` (one rank each; several make one expert-parallel group).
// InvalidArgument for a gpus value config::ParseGpuList refuses.
absl::StatusOr<std::vector<int>> CudaDevices(const config::WorkerConfig& worker);

// Sends spdlog's default logger to stderr (stdout carries only the "serving on" line), named
// after `role`, asynchronous (common/server_log.h: a stopped log reader never blocks serving).
void LogToStderr(const std::string& role);

// Blocks SIGINT and SIGTERM in this thread and every thread started after it, so RunWorker's
// sigwait receives them. Call first in the subcommand.
void BlockStopSignals();

struct WorkerHooks {
  std::function<std::string()> metrics_text;  // /metrics body
  std::function<bool()> healthy;              // /health
  // The worker's work loops (common/progress_heartbeat.h): the systemd watchdog pings only while
  // each of them makes progress.
  std::vector<const ProgressHeartbeat*> loops;
  // Called first on the signal, while the ports are still bound: turns the worker DRAINING (a
  // Reserve or Prefill that reaches it from here on gets UNAVAILABLE), so that no call the
  // server takes in the instant it stops listening starts new work there.
  std::function<void()> draining;
  // Called once the gRPC server and the metrics endpoint stopped listening (rpc::ServerDrain):
  // returns once the worker's running requests finished or `drain_timeout` passed (ending the
  // rest with a final event). Calls in flight go on meanwhile; every new call (Health, Abort, a
  // Generate not yet started) goes to whoever listens on the port then.
  std::function<void(absl::Duration drain_timeout)> stopping;
};

// Serves `service` (full name `service_name`, e.g. "pdserve.worker.v1.DecodeWorker") until
// SIGINT / SIGTERM, then drains and stops the server: hooks.draining, then its listeners (gRPC
// and metrics) close at once, so a replacement process can bind the ports, then hooks.stopping with
// absl::Milliseconds(drain_timeout_ms), then up to 2 s for the last calls before they are
// cancelled. The gRPC server takes the deploy config's connection limits (entry.deploy.grpc,
// common/grpc_listener.h). The listener also serves reflection and grpc.health.v1 (common/
// grpc_discovery.h): SERVING for "" and `service_name` once bound, NOT_SERVING from the signal on.
// Prints "pdserve ROLE: serving on HOST:PORT" (and the metrics port) to stdout once bound.
// Errors: the port cannot be bound.
absl::Status RunWorker(const WorkerEntry& entry, const std::string& role, grpc::Service* service,
                       const std::string& service_name, const WorkerHooks& hooks,
                       int64_t drain_timeout_ms);

// grpc::Status with the absl status' code and message, and error_details kTransferPeerFailed
// or kTicketMismatch for a status MarkTransferPeerFailure / MarkTicketMismatch marked
// (worker/transfer_peer.h).
grpc::Status ToGrpc(const absl::Status& status);

// The level a worker logs a failed RPC at: debug for a CANCELLED `status` that the caller asked
// for (`cancelled_by_caller`: the router's Abort, or the client cancelled the call; routine, one
// per client that hangs up, and counted in the failures metric), warn for everything else.
spdlog::level::level_enum FailureLogLevel(const absl::Status& status, bool cancelled_by_caller);

}  // namespace pdserve::worker
