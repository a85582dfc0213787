#include "engine/gpu/gpu_model_group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "engine/gpu/local_comm.h"
#ifdef PDSERVE_HAVE_NCCL
#include "engine/gpu/nccl_comm.h"
#endif

namespace pdserve::engine::gpu {
namespace {

absl::StatusOr<std::vector<std::unique_ptr<ExpertComm>>> MakeComms(const std::vector<int>& devices,
                                                                   ExpertCommKind kind) {
  const bool distinct = std::set<int>(devices.begin(), devices.end()).size() == devices.size();
#ifdef PDSERVE_HAVE_NCCL
  if (kind == ExpertCommKind::kNccl || (kind == ExpertCommKind::kAuto && distinct)) {
    if (kind == ExpertCommKind::kNccl || NcclVersion().ok()) return CreateNcclComms(devices);
  }
#else
  if (kind == ExpertCommKind::kNccl) {
    return absl::FailedPreconditionError(
        "expert parallelism: this pdserve was built without NCCL (nccl.h was not found at "
        "configure time); use the local communicator");
  }
  (void)distinct;
#endif
  return CreateLocalComms(devices);
}

}  // namespace

absl::StatusOr<ExpertCommKind> ParseExpertCommKind(const std::string& name) {
  if (name == "auto") return ExpertCommKind::kAuto;
  if (name == "nccl") return ExpertCommKind::kNccl;
  if (name == "local") return ExpertCommKind::kLocal;
  return absl::InvalidArgumentError(
      absl::StrCat("expert communicator '", name, "': one of auto, nccl, local"));
}

absl::StatusOr<std::unique_ptr<GpuModelGroup>> GpuModelGroup::Create(const ModelConfig& config,
                                                                     const Weights& weights,
                                                                     GpuGroupOptions options) {
  if (options.devices.empty()) {
    return absl::InvalidArgumentError("GpuModelGroup: no devices");
  }
  int present = 0;
  if (cudaGetDeviceCount(&present) != cudaSuccess || present == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("GpuModelGroup: no CUDA device");
  }
  const auto world = static_cast<int64_t>(options.devices.size());
  if (world > 1 && config.n_routed_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat("GpuModelGroup: ", config.n_routed_experts,
                                                   " routed experts cannot be split over ", world,
                                                   " ranks"));
  }
  std::unique_ptr<GpuModelGroup> group(new GpuModelGroup());
  group->devices_ = options.devices;
  if (world > 1) {
    PDSERVE_ASSIGN_OR_RETURN(group->comms_, MakeComms(options.devices, options.comm));
  }
  for (int64_t r = 0; r < world; ++r) {
    GpuModelOptions model_options = options.model;
    model_options.device = options.devices[static_cast<size_t>(r)];
    model_options.expert_comm = world > 1 ? group->comms_[static_cast<size_t>(r)].get() : nullptr;
    PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<GpuModel> model,
                             GpuModel::Create(config, weights, model_options));
    group->ranks_.push_back(model.get());
    group->owned_.push_back(std::move(model));
  }
  group->StartThreads();
  return group;
}

std::unique_ptr<GpuModelGroup> GpuModelGroup::Single(GpuModel* model) {
  std::unique_ptr<GpuModelGroup> group(new GpuModelGroup());
  group->ranks_.push_back(model);
  return group;
}

std::unique_ptr<GpuModelGroup> GpuModelGroup::Single(std::unique_ptr<GpuModel> model) {
  std::unique_ptr<GpuModelGroup> group = Single(model.get());
  group->owned_.push_back(std::move(model));
  return group;
}

GpuModelGroup::~GpuModelGroup() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
  ranks_.clear();
  owned_.clear();
  comms_.clear();
}

std::string GpuModelGroup::Describe() const {
  if (world() == 1) {
    return devices_.empty() ? "1 rank" : absl::StrCat("1 rank on GPU ", devices_[0]);
  }
  return absl::StrCat(world(), " ranks on GPUs ", absl::StrJoin(devices_, ","), " over ",
                      comms_.empty() ? "(none)" : comms_[0]->Describe());
}

void GpuModelGroup::StartThreads() {
  if (world() == 1) return;
  {
    absl::MutexLock lock(&mu_);
    results_.assign(static_cast<size_t>(world()), absl::OkStatus());
  }
  for (int64_t r = 0; r < world(); ++r) threads_.emplace_back([this, r] { ThreadMain(r); });
}

void GpuModelGroup::AbortComms() {
  for (const auto& comm : comms_) comm->Abort();
}

void GpuModelGroup::ThreadMain(int64_t r) {
  uint64_t seen = 0;
  for (;;) {
    const RankFn* fn = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto job_or_stop = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || job_id_ != seen;
      };
      mu_.Await(absl::Condition(&job_or_stop));
      if (stop_) return;
      seen = job_id_;
      fn = job_;
    }
    absl::Status status = (*fn)(r, *ranks_[static_cast<size_t>(r)]);
    // Abort before reporting: a peer may be waiting for this rank in a collective right now.
    if (!status.ok()) AbortComms();
    absl::MutexLock lock(&mu_);
    results_[static_cast<size_t>(r)] = std::move(status);
    --pending_;
  }
}

std::vector<absl::Status> GpuModelGroup::Run(const RankFn& fn) {
  if (world() == 1) return {fn(0, *ranks_[0])};
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return std::vector<absl::Status>(static_cast<size_t>(world()), broken_);
  job_ = &fn;
  ++job_id_;
  pending_ = world();
  results_.assign(static_cast<size_t>(world()), absl::OkStatus());
  auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ == 0; };
  mu_.Await(absl::Condition(&all_done));
  job_ = nullptr;
  for (const absl::Status& s : results_) {
    if (!s.ok() && broken_.ok()) {
      broken_ = absl::Status(s.code(), absl::StrCat("expert-parallel group broken: ", s.message()));
    }
  }
  return results_;
}

absl::Status GpuModelGroup::broken() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

}  // namespace pdserve::engine::gpu
