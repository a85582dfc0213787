#include "runtime/device_state_pools.h"

#include "absl/strings/str_cat.h"
#include "engine/paged_state_plan.h"

namespace pdserve::runtime {

DeviceStatePools DeviceStatePools::For(const engine::ModelConfig& config, int64_t slots,
                                       int64_t max_context, int64_t state_tokens) {
  DeviceStatePools pools;
  pools.kinds_ = engine::PagedPoolKinds(config, slots, max_context, state_tokens);
  pools.max_context_ = max_context;
  pools.state_tokens_ = state_tokens;
  return pools;
}

void DeviceStatePools::AddKinds(serving::PagePoolOptions* options) const {
  for (const auto& [rate, pages] : kinds_) {
    // Bookkeeping only: 4 bytes a page on the host; the state lives in the device pools.
    options->kinds.push_back({absl::StrCat(kDeviceStateKind, rate), pages, 1, 4});
  }
}

serving::PageDemand DeviceStatePools::Demand(const serving::StateLayout& layout,
                                             int64_t total_tokens) const {
  serving::PageDemand demand = layout.Demand(total_tokens);
  for (const auto& kind : kinds_) {
    demand.push_back(engine::PagedRequestPages(kind.first, max_context_, total_tokens));
  }
  return demand;
}

bool DeviceStatePools::Names(std::string_view message) {
  return message.find(kDeviceStateKind) != std::string_view::npos;
}

}  // namespace pdserve::runtime
