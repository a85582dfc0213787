#include "engine/gpu/local_comm.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "engine/gpu/device_memory.h"
#include "engine/gpu/ops.cuh"

namespace pdserve::engine::gpu {
namespace {

// What the ranks share. The events and devices are fixed at creation; `sends` of rank p is
// written by p before the first barrier of a collective and read by the others between its two
// barriers (the barrier's mutex orders the accesses), so it needs no lock of its own.
struct LocalGroup {
  explicit LocalGroup(int64_t ranks) : world(ranks), posts(static_cast<size_t>(ranks)) {}

  // Blocks until all `world` ranks have arrived (OK) or the group is aborted (Aborted).
  absl::Status Barrier() {
    absl::MutexLock lock(&mu);
    if (aborted) return absl::AbortedError("local expert communicator: aborted");
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.SignalAll();
      return absl::OkStatus();
    }
    while (generation == gen && !aborted) cv.Wait(&mu);
    if (generation != gen) return absl::OkStatus();
    return absl::AbortedError("local expert communicator: aborted");
  }

  void Abort() {
    absl::MutexLock lock(&mu);
    aborted = true;
    cv.SignalAll();
  }

  struct Post {
    int device = 0;
    cudaEvent_t ready = nullptr;  // recorded after the rank's inputs are written
    cudaEvent_t done = nullptr;   // recorded after the rank has copied from its peers
    std::vector<const void*> sends;
  };

  const int64_t world;
  std::vector<Post> posts;
  absl::Mutex mu;
  absl::CondVar cv;
  int64_t arrived ABSL_GUARDED_BY(mu) = 0;
  uint64_t generation ABSL_GUARDED_BY(mu) = 0;
  bool aborted ABSL_GUARDED_BY(mu) = false;
};

class LocalComm final : public ExpertComm {
 public:
  LocalComm(std::shared_ptr<LocalGroup> group, int64_t rank)
      : group_(std::move(group)), rank_(rank) {}
  ~LocalComm() override {
    LocalGroup::Post& me = Mine();
    cudaSetDevice(me.device);
    if (me.ready != nullptr) cudaEventDestroy(me.ready);
    if (me.done != nullptr) cudaEventDestroy(me.done);
  }

  absl::Status Init(int device) {
    LocalGroup::Post& me = Mine();
    me.device = device;
    PDSERVE_CUDA_RETURN(cudaSetDevice(device));
    PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(&me.ready, cudaEventDisableTiming));
    PDSERVE_CUDA_RETURN(cudaEventCreateWithFlags(&me.done, cudaEventDisableTiming));
    return absl::OkStatus();
  }

  int64_t rank() const override { return rank_; }
  int64_t world() const override { return group_->world; }
  int device() const override { return group_->posts[static_cast<size_t>(rank_)].device; }
  bool graph_capturable() const override { return false; }
  void Abort() override { group_->Abort(); }
  std::string Describe() const override { return "in-process"; }

  absl::Status AllGather(std::span<const Gather> buffers, cudaStream_t stream) override {
    std::vector<const void*> sends;
    for (const Gather& g : buffers) sends.push_back(g.send);
    PDSERVE_RETURN_IF_ERROR(Post(std::move(sends), stream));
    for (int64_t p = 0; p < world(); ++p) {
      const LocalGroup::Post& from = Peer(p);
      for (size_t b = 0; b < buffers.size(); ++b) {
        const Gather& g = buffers[b];
        PDSERVE_CUDA_RETURN(cudaMemcpyPeerAsync(static_cast<char*>(g.recv) + p * g.bytes, device(),
                                                from.sends[b], from.device, g.bytes, stream));
      }
    }
    return Release(stream);
  }

  absl::Status ReduceScatterSum(const float* send, float* recv, size_t count,
                                cudaStream_t stream) override {
    const size_t parts = static_cast<size_t>(world());
    if (staging_.size() < parts * count) {
      // Grown rarely (the largest call so far): wait for the stream before freeing the old one.
      PDSERVE_CUDA_RETURN(cudaStreamSynchronize(stream));
      PDSERVE_RETURN_IF_ERROR(staging_.Allocate(parts * count));
    }
    PDSERVE_RETURN_IF_ERROR(Post({send}, stream));
    for (int64_t p = 0; p < world(); ++p) {
      const LocalGroup::Post& from = Peer(p);
      const auto* block = static_cast<const float*>(from.sends[0]) + rank_ * count;
      PDSERVE_CUDA_RETURN(cudaMemcpyPeerAsync(staging_.get() + p * count, device(), block,
                                              from.device, count * sizeof(float), stream));
    }
    PDSERVE_CUDA_RETURN(
        SumParts(staging_.get(), world(), static_cast<int64_t>(count), recv, stream));
    return Release(stream);
  }

 private:
  LocalGroup::Post& Mine() { return group_->posts[static_cast<size_t>(rank_)]; }
  // Rank p's post (p may be this rank); read only between a collective's two barriers.
  const LocalGroup::Post& Peer(int64_t p) { return group_->posts[static_cast<size_t>(p)]; }

  // Publishes this rank's send buffers once its inputs are written, waits for every rank to do
  // the same, then makes `stream` wait for every peer's inputs.
  absl::Status Post(std::vector<const void*> sends, cudaStream_t stream) {
    LocalGroup::Post& me = Mine();
    PDSERVE_CUDA_RETURN(cudaEventRecord(me.ready, stream));
    me.sends = std::move(sends);
    PDSERVE_RETURN_IF_ERROR(group_->Barrier());
    for (int64_t p = 0; p < world(); ++p) {
      if (p == rank_) continue;
      PDSERVE_CUDA_RETURN(cudaStreamWaitEvent(stream, Peer(p).ready, 0));
    }
    return absl::OkStatus();
  }

  // After this rank's copies are enqueued: no rank's stream may go on to overwrite its send
  // buffers before every peer has copied them.
  absl::Status Release(cudaStream_t stream) {
    PDSERVE_CUDA_RETURN(cudaEventRecord(Mine().done, stream));
    PDSERVE_RETURN_IF_ERROR(group_->Barrier());
    for (int64_t p = 0; p < world(); ++p) {
      if (p == rank_) continue;
      PDSERVE_CUDA_RETURN(cudaStreamWaitEvent(stream, Peer(p).done, 0));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<LocalGroup> group_;
  const int64_t rank_;
  DeviceArray<float> staging_;  // [world, count]: the parts of this rank's block
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<ExpertComm>>> CreateLocalComms(
    const std::vector<int>& devices) {
  PDSERVE_RETURN_IF_ERROR(CheckRankDevices(devices, "local expert communicator"));
  auto group = std::make_shared<LocalGroup>(static_cast<int64_t>(devices.size()));
  std::vector<std::unique_ptr<ExpertComm>> comms;
  for (size_t r = 0; r < devices.size(); ++r) {
    auto comm = std::make_unique<LocalComm>(group, static_cast<int64_t>(r));
    PDSERVE_RETURN_IF_ERROR(comm->Init(devices[r]));
    comms.push_back(std::move(comm));
  }
  return comms;
}

}  // namespace pdserve::engine::gpu
