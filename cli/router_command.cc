// `pdserve router`: the OpenAI-compatible HTTP front of a disaggregated deployment. It prepares
// requests (tokenization, chat template, sampling defaults), picks a prefill and a decode worker
// for each choice and streams the decode worker's tokens back as text (router/service.h).
//
//   pdserve router --config FILE [--port P]
//
// Serves on router.host:router.http_port (--port overrides; 0 picks a free port) and prints
// "pdserve router: listening on http://HOST:PORT" once bound; with router.grpc_port > 0 also the
// gRPC front pdserve.v1.Generation (router/grpc_front.h). Under systemd (Type=notify) it
// sends READY=1 once the workers are healthy (or at once if they are not yet: /ready says when)
// and WATCHDOG=1 keep-alives while its HTTP event loop runs. Serves until SIGINT or SIGTERM, then
// exits 0.
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "cli/command_registry.h"
#include "common/api_keys.h"
#include "common/deploy_config.h"
#include "common/fatal_signal.h"
#include "common/host_port.h"
#include "common/server_log.h"
#include "common/status.h"
#include "common/systemd_notify.h"
#include "common/tls_credentials.h"
#include "frontend/http_server.h"
#include "router/grpc_front.h"
#include "router/service.h"

namespace pdserve::cli {
namespace {

struct RouterCommandOptions {
  std::string config;
  int port = -1;  // -1: the config's router.http_port
  int drain_timeout_ms = 10000;
};

absl::Status RunRouter(const RouterCommandOptions& options) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  PDSERVE_ASSIGN_OR_RETURN(config::DeployConfig config, config::LoadDeployConfig(options.config));
  if (const std::string idle = config::IdleChannelWarning(config); !idle.empty()) {
    std::fprintf(stderr, "pdserve router: warning: %s\n", idle.c_str());
  }
  PDSERVE_ASSIGN_OR_RETURN(router::RouterOptions router_options, router::OptionsFromConfig(config));
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<router::RouterService> service,
                           router::RouterService::Create(router_options));
  frontend::HttpServerOptions http;
  http.host = config.router.host;
  http.port = static_cast<uint16_t>(options.port >= 0 ? options.port : config.router.http_port);
  http.max_body_bytes = static_cast<size_t>(config.router.max_body_bytes);
  http.allow_half_close = config.router.allow_half_close;
  // security (docs/security.md): API keys on both fronts, TLS on both when configured.
  std::shared_ptr<const common::ApiKeys> api_keys;
  if (!config.security.api_keys_file.empty()) {
    PDSERVE_ASSIGN_OR_RETURN(api_keys, common::ApiKeys::LoadFile(config.security.api_keys_file));
  }
  http.api_keys = api_keys;
  http.tls_cert_file = config.security.tls_cert_file;
  http.tls_key_file = config.security.tls_key_file;
  PDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> front_credentials,
                           common::FrontServerCredentials(config.security));
  // The HTTP front's event loop is the router's work loop that the systemd watchdog watches.
  ProgressHeartbeat event_loop;
  http.heartbeat = &event_loop;
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<frontend::HttpServer> server,
                           frontend::HttpServer::Start(http, service.get()));
  // Both fronts are bound before either is announced: a gRPC port that cannot be bound ends the
  // router with that error, never after a "listening" line that a launcher would trust.
  std::unique_ptr<router::GrpcFront> grpc_front;
  if (config.router.grpc_port > 0) {
    PDSERVE_ASSIGN_OR_RETURN(
        grpc_front,
        router::GrpcFront::Start(config.router.host, config.router.grpc_port, service.get(),
                                 front_credentials, api_keys, {}, config.grpc));
  }
  std::printf("pdserve router: listening on %s://%s\n",
              config.security.front_tls() ? "https" : "http",
              common::HostPort(http.host, server->port()).c_str());
  if (grpc_front) {
    std::printf("pdserve router: gRPC (pdserve.v1.Generation) on %s\n",
                common::HostPort(config.router.host, grpc_front->port()).c_str());
  }
  std::fflush(stdout);
  systemd::Notifier notifier;
  notifier.Ready();
  notifier.StartWatchdog({&event_loop});
  int received = 0;
  sigwait(&signals, &received);
  std::fprintf(stderr, "pdserve router: signal %d, stopping\n", received);
  notifier.Stopping();
  // Both fronts take no new requests; running ones get drain_timeout_ms in all to finish, then an
  // SSE error event (never a stream cut mid-event) or UNAVAILABLE shutting_down on gRPC.
  const auto drain_end =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(options.drain_timeout_ms);
  if (grpc_front) grpc_front->StopServing();
  server->Drain(std::chrono::milliseconds(options.drain_timeout_ms));
  if (grpc_front) {
    grpc_front->Drain(std::max(std::chrono::milliseconds(0),
                               std::chrono::duration_cast<std::chrono::milliseconds>(
                                   drain_end - std::chrono::steady_clock::now())));
    grpc_front->Stop();
  }
  server->Stop();
  return absl::OkStatus();
}

const CommandRegistrar kRegistrar([](CLI::App& app, int* exit_code) {
  auto o = std::make_shared<RouterCommandOptions>();
  CLI::App* cmd = app.add_subcommand("router", "Run the router of a prefill/decode deployment");
  cmd->add_option("--config", o->config, "Deployment config (YAML, deploy/README.md)")->required();
  cmd->add_option("--port", o->port, "HTTP port (overrides router.http_port; 0: any free port)")
      ->check(CLI::Range(0, 65535));
  cmd->add_option("--drain-timeout-ms", o->drain_timeout_ms,
                  "On SIGTERM / SIGINT: how long running HTTP requests may finish before they end "
                  "with an error event")
      ->capture_default_str()
      ->check(NonNegative());
  cmd->callback([o, exit_code] {
    common::IgnoreBrokenPipe();              // a log reader that went away must not stop a server
    common::UseServerLog("pdserve-router");  // a stopped reader must not block it
    const absl::Status status = RunRouter(*o);
    if (!status.ok()) {
      std::fprintf(stderr, "pdserve router: %s\n", status.ToString().c_str());
      *exit_code = 1;
    }
  });
});

}  // namespace
}  // namespace pdserve::cli
