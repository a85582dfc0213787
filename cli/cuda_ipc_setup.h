// The CUDA pieces of transfer.cuda_ipc for `pdserve prefill` / `pdserve decode` (backend cuda):
// the prefill worker's GPU arena (kv::cuda_ipc::IpcPageArena) and the decode worker's device
// page pool memory, per-lane landers (kv::cuda_ipc::CudaPageLander) and mapping check
// (CheckIpcUsable). The workers take them as injected options (prefill::DeviceArenaOptions,
// decode::DeviceLanding), so their libraries build without CUDA.
#pragma once

#include <optional>

#include "common/deploy_config.h"
#include "decode/decode_worker.h"
#include "prefill/prefill_worker.h"

namespace pdserve::cli {

// Unset for transfer.cuda_ipc off (config::EffectiveCudaIpc: auto where no request could use it
// reads as off) or a build without the CUDA backend; `required` for on.
std::optional<prefill::DeviceArenaOptions> PrefillCudaIpc(const config::DeployConfig& deploy);
std::optional<decode::DeviceLanding> DecodeCudaIpc(const config::DeployConfig& deploy);

}  // namespace pdserve::cli
