#include "common/grpc_listener.h"

#include <grpc/grpc.h>

#include <climits>

namespace pdserve::rpc {
namespace {

// gRPC reads INT_MAX as "no limit".
int OrUnlimited(int ms) { return ms > 0 ? ms : INT_MAX; }

}  // namespace

void ApplyConnectionLimits(const config::GrpcConfig& limits, grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, limits.handshake_timeout_ms);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             OrUnlimited(limits.max_connection_idle_ms));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                             OrUnlimited(limits.max_connection_age_ms));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                             OrUnlimited(limits.max_connection_age_grace_ms));
}

// grpc::Server::Shutdown(deadline) closes the listeners too, but blocks until the calls end or
// the deadline passes. The core server's own shutdown returns at once, having closed the
// listeners and sent GOAWAY; it is idempotent, so the C++ server's Shutdown in Finish joins it
// (and its wait and its cancelling of the calls left are gRPC's own).
ServerDrain::ServerDrain(grpc::Server* server)
    : server_(server), shutdown_queue_(grpc_completion_queue_create_for_pluck(nullptr)) {
  grpc_server_shutdown_and_notify(server_->c_server(), shutdown_queue_, this);
}

ServerDrain::~ServerDrain() { Finish(absl::ZeroDuration()); }

void ServerDrain::Finish(absl::Duration grace) {
  if (finished_) return;
  finished_ = true;
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  // Our notification was posted with the server's own: this returns at once.
  grpc_completion_queue_pluck(shutdown_queue_, this, gpr_inf_future(GPR_CLOCK_REALTIME), nullptr);
  grpc_completion_queue_shutdown(shutdown_queue_);
  grpc_completion_queue_destroy(shutdown_queue_);
}

}  // namespace pdserve::rpc
