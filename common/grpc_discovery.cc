#include "common/grpc_discovery.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <mutex>
#include <utility>

#include "grpc/health/v1/health.pb.h"

namespace pdserve::rpc {

void EnableGrpcDiscovery() {
  static std::once_flag once;
  std::call_once(once, [] {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::EnableDefaultHealthCheckService(true);
    // Links (and so registers) grpc.health.v1's descriptor, so reflection describes the health
    // service the default implementation serves (proto/grpc/health/v1/health.proto).
    (void)grpc::health::v1::HealthCheckRequest::descriptor();
  });
}

void SetServing(grpc::Server& server, const std::vector<std::string>& services, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  for (const std::string& name : services) health->SetServingStatus(name, serving);
}

ServingFollower::ServingFollower(grpc::Server* server, std::vector<std::string> services,
                                 std::function<bool()> ready, absl::Duration period)
    : server_(server), services_(std::move(services)) {
  bool serving = ready();
  SetServing(*server_, services_, serving);
  thread_ = std::thread([this, ready = std::move(ready), period, serving]() mutable {
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) {
      // Only a change is set: gRPC's health service sends every Watch stream a message for each
      // SetServingStatus, changed or not (a client saw SERVING ~4 times a second).
      const bool now = ready();
      if (now == serving) continue;
      serving = now;
      SetServing(*server_, services_, serving);
    }
  });
}

ServingFollower::~ServingFollower() { Stop(); }

void ServingFollower::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  thread_.join();
  SetServing(*server_, services_, false);
}

}  // namespace pdserve::rpc
