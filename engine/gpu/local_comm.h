// ExpertComm (engine/gpu/expert_comm.h) for ranks that are threads of one process: the ranks post
// their send buffers and a CUDA event, meet at a host barrier, and each rank pulls what it needs
// with peer copies (cudaMemcpyPeerAsync: direct over NVLink / PCIe where peer access works,
// staged by the driver otherwise; a device-to-device copy when ranks share a GPU) on its own
// stream after waiting for the owner's event; a second barrier and event pair keeps a rank from
// overwriting a send buffer before every peer has copied it.
//
// Why it exists beside NCCL: NCCL refuses two ranks on one GPU, so this is what lets a one-GPU
// machine run a real 2-rank expert-parallel group (tests/engine_gpu), and it needs no library.
// The reduce-scatter sums the ranks' parts in rank order 0, 1, ... (engine/gpu/ops.cuh
// SumParts), so equal inputs give equal bits.
//
// Limits: eager only (graph_capturable() is false: the host barrier is not replayed by a graph);
// two host barriers per collective, so it is slower per call than NCCL's in-kernel signalling.
//
// Thread-safety: as ExpertComm: each rank's comm on its own thread; Abort from any thread.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/gpu/expert_comm.h"

namespace pdserve::engine::gpu {

// One communicator per entry of `devices` (rank r on CUDA device devices[r]; a device may repeat),
// sharing one group. InvalidArgument for an empty list or a device outside the present ones;
// Internal for a CUDA error (event creation).
absl::StatusOr<std::vector<std::unique_ptr<ExpertComm>>> CreateLocalComms(
    const std::vector<int>& devices);

}  // namespace pdserve::engine::gpu
