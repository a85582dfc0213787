#include "worker/worker_process.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_discovery.h"
#include "common/grpc_listener.h"
#include "common/host_port.h"
#include "common/metrics_http_server.h"
#include "common/server_log.h"
#include "common/status.h"
#include "common/systemd_notify.h"
#include "common/tls_credentials.h"
#include "kernels/cpu/parallel.h"
#include "spdlog/spdlog.h"
#include "worker/transfer_peer.h"

namespace pdserve::worker {

absl::StatusOr<WorkerEntry> LoadWorkerEntry(const WorkerFlags& flags, const std::string& role) {
  absl::StatusOr<config::DeployConfig> deploy = config::LoadDeployConfig(flags.config_path);
  if (!deploy.ok()) return deploy.status();
  const std::vector<config::WorkerConfig>& workers =
      role == "prefill" ? deploy->prefill : deploy->decode;
  WorkerEntry entry;
  bool found = false;
  for (const config::WorkerConfig& w : workers) {
    if (flags.name.empty() || w.name == flags.name) {
      entry.worker = w;
      found = true;
      break;
    }
  }
  if (!found) {
    return absl::NotFoundError(
        absl::StrCat(flags.config_path, " has no ", role, " worker named '", flags.name, "'"));
  }
  // Either worker runs the CUDA engine (runtime/cuda, runtime/cuda) on its GPUs: one GPU, or
  // several as one expert-parallel group. The worker's GPUs are devices 0 .. n-1 of this process;
  // set before any CUDA call.
  if (entry.worker.backend == "cuda") {
    setenv("CUDA_VISIBLE_DEVICES", entry.worker.gpus.c_str(), /*overwrite=*/1);
  }
  // threads: 0 leaves every core to the engine's pool and OpenBLAS. Before any thread starts.
  if (entry.worker.threads > 0 && !kernels::cpu::SetNumThreads(entry.worker.threads)) {
    return absl::InternalError("threads: the CPU thread pool had already started");
  }
  // NVLink multicast stays off in every pdserve process, whatever the environment says (a
  // program that uses it can take a host's shared GPUs out of service).
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  if (flags.port >= 0) entry.worker.port = flags.port;
  if (flags.metrics_port >= 0) entry.worker.metrics_port = flags.metrics_port;
  entry.model_dir = std::filesystem::absolute(deploy->model_path).lexically_normal().string();
  entry.model_name = deploy->served_name.empty()
                         ? std::filesystem::path(deploy->model_path).filename().string()
                         : deploy->served_name;
  entry.deploy = std::move(*deploy);
  // A worker configured on a loopback address keeps its UCX traffic on the loopback device too;
  // otherwise UCX's tcp transport also listens on, and may connect through, the host's other
  // interfaces. An operator's own UCX_NET_DEVICES wins. Runs before any thread starts.
  const std::string& host = entry.worker.host;
  if ((absl::StartsWith(host, "127.") || host == "localhost" || host == "::1") &&
      std::getenv("UCX_NET_DEVICES") == nullptr) {
    setenv("UCX_NET_DEVICES", "lo", /*overwrite=*/0);
  }
  return entry;
}

absl::StatusOr<std::vector<int>> CudaDevices(const config::WorkerConfig& worker) {
  absl::StatusOr<std::vector<int>> gpus = config::ParseGpuList(worker.gpus);
  if (!gpus.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker '", worker.name, "': gpus \"",
                                                   worker.gpus, "\" ", gpus.status().message()));
  }
  std::vector<int> devices(gpus->size());
  for (size_t i = 0; i < devices.size(); ++i) devices[i] = static_cast<int>(i);
  return devices;
}

void LogToStderr(const std::string& role) { common::UseServerLog("pdserve-" + role); }

void BlockStopSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

absl::Status RunWorker(const WorkerEntry& entry, const std::string& role, grpc::Service* service,
                       const std::string& service_name, const WorkerHooks& hooks,
                       int64_t drain_timeout_ms) {
  rpc::EnableGrpcDiscovery();
  grpc::ServerBuilder builder;
  int bound_port = 0;
  rpc::ApplyConnectionLimits(entry.deploy.grpc, builder);
  // The router pings every 2 s to find dead links (router/worker_pool.cc); without these a
  // server answers pings that come more often than every 5 minutes with GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  // Mutual TLS under security.cluster_tls: only callers with the cluster's certificate get in.
  PDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                           common::ClusterServerCredentials(entry.deploy.security));
  builder.AddListeningPort(common::HostPort(entry.worker.host, entry.worker.port), credentials,
                           &bound_port);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve gRPC on ", common::HostPort(entry.worker.host, entry.worker.port)));
  }
  // The model is loaded and the service registered: ready until the drain.
  rpc::SetServing(*server, {service_name}, true);
  std::unique_ptr<metrics::MetricsHttpServer> http;
  if (entry.worker.metrics_port > 0) {
    metrics::MetricsHttpOptions options;
    options.host = entry.worker.host;
    options.port = static_cast<uint16_t>(entry.worker.metrics_port);
    absl::StatusOr<std::unique_ptr<metrics::MetricsHttpServer>> started =
        metrics::MetricsHttpServer::Start(options, {hooks.metrics_text, hooks.healthy});
    if (!started.ok()) return started.status();
    http = std::move(*started);
  }
  std::printf("pdserve %s: serving on %s\n", role.c_str(),
              common::HostPort(entry.worker.host, bound_port).c_str());
  std::fflush(stdout);
  spdlog::info("pdserve {} '{}': gRPC on {}, metrics port {}", role, entry.worker.name,
               common::HostPort(entry.worker.host, bound_port), entry.worker.metrics_port);
  systemd::Notifier notifier;
  notifier.Ready();
  notifier.StartWatchdog(hooks.loops);

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  int received = 0;
  sigwait(&signals, &received);
  spdlog::info("pdserve {}: signal {}, draining (at most {} ms)", role, received, drain_timeout_ms);
  notifier.Stopping();
  rpc::SetServing(*server, {service_name}, false);
  if (hooks.draining) hooks.draining();
  // Both ports are free from here on, for a replacement process; the calls in flight go on.
  rpc::ServerDrain drain(server.get());
  if (http) http->StopAccepting();
  if (hooks.stopping) hooks.stopping(absl::Milliseconds(drain_timeout_ms));
  spdlog::info("pdserve {}: drained, stopping", role);
  drain.Finish(absl::Seconds(2));
  if (http) http->Stop();
  return absl::OkStatus();
}

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()),
                      IsTransferPeerFailure(status) ? kTransferPeerFailed
                      : IsTicketMismatch(status)    ? kTicketMismatch
                                                    : "");
}

spdlog::level::level_enum FailureLogLevel(const absl::Status& status, bool cancelled_by_caller) {
  return status.code() == absl::StatusCode::kCancelled && cancelled_by_caller ? spdlog::level::debug
                                                                              : spdlog::level::warn;
}

}  // namespace pdserve::worker
