// The decode side's landing of pulled pages that lie in a prefill worker's GPU arena
// (shm::DevicePageLander on CUDA; docs/protocol.md, "Same-host device-to-device pages (CUDA
// IPC)"): the arena is mapped once per arena (cudaIpcOpenMemHandle, PeerArenaCache), and a
// Flush runs the batch in two launches on the lander's own stream, one copy_pages over every
// queued page (kernels/cuda/page_copy.cuh) and one xxh3_64_pages over the landed bytes
// (kernels/cuda/xxh3.cuh, equal to libxxhash's XXH3_64bits), then one wait. So a lane lands a
// layer's pages in about the time of their bytes at device-copy rate plus one round trip, not
// one cudaMemcpy round trip per page (~5 us each, docs/perf.md).
//
// Thread-safety: PeerArenaCache is thread-safe (one per process, shared by the lanes' landers);
// a CudaPageLander is used by one thread at a time (its lane's).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/gpu/device_memory.h"
#include "kernels/cuda/page_copy.cuh"
#include "kernels/cuda/xxh3.cuh"
#include "kvtransfer/cuda_ipc/ipc_page_arena.h"
#include "kvtransfer/shm/pull.h"

namespace pdserve::kv::cuda_ipc {

// The arena handle a page reference names, as PeerArena::Open takes it.
IpcArenaHandle HandleOf(const shm::IpcRegionName& name);
// And back: how a prefill worker names its arena in its references.
shm::IpcRegionName NameOf(const IpcArenaHandle& handle);

// Peers' arenas mapped into this process, keyed by their handle bytes; an arena that failed to
// map answers with its error for `retry_after`, then is tried again. An arena nobody else holds
// and no Get named for `idle_after` is unmapped (a restarted prefill worker's old arena: its
// handle is never named again); at most 64 are kept (the oldest dropped first; users holding it
// keep their mapping until they let go).
class PeerArenaCache {
 public:
  explicit PeerArenaCache(absl::Duration retry_after = absl::Seconds(10),
                          absl::Duration idle_after = absl::Seconds(60))
      : retry_after_(retry_after), idle_after_(idle_after) {}
  // Errors: PeerArena::Open's (FailedPrecondition for another host or a GPU not visible here,
  // Internal naming cudaIpcOpenMemHandle).
  absl::StatusOr<std::shared_ptr<const PeerArena>> Get(const shm::IpcRegionName& name)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Cached {
    shm::IpcRegionName name;
    std::shared_ptr<const PeerArena> arena;  // null when it failed
    absl::Status error;
    absl::Time failed_at;
    absl::Time used;  // the last Get that named it
  };
  const absl::Duration retry_after_;
  const absl::Duration idle_after_;
  absl::Mutex mu_;
  std::vector<Cached> cached_ ABSL_GUARDED_BY(mu_);
};

// How a Flush moves the batch's descriptors and hashes (docs/perf.md, "Device-to-device pages
// through the protocol classes"): kStaged copies the descriptors host -> device and the hashes
// back (5 stream operations and a wait); kMapped lets both kernels read the descriptors from, and
// the checksum kernel write the hashes to, pinned host memory (2 launches and a wait); kFused as
// kMapped with one kernel that copies each page and hashes its landed bytes
// (kernels::cuda::copy_pages_xxh3: 1 launch and a wait).
enum class LanderMode { kStaged, kMapped, kFused };
// "staged" / "mapped" / "fused"; InvalidArgument otherwise.
absl::StatusOr<LanderMode> ParseLanderMode(const std::string& name);
// PDSERVE_CUDA_LANDER from the environment (the A/B switch, ParseLanderMode's names), kFused when
// unset (on an H100, 2026-12-05: end to end 8.7 / 29.1 / 49.9 GB/s at 4K / 32K / 128K against
// kMapped's 7.9 / 25.0 / 45.2; docs/perf.md); another value is warned about once and ignored
// (kFused; kernels/env_switch.h).
LanderMode LanderModeFromEnv();

class CudaPageLander final : public shm::DevicePageLander {
 public:
  // A lander whose copies run on a new stream of `device` (the decode worker's GPU: the
  // destinations' device). Errors: Internal naming the CUDA call (cudaSetDevice,
  // cudaStreamCreateWithFlags).
  // The mode is LanderModeFromEnv's.
  static absl::StatusOr<std::unique_ptr<CudaPageLander>> Create(
      int device, std::shared_ptr<PeerArenaCache> arenas);
  static absl::StatusOr<std::unique_ptr<CudaPageLander>> Create(
      int device, std::shared_ptr<PeerArenaCache> arenas, LanderMode mode);
  ~CudaPageLander() override;
  CudaPageLander(const CudaPageLander&) = delete;
  CudaPageLander& operator=(const CudaPageLander&) = delete;

  // shm::DevicePageLander. Add maps the page's arena (cached) and checks its range; Unavailable
  // "cuda ipc: ..." when it cannot (the arena's error, or the range outside it).
  absl::Status Add(const shm::PageRef& ref, const LandingTarget& target) override;
  // Add without a PageRef; the last arena found is kept, so a batch's pages look it up once.
  absl::Status AddFromArena(const shm::IpcRegionName& arena, uint64_t offset, uint64_t length,
                            const LandingTarget& target) override;
  // One copy launch and one checksum launch for every queued page, one wait; a CUDA error fails
  // every page of the batch with it (Unavailable "cuda ipc: ...").
  void Flush(
      const std::function<void(const LandingTarget&, absl::Status, uint64_t)>& landed) override;
  size_t pending() const override { return queued_.size(); }

  // Batches flushed so far, and the host time their Flushes took in all (for tests and logs).
  uint64_t flushes() const { return flushes_; }
  absl::Duration flush_time() const { return flush_time_; }

 private:
  CudaPageLander(int device, cudaStream_t stream, std::shared_ptr<PeerArenaCache> arenas,
                 LanderMode mode)
      : device_(device), stream_(stream), mode_(mode), arenas_(std::move(arenas)) {}
  absl::Status RunBatch();
  // Grows the pinned arrays to `n` (and, mapped, finds their device addresses).
  absl::Status ReserveHost(size_t n);

  struct Queued {
    std::shared_ptr<const PeerArena> arena;  // held until the copy is over
    const void* source;
    LandingTarget target;
  };
  const int device_;
  const cudaStream_t stream_;
  const LanderMode mode_;
  const std::shared_ptr<PeerArenaCache> arenas_;
  // The arena AddFromArena found last (a batch's pages name one arena).
  shm::IpcRegionName last_name_;
  std::shared_ptr<const PeerArena> last_arena_;
  std::vector<Queued> queued_;
  // The batch's descriptors (pinned, uploaded with the launches) and its hashes.
  engine::gpu::PinnedArray<kernels::cuda::PageCopy> host_copies_;
  engine::gpu::PinnedArray<kernels::cuda::Xxh3Page> host_pages_;
  engine::gpu::PinnedArray<uint64_t> host_hashes_;
  engine::gpu::DeviceArray<kernels::cuda::PageCopy> copies_;
  engine::gpu::DeviceArray<kernels::cuda::Xxh3Page> pages_;
  engine::gpu::DeviceArray<uint64_t> hashes_;
  // kMapped / kFused: the device addresses of the pinned arrays.
  kernels::cuda::PageCopy* mapped_copies_ = nullptr;
  kernels::cuda::Xxh3Page* mapped_pages_ = nullptr;
  uint64_t* mapped_hashes_ = nullptr;
  uint64_t flushes_ = 0;
  absl::Duration flush_time_;
};

}  // namespace pdserve::kv::cuda_ipc
