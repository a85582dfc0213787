#include "engine/gpu/nccl_comm.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "engine/gpu/device_memory.h"

namespace pdserve::engine::gpu {
namespace {

// The NCCL functions this file calls, resolved from libnccl.so.2 at run time.
struct NcclApi {
  decltype(&ncclGetVersion) GetVersion = nullptr;
  decltype(&ncclGetErrorString) GetErrorString = nullptr;
  decltype(&ncclCommInitAll) CommInitAll = nullptr;
  decltype(&ncclCommDestroy) CommDestroy = nullptr;
  decltype(&ncclCommAbort) CommAbort = nullptr;
  decltype(&ncclGroupStart) GroupStart = nullptr;
  decltype(&ncclGroupEnd) GroupEnd = nullptr;
  decltype(&ncclAllGather) AllGather = nullptr;
  decltype(&ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&ncclSend) Send = nullptr;
  decltype(&ncclRecv) Recv = nullptr;
  std::string error;  // why loading failed; empty when every pointer is set
};

const NcclApi& Api() {
  static const NcclApi api = [] {
    NcclApi a;
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) lib = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      a.error = absl::StrCat("cannot load libnccl.so.2: ", why != nullptr ? why : "unknown");
      return a;
    }
    // Never dlclose'd: the communicators may live until exit.
    auto load = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, name));
      if (*fn == nullptr && a.error.empty()) a.error = absl::StrCat("libnccl.so.2 lacks ", name);
    };
    load(&a.GetVersion, "ncclGetVersion");
    load(&a.GetErrorString, "ncclGetErrorString");
    load(&a.CommInitAll, "ncclCommInitAll");
    load(&a.CommDestroy, "ncclCommDestroy");
    load(&a.CommAbort, "ncclCommAbort");
    load(&a.GroupStart, "ncclGroupStart");
    load(&a.GroupEnd, "ncclGroupEnd");
    load(&a.AllGather, "ncclAllGather");
    load(&a.ReduceScatter, "ncclReduceScatter");
    load(&a.Send, "ncclSend");
    load(&a.Recv, "ncclRecv");
    return a;
  }();
  return api;
}

absl::Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": NCCL error ", static_cast<int>(r), " (", Api().GetErrorString(r), ")"));
}

#define PDSERVE_NCCL_RETURN(expr) PDSERVE_RETURN_IF_ERROR(NcclStatus((expr), #expr))

class NcclComm final : public ExpertComm {
 public:
  NcclComm(ncclComm_t comm, int64_t rank, int64_t world, int device, const void* group)
      : comm_(comm), rank_(rank), world_(world), device_(device), group_(group) {}
  ~NcclComm() override {
    absl::MutexLock lock(&mu_);
    if (comm_ != nullptr) {
      cudaSetDevice(device_);
      Api().CommDestroy(comm_);
    }
  }

  int64_t rank() const override { return rank_; }
  int64_t world() const override { return world_; }
  int device() const override { return device_; }
  bool graph_capturable() const override { return true; }
  std::string Describe() const override {
    absl::StatusOr<std::string> version = NcclVersion();
    return absl::StrCat("nccl ", version.ok() ? *version : "(unknown version)");
  }

  void Abort() override {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return;
    // Ends kernels of this rank waiting for a peer that will not come.
    Api().CommAbort(comm_);
    comm_ = nullptr;
  }

  absl::Status AllGather(std::span<const Gather> buffers, cudaStream_t stream) override {
    absl::MutexLock lock(&mu_);
    PDSERVE_RETURN_IF_ERROR(Usable());
    PDSERVE_NCCL_RETURN(Api().GroupStart());
    for (const Gather& g : buffers) {
      const ncclResult_t r = Api().AllGather(g.send, g.recv, g.bytes, ncclUint8, comm_, stream);
      if (r != ncclSuccess) {
        Api().GroupEnd();
        return NcclStatus(r, "ncclAllGather");
      }
    }
    PDSERVE_NCCL_RETURN(Api().GroupEnd());
    return absl::OkStatus();
  }

  absl::Status ReduceScatterSum(const float* send, float* recv, size_t count,
                                cudaStream_t stream) override {
    absl::MutexLock lock(&mu_);
    PDSERVE_RETURN_IF_ERROR(Usable());
    PDSERVE_NCCL_RETURN(
        Api().ReduceScatter(send, recv, count, ncclFloat32, ncclSum, comm_, stream));
    return absl::OkStatus();
  }

  // For NcclSendRecv: the handle, and whether two comms belong to one ncclCommInitAll group.
  ncclComm_t handle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return comm_; }
  const void* group() const { return group_; }
  absl::Mutex& mu() ABSL_LOCK_RETURNED(mu_) { return mu_; }

 private:
  absl::Status Usable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (comm_ == nullptr) return absl::AbortedError("NCCL expert communicator: aborted");
    return absl::OkStatus();
  }

  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);
  const int64_t rank_;
  const int64_t world_;
  const int device_;
  const void* const group_;  // identity of the ncclCommInitAll call that made this comm
};

}  // namespace

absl::StatusOr<std::string> NcclVersion() {
  const NcclApi& api = Api();
  if (!api.error.empty()) return absl::FailedPreconditionError(api.error);
  int version = 0;
  PDSERVE_NCCL_RETURN(api.GetVersion(&version));
  // NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9.
  return absl::StrCat(version / 10000, ".", version / 100 % 100, ".", version % 100);
}

absl::StatusOr<std::vector<std::unique_ptr<ExpertComm>>> CreateNcclComms(
    const std::vector<int>& devices) {
  PDSERVE_RETURN_IF_ERROR(CheckRankDevices(devices, "NCCL expert communicator"));
  for (size_t r = 0; r < devices.size(); ++r) {
    if (std::count(devices.begin(), devices.end(), devices[r]) > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "NCCL expert communicator: device ", devices[r],
          " named twice (NCCL runs one rank per GPU; the local communicator allows more)"));
    }
  }
  const NcclApi& api = Api();
  if (!api.error.empty()) return absl::FailedPreconditionError(api.error);
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  std::vector<ncclComm_t> handles(devices.size(), nullptr);
  PDSERVE_NCCL_RETURN(
      api.CommInitAll(handles.data(), static_cast<int>(devices.size()), devices.data()));
  std::vector<std::unique_ptr<ExpertComm>> comms;
  const void* group = handles[0];
  for (size_t r = 0; r < devices.size(); ++r) {
    comms.push_back(std::make_unique<NcclComm>(handles[r], static_cast<int64_t>(r),
                                               static_cast<int64_t>(devices.size()), devices[r],
                                               group));
  }
  return comms;
}

absl::Status NcclSendRecv(ExpertComm& from, const void* send, cudaStream_t from_stream,
                          ExpertComm& to, void* recv, cudaStream_t to_stream, size_t bytes) {
  auto* a = dynamic_cast<NcclComm*>(&from);
  auto* b = dynamic_cast<NcclComm*>(&to);
  if (a == nullptr || b == nullptr || a->group() != b->group() || a->rank() == b->rank()) {
    return absl::InvalidArgumentError("NcclSendRecv: needs two ranks of one NCCL group");
  }
  absl::MutexLock lock_a(&a->mu());
  absl::MutexLock lock_b(&b->mu());
  if (a->handle() == nullptr || b->handle() == nullptr) {
    return absl::AbortedError("NcclSendRecv: aborted communicator");
  }
  const NcclApi& api = Api();
  PDSERVE_NCCL_RETURN(api.GroupStart());
  const ncclResult_t s =
      api.Send(send, bytes, ncclUint8, static_cast<int>(b->rank()), a->handle(), from_stream);
  const ncclResult_t r =
      api.Recv(recv, bytes, ncclUint8, static_cast<int>(a->rank()), b->handle(), to_stream);
  PDSERVE_NCCL_RETURN(api.GroupEnd());
  PDSERVE_NCCL_RETURN(s);
  PDSERVE_NCCL_RETURN(r);
  return absl::OkStatus();
}

}  // namespace pdserve::engine::gpu
