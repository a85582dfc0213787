// The collectives an expert-parallel GpuModel (engine/gpu/gpu_model.h, GpuModelOptions::
// expert_comm) runs in every MoE layer: one ExpertComm per rank of a group, each used by the
// thread that drives that rank's GpuModel, on that model's CUDA stream.
//
// Two implementations: engine/gpu/nccl_comm.h (NCCL, one GPU per rank, CUDA-graph capturable)
// and engine/gpu/local_comm.h (ranks that are threads of one process: peer copies and a host
// barrier; any devices, also several ranks on ONE GPU, which NCCL refuses: how the sharding is
// tested on a one-GPU machine; eager only).
//
// Contract of every collective: all ranks of the group call the same collectives in the same
// order with the same sizes (lock step; engine/expert_parallel.h agrees on the sizes first). A
// rank that stops calling leaves the others waiting until Abort. Buffers are device memory on
// the rank's device; the call enqueues work on `stream` and returns (the result is ready in
// stream order), except that the local implementation blocks the host until every rank has
// enqueued its part.
//
// Thread-safety: each ExpertComm is driven by one thread at a time; Abort may be called from any
// thread at any time.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::engine::gpu {

class ExpertComm {
 public:
  // One buffer of an all-gather: `bytes` from `send` on every rank land in `recv`
  // [world * bytes], rank p's at offset p * bytes (rank-major, so rows of equal-sized blocks
  // stack into one [world * rows, ...] array).
  struct Gather {
    const void* send = nullptr;
    void* recv = nullptr;
    size_t bytes = 0;
  };

  virtual ~ExpertComm() = default;

  virtual int64_t rank() const = 0;
  virtual int64_t world() const = 0;
  virtual int device() const = 0;  // the CUDA device of this rank's buffers and stream

  // All-gathers every buffer of `buffers` (one collective for all of them; `bytes` may differ
  // between buffers but not between ranks). `send` must not overlap `recv`. Errors: Internal for
  // a CUDA / NCCL failure, Aborted after Abort (the group is then unusable).
  virtual absl::Status AllGather(std::span<const Gather> buffers, cudaStream_t stream) = 0;

  // recv[i] = sum over ranks p of send_p[rank() * count + i], i < count; send [world * count]
  // fp32, recv [count] fp32, not overlapping. The sum's order is fixed for a group (the same
  // inputs give the same bits), but it is not the order of a one-GPU sum. Errors as AllGather.
  virtual absl::Status ReduceScatterSum(const float* send, float* recv, size_t count,
                                        cudaStream_t stream) = 0;

  // Whether the collectives may be captured into a CUDA graph (GpuModel's decode graphs): NCCL
  // yes; the local implementation no (its host barrier would not run at replay), so a GpuModel
  // on it decodes eagerly.
  virtual bool graph_capturable() const = 0;

  // Makes every rank's current and later collectives of the group fail with Aborted instead of
  // waiting for a rank that will not come (a rank whose call failed). Idempotent.
  virtual void Abort() = 0;

  // "nccl 2.28.9" / "in-process": for logs.
  virtual std::string Describe() const = 0;
};

// OK when `devices` (one entry per rank) is non-empty and names only present CUDA devices; else
// InvalidArgument prefixed with `who`. What every communicator checks before it starts.
inline absl::Status CheckRankDevices(const std::vector<int>& devices, const char* who) {
  if (devices.empty()) return absl::InvalidArgumentError(absl::StrCat(who, ": no ranks"));
  int present = 0;
  if (cudaGetDeviceCount(&present) != cudaSuccess) {
    cudaGetLastError();
    present = 0;
  }
  for (int d : devices) {
    if (d < 0 || d >= present) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": device ", d, " outside the ", present, " present"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::engine::gpu
