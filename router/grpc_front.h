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

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/api_keys.h"
#include "frontend/api_request.h"
#include "frontend/generation_service.h"
#include "grpcpp/security/server_credentials.h"
#include "pdserve/v1/generate.pb.h"

namespace pdserve::router {

class GrpcFront {
 public:
  // Serves on host:port (0: a free port, see port()) with `credentials` (null: insecure; TLS
  // under security.tls). With `api_keys`, every call needs `authorization: Bearer <key>`
  // metadata naming one of them, else UNAUTHENTICATED before anything runs.
  // Errors: Unavailable when it cannot bind. REQUIRES: `service` outlives the front.
  static absl::StatusOr<std::unique_ptr<GrpcFront>> Start(
      const std::string& host, int port, frontend::GenerationService* service,
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
      std::shared_ptr<const common::ApiKeys> api_keys = nullptr);
  ~GrpcFront();
  int port() const { return port_; }
  // grpc.health.v1 says NOT_SERVING from now on (the router is draining); calls still run.
  void StopServing();
  // Cancels the calls in flight and stops serving. Idempotent.
  void Stop();

  class Impl;

 private:
  GrpcFront() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace pdserve::router
