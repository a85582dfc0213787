// ExpertComm (engine/gpu/expert_comm.h) over NCCL: one communicator per GPU of a group, made in
// this process by ncclCommInitAll (the ranks of a worker are threads of one process, each driving
// its own GPU). The collectives are ncclAllGather (bytes, grouped) and ncclReduceScatter (fp32
// sum) on the caller's stream; they may be captured into CUDA graphs, so an expert-parallel
// GpuModel keeps its graph decode.
//
// The library is loaded at run time (dlopen of libnccl.so.2): building needs only nccl.h, and a
// pdserve binary runs where NCCL is absent (one-GPU workers never need it; a multi-GPU group then
// uses the local communicator, engine/gpu/local_comm.h). NVLink multicast stays off:
// CreateNcclComms sets NCCL_NVLS_ENABLE=0 in the environment before NCCL reads it (a program that
// uses multicast can take a host's shared GPUs out of service).
//
// Thread-safety: as ExpertComm. Create and destroy the group's comms from one thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/gpu/expert_comm.h"

namespace pdserve::engine::gpu {

// OK with NCCL's version ("2.28.9") when libnccl.so.2 can be loaded and has every function this
// file calls; FailedPrecondition naming the loader's error otherwise. Loads it once per process.
absl::StatusOr<std::string> NcclVersion();

// One NCCL communicator per entry of `devices` (rank r on CUDA device devices[r]). Sets
// NCCL_NVLS_ENABLE=0 first (call it before other threads read the environment).
// InvalidArgument for an empty list, a repeated device (NCCL needs one GPU per rank: use
// CreateLocalComms to put several ranks on one GPU) or a device outside the present ones;
// FailedPrecondition when NCCL cannot be loaded; Internal for an NCCL error.
absl::StatusOr<std::vector<std::unique_ptr<ExpertComm>>> CreateNcclComms(
    const std::vector<int>& devices);

// `bytes` from `send` of rank `from` to `recv` of rank `to` of the same NCCL group as one
// ncclSend / ncclRecv pair, called from one thread for both ranks: the benchmark's baseline for
// moving a request's state between two GPUs (bench/ep). InvalidArgument for comms not of one
// NCCL group or equal ranks; Internal for an NCCL error.
absl::Status NcclSendRecv(ExpertComm& from, const void* send, cudaStream_t from_stream,
                          ExpertComm& to, void* recv, cudaStream_t to_stream, size_t bytes);

}  // namespace pdserve::engine::gpu
