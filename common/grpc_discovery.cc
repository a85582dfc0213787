#include "common/grpc_discovery.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <mutex>
#include <utility>

namespace pdserve::rpc {

void EnableGrpcDiscovery() {
  static std::once_flag once;
  std::call_once(once, [] {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::EnableDefaultHealthCheckService(true);
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
  SetServing(*server_, services_, ready());
  thread_ = std::thread([this, ready = std::move(ready), period] {
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) {
      SetServing(*server_, services_, ready());
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
