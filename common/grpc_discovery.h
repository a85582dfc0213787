// What makes a gRPC listener of ours discoverable by standard tools: server reflection
// (grpc.reflection.v1alpha.ServerReflection, so a client lists the services and fetches their
// descriptors without our .proto files) and the standard health service grpc.health.v1.Health,
// whose status follows the process's readiness (SERVING / NOT_SERVING; unknown names NOT_FOUND).
// Every gRPC server of pdserve (the router's front, the prefill and decode workers) enables both.
//
// Thread-safety: EnableGrpcDiscovery may be called from any thread; SetServing is thread-safe
// (gRPC's health service locks); ServingFollower's methods from one owning thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve::rpc {

// Turns on the reflection plugin and gRPC's default health service for every grpc::ServerBuilder
// created after this call (both are process-wide switches in gRPC). Idempotent.
void EnableGrpcDiscovery();

// Sets the grpc.health.v1 status of the whole server ("") and of each of `services` (full names,
// e.g. "pdserve.v1.Generation"). No-op when the server has no health service (built before
// EnableGrpcDiscovery). After grpc::Server::Shutdown every name stays NOT_SERVING.
void SetServing(grpc::Server& server, const std::vector<std::string>& services, bool serving);

// Keeps a server's health status equal to `ready()` (polled every `period` on its own thread)
// until Stop() or destruction, which leave it NOT_SERVING. For a readiness that changes without
// an event to hook (the router's: enough healthy workers).
class ServingFollower {
 public:
  // REQUIRES: `server` outlives the follower; `ready` is thread-safe.
  ServingFollower(grpc::Server* server, std::vector<std::string> services,
                  std::function<bool()> ready, absl::Duration period);
  ~ServingFollower();
  ServingFollower(const ServingFollower&) = delete;
  ServingFollower& operator=(const ServingFollower&) = delete;

  // Sets NOT_SERVING and stops following (a draining process). Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  grpc::Server* const server_;
  const std::vector<std::string> services_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pdserve::rpc
