// The CUDA engine's paged device state (engine/gpu, GpuModelOptions::state_tokens; issue 26) as
// admission sees it: one bookkeeping kind per compression rate in the worker's host PagePool
// (PagePoolOptions::kinds, 4 host bytes a page, named kDeviceStateKind + rate), and the pages a
// request of n tokens reserves in each (engine::PagedRequestPages). A request admitted against
// them never finds a device pool short while it runs; one whose demand exceeds a whole pool can
// never run there. Used by the colocated server (`pdserve serve --state-tokens`) and the PD
// decode worker (worker key `state_tokens`). Sizes: engine/paged_state_plan.h.
// Thread-safety: immutable after For(); const methods are safe from any thread.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/config.h"
#include "serving/page_pool.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

// Name prefix of the bookkeeping kinds, followed by the compression rate ("device_state_rate4";
// serving::PoolKindLabel maps it to the metrics' kind="device").
inline constexpr char kDeviceStateKind[] = "device_state_rate";

class DeviceStatePools {
 public:
  // The pools of a GpuModel of `slots` slots and `max_context` tokens each whose paged state holds
  // `state_tokens` tokens (0: every slot full), as engine::PagedPoolKinds sizes them.
  static DeviceStatePools For(const engine::ModelConfig& config, int64_t slots, int64_t max_context,
                              int64_t state_tokens);

  // Appends one bookkeeping kind per rate to `options` (after the layout's own kinds).
  void AddKinds(serving::PagePoolOptions* options) const;
  // `layout`'s demand for `total_tokens` tokens followed by the device pages per rate, indexed
  // like a pool built with the layout's kinds and then AddKinds.
  serving::PageDemand Demand(const serving::StateLayout& layout, int64_t total_tokens) const;
  // (rate, pages) per compression rate, ascending; empty for a model of sliding layers only.
  const std::vector<std::pair<int64_t, int64_t>>& kinds() const { return kinds_; }
  int64_t state_tokens() const { return state_tokens_; }

  // True when `message` (a pool or scheduler error) names one of these kinds.
  static bool Names(std::string_view message);

 private:
  std::vector<std::pair<int64_t, int64_t>> kinds_;
  int64_t max_context_ = 0;
  int64_t state_tokens_ = 0;
};

}  // namespace pdserve::runtime
