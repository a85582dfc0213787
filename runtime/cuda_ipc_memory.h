// The device memory transfer.cuda_ipc takes (docs/protocol.md, "Same-host device-to-device pages
// (CUDA IPC)"): the prefill worker's GPU arena holds one request's pages, the decode worker's
// device page pool kCudaIpcPoolRequests requests' pages, each request of up to
// CudaIpcRequestTokens tokens, in the CUDA engine's page layout (bf16 rows, fp32 compressor
// rows). One formula for the workers that allocate them (prefill/device_pages.cc,
// decode/device_pages.cc) and the memory plan (cli/memory_check.h, engine/memory_plan.h), so the
// plan counts what the workers allocate. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "serving/page_pool.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

// Requests the decode worker's device page pool holds at once (decode::DeviceLanding::requests).
inline constexpr int64_t kCudaIpcPoolRequests = 4;

// Tokens one request may hold in the arena or the pool: `tokens` (0: `context`), at most
// `context` (the model's max_position_embeddings).
int64_t CudaIpcRequestTokens(int64_t tokens, int64_t context);

// The page pool of `requests` requests of `tokens` tokens each in `layout`
// (layout.PoolOptions(requests, requests * tokens)), never poisoned (device memory the host never
// touches). Its bytes: serving::PagePool::HostBytesNeeded of it. Both arguments >= 1.
serving::PagePoolOptions DevicePagePoolOptions(const serving::StateLayout& layout, int64_t requests,
                                               int64_t tokens);

// What a worker allocates on its first GPU for transfer.cuda_ipc.
struct CudaIpcMemory {
  int64_t tokens = 0;       // per request
  int64_t arena_bytes = 0;  // prefill: the arena (one request)
  int64_t pool_bytes = 0;   // decode: the device page pool (kCudaIpcPoolRequests requests)
  int64_t total() const { return arena_bytes + pool_bytes; }
};

// For a worker on `backend` ("cpu" / "cuda") of `ranks` GPUs with transfer.cuda_ipc `mode`
// ("auto", "on", "off") and `arena_tokens` (config::CudaIpcArenaTokens): nothing for "off" or a
// cpu worker; a prefill worker's arena only with one rank (runtime::GpuPrefillEngine stores
// device pages only then); a decode worker's pool only with one rank and `early_import`
// (transfer.early_import: DecodeWorker allocates it only where the runner has an early
// importer, which needs one GPU). "auto" counts what "on" does:
// a worker that can allocate it does. InvalidArgument for a config whose page layout is unusable.
absl::StatusOr<CudaIpcMemory> PlanCudaIpcMemory(const engine::ModelConfig& config,
                                                const std::string& mode, int64_t arena_tokens,
                                                const std::string& backend, bool prefill, int ranks,
                                                bool early_import = true);

}  // namespace pdserve::runtime
