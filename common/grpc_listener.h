// What every gRPC listener of pdserve (the router's front, the prefill and decode workers) does
// with its connections: the deployment's connection limits (config::GrpcConfig) and a drain
// that frees the port at once while the calls in flight finish.
//
// Debian 12's gRPC (1.51) has no cap on the number of concurrent connections (the channel
// argument grpc.max_allowed_incoming_connections came in a later release, and 1.51 ignores
// it); the limits here bound how long a connection that does nothing is held instead
// (docs/operations.md, "Idle gRPC connections").
//
// Thread-safety: ApplyConnectionLimits is a pure function of its arguments; a ServerDrain is
// used from one controlling thread.
#pragma once

#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "common/deploy_config.h"

namespace pdserve::rpc {

// Sets `limits` on `builder` (gRPC's handshake timeout, maximum connection idle time, age and
// age grace; 0 in a max_* field: gRPC's unlimited), and turns SO_REUSEPORT off: a second process
// on a port that one is still listening on must fail to bind, not share it. gRPC sets
// SO_REUSEADDR on its listeners itself, so connections of a process that stopped listening
// (draining, or in TIME_WAIT) do not keep a new listener off the port.
void ApplyConnectionLimits(const config::GrpcConfig& limits, grpc::ServerBuilder& builder);

// Stops a started grpc::Server in two steps, so a replacement process can bind the port while
// this one's calls in flight finish.
class ServerDrain {
 public:
  // Begins the server's shutdown. When the constructor returns the server's listening sockets
  // are closed (another server may bind the port) and every connection has been sent GOAWAY:
  // clients send their next calls on a new connection (to whoever listens on the port then),
  // calls that arrive anyway are refused, and the calls in flight go on.
  // REQUIRES: `server` was started and outlives this object.
  explicit ServerDrain(grpc::Server* server);
  ServerDrain(const ServerDrain&) = delete;
  ServerDrain& operator=(const ServerDrain&) = delete;
  // Finish(absl::ZeroDuration()) unless Finish ran.
  ~ServerDrain();

  // Waits up to `grace` for the calls in flight to end, cancels those still running (their
  // clients see CANCELLED), and returns once the server has shut down. Idempotent.
  void Finish(absl::Duration grace);

 private:
  grpc::Server* const server_;
  // Learns when the core server's shutdown completes (a plucked C queue: the C++ queue takes
  // every tag for one of its own).
  grpc_completion_queue* const shutdown_queue_;
  bool finished_ = false;
};

}  // namespace pdserve::rpc
