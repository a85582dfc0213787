#include "kvtransfer/cuda_ipc/cuda_page_lander.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/env_switch.h"

namespace pdserve::kv::cuda_ipc {

using engine::gpu::CudaStatus;

namespace {

constexpr size_t kMaxCachedArenas = 64;

template <size_t N>
void CopyName(char (&field)[N], const std::string& text) {
  std::memset(field, 0, N);
  std::memcpy(field, text.data(), std::min(text.size(), N - 1));
}

// Grows `array` to at least `n` elements (doubling), keeping nothing.
template <typename Array>
absl::Status Reserve(Array& array, size_t n) {
  if (array.size() >= n) return absl::OkStatus();
  return array.Allocate(std::max<size_t>(n, 2 * array.size()));
}

}  // namespace

IpcArenaHandle HandleOf(const shm::IpcRegionName& name) {
  IpcArenaHandle handle;
  static_assert(sizeof(handle.memory) == std::tuple_size_v<decltype(name.memory)>);
  std::memcpy(&handle.memory, name.memory.data(), name.memory.size());
  handle.bytes = name.bytes;
  handle.offset = name.allocation_offset;
  CopyName(handle.pci_bus_id, name.pci_bus_id);
  CopyName(handle.boot_id, name.boot_id);
  return handle;
}

shm::IpcRegionName NameOf(const IpcArenaHandle& handle) {
  shm::IpcRegionName name;
  std::memcpy(name.memory.data(), &handle.memory, name.memory.size());
  name.allocation_offset = handle.offset;
  name.bytes = handle.bytes;
  name.pci_bus_id.assign(handle.pci_bus_id, strnlen(handle.pci_bus_id, sizeof(handle.pci_bus_id)));
  name.boot_id.assign(handle.boot_id, strnlen(handle.boot_id, sizeof(handle.boot_id)));
  return name;
}

absl::StatusOr<std::shared_ptr<const PeerArena>> PeerArenaCache::Get(
    const shm::IpcRegionName& name) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  // Mappings only this cache holds that went unnamed for idle_after_ are unmapped.
  std::erase_if(cached_, [&](const Cached& c) {
    return c.arena != nullptr && c.arena.use_count() == 1 && now - c.used > idle_after_ &&
           c.name != name;
  });
  for (auto it = cached_.begin(); it != cached_.end(); ++it) {
    if (it->name != name) continue;
    if (it->arena != nullptr) {
      it->used = now;
      return it->arena;
    }
    if (now - it->failed_at < retry_after_) return it->error;
    cached_.erase(it);  // Time for another try.
    break;
  }
  while (cached_.size() >= kMaxCachedArenas) cached_.erase(cached_.begin());
  absl::StatusOr<std::unique_ptr<PeerArena>> opened = PeerArena::Open(HandleOf(name));
  if (!opened.ok()) {
    cached_.push_back({name, nullptr, opened.status(), now, now});
    return opened.status();
  }
  std::shared_ptr<const PeerArena> arena = std::move(*opened);
  cached_.push_back({name, arena, absl::OkStatus(), absl::InfinitePast(), now});
  return arena;
}

namespace {

constexpr kernels::SwitchChoice<LanderMode> kLanderModes[] = {{"staged", LanderMode::kStaged},
                                                              {"mapped", LanderMode::kMapped},
                                                              {"fused", LanderMode::kFused}};

}  // namespace

absl::StatusOr<LanderMode> ParseLanderMode(const std::string& name) {
  if (std::optional<LanderMode> mode = kernels::FindSwitchChoice(name, kLanderModes)) return *mode;
  return absl::InvalidArgumentError(absl::StrCat("CUDA page lander mode '", name, "': one of ",
                                                 kernels::SwitchChoiceList(kLanderModes)));
}

LanderMode LanderModeFromEnv() {
  return kernels::ReadSwitch("PDSERVE_CUDA_LANDER", kLanderModes, LanderMode::kFused,
                             "the default, fused");
}

absl::StatusOr<std::unique_ptr<CudaPageLander>> CudaPageLander::Create(
    int device, std::shared_ptr<PeerArenaCache> arenas) {
  return Create(device, std::move(arenas), LanderModeFromEnv());
}

absl::StatusOr<std::unique_ptr<CudaPageLander>> CudaPageLander::Create(
    int device, std::shared_ptr<PeerArenaCache> arenas, LanderMode mode) {
  PDSERVE_CUDA_RETURN(cudaSetDevice(device));
  cudaStream_t stream = nullptr;
  PDSERVE_CUDA_RETURN(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::unique_ptr<CudaPageLander>(
      new CudaPageLander(device, stream, std::move(arenas), mode));
}

CudaPageLander::~CudaPageLander() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaPageLander::Add(const shm::PageRef& ref, const LandingTarget& target) {
  if (!ref.device.has_value()) {
    return absl::InvalidArgumentError("not a page of a GPU arena");
  }
  return AddFromArena(*ref.device, ref.offset, ref.length, target);
}

absl::Status CudaPageLander::AddFromArena(const shm::IpcRegionName& arena, uint64_t offset,
                                          uint64_t length, const LandingTarget& target) {
  if (!target.device || length != target.destination.size()) {
    return absl::InvalidArgumentError(absl::StrCat("not a GPU destination of the page's size (",
                                                   length, " bytes for ", target.destination.size(),
                                                   ")"));
  }
  if (last_arena_ == nullptr || !(arena == last_name_)) {
    absl::StatusOr<std::shared_ptr<const PeerArena>> found = arenas_->Get(arena);
    if (!found.ok()) {
      return absl::UnavailableError(absl::StrCat("cuda ipc: ", found.status().message()));
    }
    last_arena_ = std::move(*found);
    last_name_ = arena;
  }
  absl::StatusOr<const void*> source = last_arena_->Range(offset, length);
  if (!source.ok()) {
    return absl::UnavailableError(absl::StrCat("cuda ipc: ", source.status().message()));
  }
  queued_.push_back({last_arena_, *source, target});
  return absl::OkStatus();
}

absl::Status CudaPageLander::ReserveHost(size_t n) {
  if (host_copies_.size() >= n && host_pages_.size() >= n && host_hashes_.size() >= n &&
      (mode_ == LanderMode::kStaged || mapped_hashes_ != nullptr)) {
    return absl::OkStatus();
  }
  // Cleared first: a reallocation that fails part way must not leave the old arrays' device
  // addresses for the next batch's kernels.
  mapped_copies_ = nullptr;
  mapped_pages_ = nullptr;
  mapped_hashes_ = nullptr;
  PDSERVE_RETURN_IF_ERROR(Reserve(host_copies_, n));
  PDSERVE_RETURN_IF_ERROR(Reserve(host_pages_, n));
  PDSERVE_RETURN_IF_ERROR(Reserve(host_hashes_, n));
  if (mode_ == LanderMode::kStaged) return absl::OkStatus();
  void* device = nullptr;
  PDSERVE_CUDA_RETURN(cudaHostGetDevicePointer(&device, host_copies_.get(), 0));
  auto* copies = static_cast<kernels::cuda::PageCopy*>(device);
  PDSERVE_CUDA_RETURN(cudaHostGetDevicePointer(&device, host_pages_.get(), 0));
  auto* pages = static_cast<kernels::cuda::Xxh3Page*>(device);
  PDSERVE_CUDA_RETURN(cudaHostGetDevicePointer(&device, host_hashes_.get(), 0));
  mapped_copies_ = copies;
  mapped_pages_ = pages;
  mapped_hashes_ = static_cast<uint64_t*>(device);
  return absl::OkStatus();
}

absl::Status CudaPageLander::RunBatch() {
  const size_t n = queued_.size();
  PDSERVE_CUDA_RETURN(cudaSetDevice(device_));
  PDSERVE_RETURN_IF_ERROR(ReserveHost(n));
  for (size_t i = 0; i < n; ++i) {
    const Queued& q = queued_[i];
    host_copies_[i] = {q.source, q.target.destination.data(), q.target.destination.size()};
    // The checksum reads the landed bytes (this worker's memory), not the peer's.
    host_pages_[i] = {q.target.destination.data(), q.target.destination.size()};
  }
  if (mode_ == LanderMode::kFused) {
    // One launch: each block copies its page, then hashes the bytes it landed.
    PDSERVE_CUDA_RETURN(kernels::cuda::copy_pages_xxh3(mapped_copies_, static_cast<int64_t>(n),
                                                       mapped_hashes_, stream_));
    PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  if (mode_ == LanderMode::kMapped) {
    // The kernels read the descriptors from pinned memory and write the hashes there: no copies
    // on the stream, only the two launches and the wait.
    PDSERVE_CUDA_RETURN(
        kernels::cuda::copy_pages(mapped_copies_, static_cast<int64_t>(n), stream_));
    PDSERVE_CUDA_RETURN(kernels::cuda::xxh3_64_pages(mapped_pages_, static_cast<int64_t>(n),
                                                     mapped_hashes_, stream_));
    PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  if (copies_.size() < n)
    PDSERVE_RETURN_IF_ERROR(copies_.Allocate(std::max(n, 2 * copies_.size())));
  if (pages_.size() < n) PDSERVE_RETURN_IF_ERROR(pages_.Allocate(std::max(n, 2 * pages_.size())));
  if (hashes_.size() < n)
    PDSERVE_RETURN_IF_ERROR(hashes_.Allocate(std::max(n, 2 * hashes_.size())));
  PDSERVE_CUDA_RETURN(cudaMemcpyAsync(copies_.get(), host_copies_.get(),
                                      n * sizeof(kernels::cuda::PageCopy), cudaMemcpyHostToDevice,
                                      stream_));
  PDSERVE_CUDA_RETURN(cudaMemcpyAsync(pages_.get(), host_pages_.get(),
                                      n * sizeof(kernels::cuda::Xxh3Page), cudaMemcpyHostToDevice,
                                      stream_));
  PDSERVE_CUDA_RETURN(kernels::cuda::copy_pages(copies_.get(), static_cast<int64_t>(n), stream_));
  PDSERVE_CUDA_RETURN(
      kernels::cuda::xxh3_64_pages(pages_.get(), static_cast<int64_t>(n), hashes_.get(), stream_));
  PDSERVE_CUDA_RETURN(cudaMemcpyAsync(host_hashes_.get(), hashes_.get(), n * sizeof(uint64_t),
                                      cudaMemcpyDeviceToHost, stream_));
  PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

void CudaPageLander::Flush(
    const std::function<void(const LandingTarget&, absl::Status, uint64_t)>& landed) {
  if (queued_.empty()) return;
  ++flushes_;
  const absl::Time started = absl::Now();
  const absl::Status status = RunBatch();
  if (!status.ok()) {
    // A batch that failed part way may have launched its copy: it must be over before the
    // pages are reported, since a failed page's destination can then go back to the pool (and
    // to another request) and the batch's arena mappings may be closed. An error that also
    // fails the wait leaves a broken context that runs nothing more.
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaGetLastError();
  }
  flush_time_ += absl::Now() - started;
  std::vector<Queued> batch;
  batch.swap(queued_);
  // Looked up again by the next batch: a lane does not keep an arena mapped for good (a
  // restarted prefill worker's old arena is then held by the cache alone, which drops it).
  last_arena_.reset();
  for (size_t i = 0; i < batch.size(); ++i) {
    if (status.ok()) {
      landed(batch[i].target, absl::OkStatus(), host_hashes_[i]);
    } else {
      landed(batch[i].target, absl::UnavailableError(absl::StrCat("cuda ipc: ", status.message())),
             0);
    }
  }
}

}  // namespace pdserve::kv::cuda_ipc
