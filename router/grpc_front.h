// The gRPC front of the router: pdserve.v1.Generation (proto/pdserve/v1/generate.proto) in front
// of any frontend::GenerationService. A GenerateRequest is turned into the JSON body of the
// equivalent OpenAI request and parsed by frontend::ParseRequest (router/grpc_request.h), so
// validation, error messages and defaults are exactly the HTTP front's; deltas stream back as
// GenerateResponse messages, errors as gRPC statuses carrying the OpenAI error JSON. A cancelled
// call cancels its Generation. The listener also serves reflection and grpc.health.v1
// (common/grpc_discovery.h), SERVING while the service is Ready() (re-read every 200 ms) and
// NOT_SERVING from StopServing() on.
//
// Thread-safety: Start() / Stop() from one controlling thread; the service must be thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/api_keys.h"
#include "common/deploy_config.h"
#include "frontend/api_request.h"
#include "frontend/generation_service.h"
#include "grpcpp/security/server_credentials.h"
#include "pdserve/v1/generate.pb.h"

namespace pdserve::router {

// How much of a Generate stream may wait in the router for a client that does not read it
// (docs/operations.md, "Slow stream readers"; the HTTP front's bounds, HttpServerOptions).
// Up to `stream_queue_bytes` queued nothing is checked. Beyond it the client must be taking its
// stream: a call none of whose writes completed for `stall_timeout` ends RESOURCE_EXHAUSTED with
// code "stream_stalled", one with more than `max_stream_queue_bytes` queued with
// "stream_too_slow". Checked whenever a message is queued.
struct GrpcStreamOptions {
  size_t stream_queue_bytes = size_t{8} << 20;
  size_t max_stream_queue_bytes = size_t{64} << 20;
  absl::Duration stall_timeout = absl::Seconds(20);
};

class GrpcFront {
 public:
  // Serves on host:port (0: a free port, see port()) with `credentials` (null: insecure; TLS
  // under security.tls) and the deployment's connection `limits` (common/grpc_listener.h). With
  // `api_keys`, every call needs `authorization: Bearer <key>` metadata naming one of them, else
  // UNAUTHENTICATED before anything runs.
  // Errors: Unavailable when it cannot bind. REQUIRES: `service` outlives the front.
  static absl::StatusOr<std::unique_ptr<GrpcFront>> Start(
      const std::string& host, int port, frontend::GenerationService* service,
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
      std::shared_ptr<const common::ApiKeys> api_keys = nullptr, GrpcStreamOptions stream = {},
      const config::GrpcConfig& limits = {});
  ~GrpcFront();
  int port() const { return port_; }
  // The router is draining: grpc.health.v1 says NOT_SERVING, the listener closes (another
  // process may bind the port when this returns) and every connection gets GOAWAY, so clients
  // send new calls on a new connection (to whoever listens then; refused while nobody does).
  // A Generate call that reached the front anyway is refused with UNAVAILABLE, code
  // "shutting_down" in the error JSON. Calls in flight still run.
  void StopServing();
  // StopServing, then waits up to `grace` for the calls in flight to end; those still running
  // then end with UNAVAILABLE "shutting_down" after the message being written (the HTTP front's
  // Drain, whose streams end with an error event) and their generations are cancelled.
  // From the controlling thread.
  void Drain(std::chrono::milliseconds grace);
  // Cancels the calls in flight (CANCELLED: "Cancelling all calls" after 1 s) and stops serving.
  // Idempotent.
  void Stop();

  class Impl;

 private:
  GrpcFront() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace pdserve::router
