#include "kvtransfer/cuda_ipc/ipc_page_arena.h"

#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/gpu/device_memory.h"

namespace pdserve::kv::cuda_ipc {

using engine::gpu::CudaStatus;

namespace {

// The driver allocation holding `data` (cuMemGetAddressRange, found through the runtime's
// driver entry point so this library needs no libcuda link).
struct AllocationRange {
  uint64_t base = 0;
  uint64_t size = 0;
};
absl::StatusOr<AllocationRange> AllocationOf(const void* data) {
  using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);
  static GetAddressRange get_range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<GetAddressRange>(fn);
  }();
  if (get_range == nullptr) {
    return absl::InternalError("CUDA IPC: the driver has no cuMemGetAddressRange");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const auto at = reinterpret_cast<unsigned long long>(data);
  if (const int rc = get_range(&base, &size, at); rc != 0) {
    return absl::InternalError(
        absl::StrCat("CUDA IPC: cuMemGetAddressRange failed (CUresult ", rc, ")"));
  }
  return AllocationRange{base, size};
}

}  // namespace

absl::StatusOr<std::unique_ptr<IpcPageArena>> IpcPageArena::Create(int device, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("IpcPageArena: bytes == 0");
  IpcArenaHandle handle;
  handle.bytes = bytes;
  absl::StatusOr<std::string> boot = HostBootId();
  if (!boot.ok()) return boot.status();
  std::strncpy(handle.boot_id, boot->c_str(), sizeof(handle.boot_id) - 1);
  PDSERVE_CUDA_RETURN(cudaSetDevice(device));
  PDSERVE_CUDA_RETURN(
      cudaDeviceGetPCIBusId(handle.pci_bus_id, sizeof(handle.pci_bus_id) - 1, device));
  void* data = nullptr;
  PDSERVE_CUDA_RETURN(cudaMalloc(&data, bytes));
  if (absl::Status s = CudaStatus(cudaIpcGetMemHandle(&handle.memory, data), "cudaIpcGetMemHandle");
      !s.ok()) {
    cudaFree(data);
    return s;
  }
  absl::StatusOr<AllocationRange> allocation = AllocationOf(data);
  if (!allocation.ok()) {
    cudaFree(data);
    return allocation.status();
  }
  handle.offset = reinterpret_cast<uint64_t>(data) - allocation->base;
  return std::unique_ptr<IpcPageArena>(new IpcPageArena(device, data, handle));
}

IpcPageArena::~IpcPageArena() {
  cudaSetDevice(device_);
  cudaFree(data_);
}

absl::StatusOr<int> CheckIpcUsable(const IpcArenaHandle& peer) {
  absl::StatusOr<std::string> boot = HostBootId();
  if (!boot.ok()) return boot.status();
  const std::string peer_boot(peer.boot_id, strnlen(peer.boot_id, sizeof(peer.boot_id)));
  if (peer_boot != *boot) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CUDA IPC: the peer runs on another host (boot id ", peer_boot, ", here ", *boot, ")"));
  }
  const std::string bus(peer.pci_bus_id, strnlen(peer.pci_bus_id, sizeof(peer.pci_bus_id)));
  int device = -1;
  if (cudaDeviceGetByPCIBusId(&device, bus.c_str()) != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC: the peer's GPU ", bus, " is not visible to this process"));
  }
  int unified = 0;
  PDSERVE_CUDA_RETURN(cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device));
  if (unified == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA IPC: device ", device, " has no unified addressing"));
  }
  return device;
}

absl::StatusOr<std::unique_ptr<PeerArena>> PeerArena::Open(const IpcArenaHandle& handle) {
  absl::StatusOr<int> device = CheckIpcUsable(handle);
  if (!device.ok()) return device.status();
  PDSERVE_CUDA_RETURN(cudaSetDevice(*device));
  void* data = nullptr;
  PDSERVE_CUDA_RETURN(cudaIpcOpenMemHandle(&data, handle.memory, cudaIpcMemLazyEnablePeerAccess));
  // The handle's offset and size come from the wire: an arena they place past the mapped
  // allocation would have the lander's kernels read outside it (an illegal address, which
  // ends this process's CUDA context), so they are checked against what the driver mapped.
  // Best effort: this check has not run on a GPU yet (2026-12-05), so a driver that cannot
  // report the mapping's range leaves the arena as the old code took it (the range inside the
  // stated arena is still checked by Range) rather than refusing every peer.
  const absl::StatusOr<AllocationRange> mapped = AllocationOf(data);
  absl::Status fits = absl::OkStatus();
  if (mapped.ok()) {
    // The bytes mapped from `data` on (cudaIpcOpenMemHandle returns the allocation's base).
    const uint64_t size = mapped->base + mapped->size - reinterpret_cast<uint64_t>(data);
    if (handle.offset > size || handle.bytes > size - handle.offset) {
      fits = absl::OutOfRangeError(
          absl::StrCat("CUDA IPC: the peer's arena [", handle.offset, ", +", handle.bytes,
                       ") lies outside its mapped allocation of ", size, " bytes"));
    }
  }
  if (!fits.ok()) {
    cudaIpcCloseMemHandle(data);
    return fits;
  }
  return std::unique_ptr<PeerArena>(new PeerArena(*device, data, handle.offset, handle.bytes));
}

PeerArena::~PeerArena() {
  cudaSetDevice(device_);
  cudaIpcCloseMemHandle(mapped_);
}

absl::StatusOr<const void*> PeerArena::Range(uint64_t offset, uint64_t length) const {
  if (offset > bytes_ || length > bytes_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("CUDA IPC: bytes [", offset, ", +", length,
                                              ") outside the peer's arena of ", bytes_));
  }
  return static_cast<const char*>(data_) + offset;
}

}  // namespace pdserve::kv::cuda_ipc
