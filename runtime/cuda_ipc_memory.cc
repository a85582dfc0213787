#include "runtime/cuda_ipc_memory.h"

#include <algorithm>

#include "common/status.h"
#include "runtime/paged_state.h"

namespace pdserve::runtime {

int64_t CudaIpcRequestTokens(int64_t tokens, int64_t context) {
  return tokens > 0 ? std::min(tokens, context) : context;
}

serving::PagePoolOptions DevicePagePoolOptions(const serving::StateLayout& layout, int64_t requests,
                                               int64_t tokens) {
  serving::PagePoolOptions options = layout.PoolOptions(requests, requests * tokens);
  options.poison_freed = false;
  return options;
}

absl::StatusOr<CudaIpcMemory> PlanCudaIpcMemory(const engine::ModelConfig& config,
                                                const std::string& mode, int64_t arena_tokens,
                                                const std::string& backend, bool prefill, int ranks,
                                                bool early_import) {
  CudaIpcMemory m;
  if (mode == "off" || backend != "cuda" || ranks != 1 || (!prefill && !early_import)) return m;
  PDSERVE_ASSIGN_OR_RETURN(const serving::StateLayout layout,
                           LayoutForModel(config, 64, StorageElement(/*cuda=*/true)));
  m.tokens = CudaIpcRequestTokens(arena_tokens, config.max_position_embeddings);
  const int64_t requests = prefill ? 1 : kCudaIpcPoolRequests;
  const auto bytes = static_cast<int64_t>(
      serving::PagePool::HostBytesNeeded(DevicePagePoolOptions(layout, requests, m.tokens)));
  (prefill ? m.arena_bytes : m.pool_bytes) = bytes;
  return m;
}

}  // namespace pdserve::runtime
