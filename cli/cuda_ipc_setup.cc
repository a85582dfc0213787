#include "cli/cuda_ipc_setup.h"

#ifdef PDSERVE_HAVE_CUDA_BACKEND
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvtransfer/cuda_ipc/cuda_page_lander.h"
#include "kvtransfer/cuda_ipc/ipc_page_arena.h"
#endif

namespace pdserve::cli {

#ifdef PDSERVE_HAVE_CUDA_BACKEND
namespace {

// The worker's GPU: device 0 (LoadWorkerEntry set CUDA_VISIBLE_DEVICES to its GPU).
constexpr int kDevice = 0;

absl::Status Cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat("cuda ipc: ", what, ": ", cudaGetErrorString(e)));
}

}  // namespace

std::optional<prefill::DeviceArenaOptions> PrefillCudaIpc(const config::DeployConfig& deploy) {
  if (config::EffectiveCudaIpc(deploy) == "off") return std::nullopt;
  prefill::DeviceArenaOptions options;
  options.tokens = config::CudaIpcArenaTokens(deploy);
  options.required = deploy.transfer_cuda_ipc == "on";
  options.allocate = [](size_t bytes) -> absl::StatusOr<prefill::DeviceArena> {
    absl::StatusOr<std::unique_ptr<kv::cuda_ipc::IpcPageArena>> arena =
        kv::cuda_ipc::IpcPageArena::Create(kDevice, bytes);
    if (!arena.ok()) return arena.status();
    prefill::DeviceArena out;
    out.memory = {static_cast<std::byte*>((*arena)->data()), bytes};
    out.name = kv::cuda_ipc::NameOf((*arena)->handle());
    out.owner = std::shared_ptr<kv::cuda_ipc::IpcPageArena>(std::move(*arena));
    return out;
  };
  return options;
}

std::optional<decode::DeviceLanding> DecodeCudaIpc(const config::DeployConfig& deploy) {
  if (config::EffectiveCudaIpc(deploy) == "off") return std::nullopt;
  decode::DeviceLanding landing;
  landing.required = deploy.transfer_cuda_ipc == "on";
  landing.request_tokens = config::CudaIpcArenaTokens(deploy);
  char bus[32] = {};
  if (!Cuda(cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, kDevice), "cudaDeviceGetPCIBusId").ok()) {
    return std::nullopt;  // no usable GPU: Create's own errors say more
  }
  landing.pci_bus_id = bus;
  landing.allocate = [](size_t bytes) -> absl::StatusOr<decode::DeviceLanding::Memory> {
    if (absl::Status s = Cuda(cudaSetDevice(kDevice), "cudaSetDevice"); !s.ok()) return s;
    void* memory = nullptr;
    if (absl::Status s = Cuda(cudaMalloc(&memory, bytes), "cudaMalloc (device page pool)");
        !s.ok()) {
      return s;
    }
    decode::DeviceLanding::Memory out;
    out.bytes = {static_cast<std::byte*>(memory), bytes};
    out.owner = std::shared_ptr<void>(memory, [](void* p) { cudaFree(p); });
    return out;
  };
  auto arenas = std::make_shared<kv::cuda_ipc::PeerArenaCache>();
  landing.landers = [arenas]() -> absl::StatusOr<std::unique_ptr<kv::shm::DevicePageLander>> {
    absl::StatusOr<std::unique_ptr<kv::cuda_ipc::CudaPageLander>> lander =
        kv::cuda_ipc::CudaPageLander::Create(kDevice, arenas);
    if (!lander.ok()) return lander.status();
    return std::unique_ptr<kv::shm::DevicePageLander>(std::move(*lander));
  };
  landing.can_map = [](const worker::v1::CudaIpcSource& source) -> absl::Status {
    kv::cuda_ipc::IpcArenaHandle handle{};
    if (source.boot_id().size() >= sizeof(handle.boot_id) ||
        source.pci_bus_id().size() >= sizeof(handle.pci_bus_id)) {
      return absl::InvalidArgumentError(
          "cuda ipc: the prefill worker's boot or bus id is too long");
    }
    std::memcpy(handle.boot_id, source.boot_id().data(), source.boot_id().size());
    std::memcpy(handle.pci_bus_id, source.pci_bus_id().data(), source.pci_bus_id().size());
    return kv::cuda_ipc::CheckIpcUsable(handle).status();
  };
  return landing;
}
#else
std::optional<prefill::DeviceArenaOptions> PrefillCudaIpc(const config::DeployConfig&) {
  return std::nullopt;
}
std::optional<decode::DeviceLanding> DecodeCudaIpc(const config::DeployConfig&) {
  return std::nullopt;
}
#endif

}  // namespace pdserve::cli
