// An expert-parallel group of GpuModels (engine/gpu/gpu_model.h): one rank per GPU of a worker
// (or, for tests, several ranks on one GPU), each holding its block of the routed experts and a
// replica of everything else, plus the communicators their MoE layers share and one thread per
// rank that drives the rank's model, so the ranks' collectives meet (docs/engine-gpu.md,
// "Several GPUs").
//
// A one-rank group is a plain GpuModel: no communicator, no thread (Run calls on the caller), the
// model's arithmetic unchanged. runtime::GpuStepRunner and runtime::GpuPrefillEngine drive every
// CUDA model through a group, so one code path serves one GPU and several.
//
// Thread-safety: Run from one thread at a time (a server's step loop); rank(r) may be used
// directly (ResetSlot, ImportState, ExportState, ExportLayerAsync, CopySlot: calls with no
// collective) from that thread between Runs. Create and destroy from one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/config.h"
#include "engine/gpu/expert_comm.h"
#include "engine/gpu/gpu_model.h"
#include "engine/weights.h"

namespace pdserve::engine::gpu {

enum class ExpertCommKind {
  kAuto,   // NCCL when built with it, libnccl.so.2 loads and the devices are distinct; else local
  kNccl,   // engine/gpu/nccl_comm.h (one GPU per rank)
  kLocal,  // engine/gpu/local_comm.h (any devices, eager decode)
};

// "auto" / "nccl" / "local"; InvalidArgument otherwise.
absl::StatusOr<ExpertCommKind> ParseExpertCommKind(const std::string& name);

struct GpuGroupOptions {
  std::vector<int> devices = {0};  // rank r on CUDA device devices[r]
  ExpertCommKind comm = ExpertCommKind::kAuto;
  // Every rank's options; `device` and `expert_comm` are set per rank by Create.
  GpuModelOptions model;
};

class GpuModelGroup {
 public:
  using RankFn = std::function<absl::Status(int64_t rank, GpuModel& model)>;

  // Creates the communicators (none for one device) and one GpuModel per device, each uploading
  // its share of `weights` (the host copy is read, not kept). Errors: InvalidArgument for no
  // devices, a model whose routed experts cannot be split over the ranks (fewer experts than
  // ranks), NCCL asked for with a repeated device; FailedPrecondition when NCCL is asked for and
  // not available, or no CUDA device is present; GpuModel::Create's.
  static absl::StatusOr<std::unique_ptr<GpuModelGroup>> Create(const ModelConfig& config,
                                                               const Weights& weights,
                                                               GpuGroupOptions options);
  // A one-rank group over `model` (not owned; it must outlive the group).
  static std::unique_ptr<GpuModelGroup> Single(GpuModel* model);
  // A one-rank group owning `model`.
  static std::unique_ptr<GpuModelGroup> Single(std::unique_ptr<GpuModel> model);

  // Stops the rank threads, then frees the models, then the communicators.
  ~GpuModelGroup();
  GpuModelGroup(const GpuModelGroup&) = delete;
  GpuModelGroup& operator=(const GpuModelGroup&) = delete;

  int64_t world() const { return static_cast<int64_t>(ranks_.size()); }
  GpuModel& rank(int64_t r) { return *ranks_[static_cast<size_t>(r)]; }
  const GpuModel& rank(int64_t r) const { return *ranks_[static_cast<size_t>(r)]; }
  // "1 rank on GPU 0" / "2 ranks on GPUs 0,1 over nccl 2.28.9": for logs.
  std::string Describe() const;

  // Runs fn(r, rank(r)) for every rank at once, rank r on its own thread (one rank: on the
  // caller), and returns each rank's status once all have returned. fn must make the same
  // lock-step calls on every rank (GpuModel's header). When a rank's fn fails, the group's
  // communicators are aborted at once, so no other rank waits for it in a collective; a group of
  // several ranks is then broken for good: later Runs return that failure for every rank without
  // calling fn (the ranks' collectives can no longer be matched). A one-rank group never breaks.
  std::vector<absl::Status> Run(const RankFn& fn);
  // OK, or the failure that broke the group.
  absl::Status broken() const;

 private:
  GpuModelGroup() = default;
  void StartThreads();
  void ThreadMain(int64_t r);
  void AbortComms();

  std::vector<std::unique_ptr<ExpertComm>> comms_;  // outlive the models (declared first)
  std::vector<std::unique_ptr<GpuModel>> owned_;
  std::vector<GpuModel*> ranks_;
  std::vector<int> devices_;

  mutable absl::Mutex mu_;
  const RankFn* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t job_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pending_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<absl::Status> results_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // empty for one rank
};

}  // namespace pdserve::engine::gpu
