// Same-host device-to-device state pages through CUDA IPC (docs/protocol.md, "Same-host
// device-to-device pages (CUDA IPC)"): the producer's arena, a cudaMalloc'ed region whose IPC
// handle it gives out, and the consumer's mapping of a peer's arena. Our own, because the UCX
// build (Debian's 1.13) has no cuda_ipc transport. The consumer lands pages of it with
// cuda_page_lander.h; the sender and receiver take them (TransferSender::PrepareDevice,
// ReceiveSpec::device_pci_bus_id), and the workers through them (transfer.cuda_ipc:
// prefill/device_pages.cc, decode/device_pages.cc, cli/cuda_ipc_setup.cc).
//
// Thread-safety: an arena and a peer mapping are immutable after creation; their addresses may be
// used from any thread. Creation and destruction switch the calling thread's current device
// (cudaSetDevice) to the arena's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvtransfer/shm/shared_memory.h"

namespace pdserve::kv::cuda_ipc {

// What a consumer needs to map the producer's arena: plain bytes (no pointers), so it can travel
// in a ticket or over a pipe as is.
struct IpcArenaHandle {
  cudaIpcMemHandle_t memory;  // cudaIpcGetMemHandle of the arena's allocation
  uint64_t bytes = 0;         // the arena's size
  // Where the arena starts in the driver's allocation that `memory` names (cuMemGetAddressRange's
  // base): cudaIpcOpenMemHandle maps that allocation's base, and the driver may place a
  // cudaMalloc inside a larger allocation of its own. Usually 0.
  uint64_t offset = 0;
  char pci_bus_id[32] = {};  // the arena's GPU (cudaDeviceGetPCIBusId), NUL-terminated
  char boot_id[40] = {};     // the producer host's /proc/sys/kernel/random/boot_id
};

// The producer side: owns `bytes` of device memory on `device`, freed on destruction. The memory
// must outlive every peer's mapping of it that is still used (docs/protocol.md: held until the
// consumer's commit or the lease's end).
class IpcPageArena {
 public:
  // Errors name the CUDA call that failed (cudaSetDevice, cudaMalloc, cudaIpcGetMemHandle,
  // cudaDeviceGetPCIBusId, cuMemGetAddressRange); InvalidArgument for bytes == 0.
  static absl::StatusOr<std::unique_ptr<IpcPageArena>> Create(int device, uint64_t bytes);
  ~IpcPageArena();
  IpcPageArena(const IpcPageArena&) = delete;
  IpcPageArena& operator=(const IpcPageArena&) = delete;

  void* data() const { return data_; }
  uint64_t bytes() const { return handle_.bytes; }
  int device() const { return device_; }
  const IpcArenaHandle& handle() const { return handle_; }

 private:
  IpcPageArena(int device, void* data, const IpcArenaHandle& handle)
      : device_(device), data_(data), handle_(handle) {}

  int device_;
  void* data_;
  IpcArenaHandle handle_;
};

// The consumer side: a peer process's arena mapped into this process on the local device that
// is the arena's GPU; cudaIpcCloseMemHandle on destruction (which does not free the peer's
// memory). Read and written with ordinary device copies and kernels.
class PeerArena {
 public:
  // Opens `handle` (CheckIpcUsable first: FailedPrecondition when the peer is on another host or
  // its GPU is not visible here; then cudaSetDevice / cudaIpcOpenMemHandle errors by name, e.g.
  // when the handle comes from this same process or the peer has freed the arena; OutOfRange
  // when the handle's offset and size reach past the allocation it maps).
  static absl::StatusOr<std::unique_ptr<PeerArena>> Open(const IpcArenaHandle& handle);
  ~PeerArena();
  PeerArena(const PeerArena&) = delete;
  PeerArena& operator=(const PeerArena&) = delete;

  // The peer's bytes [offset, offset + length), or OutOfRange when that is not inside the arena
  // (a descriptor from the wire is checked here before any copy reads it).
  absl::StatusOr<const void*> Range(uint64_t offset, uint64_t length) const;
  const void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  PeerArena(int device, void* mapped, uint64_t offset, uint64_t bytes)
      : device_(device),
        mapped_(mapped),
        data_(static_cast<char*>(mapped) + offset),
        bytes_(bytes) {}

  int device_;
  void* mapped_;  // what cudaIpcOpenMemHandle returned: the base of the peer's allocation
  void* data_;    // the arena's first byte: mapped_ + the handle's offset
  uint64_t bytes_;
};

// This host's boot id (kvtransfer/shm/shared_memory.h).
using ::pdserve::kv::shm::HostBootId;

// Whether this process can map `peer`'s arena: the same host (boot id), the arena's GPU visible
// here (its PCI bus id), and that device able to map IPC memory (unified addressing). Returns
// the local device ordinal of the arena's GPU, or FailedPrecondition saying which check failed;
// the caller then uses the staged path. A pass is necessary, not sufficient (a container without
// the producer's IPC namespace still fails at cudaIpcOpenMemHandle): PeerArena::Open's error is
// the final word, and also means the staged path.
absl::StatusOr<int> CheckIpcUsable(const IpcArenaHandle& peer);

}  // namespace pdserve::kv::cuda_ipc
