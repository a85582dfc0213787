#include "kvtransfer/ucx/ucx_lane.h"

#include <algorithm>
#include <utility>

namespace pdserve::kv {

int DefaultTransferLanes(unsigned cores) {
  return std::clamp(static_cast<int>(cores / 4), 1, kMaxTransferLanes);
}

absl::StatusOr<std::unique_ptr<UcxLane>> UcxLane::Create(const UcxContext& context) {
  auto worker = UcxWorker::Create(context);
  if (!worker.ok()) return worker.status();
  return std::unique_ptr<UcxLane>(new UcxLane(std::move(*worker)));
}

UcxLane::~UcxLane() { StopThread(); }

void UcxLane::StartThread() {
  stop_.store(false);
  threaded_.store(true);
  thread_ = std::thread([this] { Run(); });
}

void UcxLane::StopThread() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  thread_.join();
  threaded_.store(false);
}

void UcxLane::Run() {
  // The sleep bound: how late a stop or an endpoint error is noticed while the lane is idle.
  constexpr int kIdleWaitMs = 2;
  while (!stop_.load()) {
    int fd = -1;
    {
      absl::MutexLock lock(&mu_);
      worker_.Progress();
      if (busy() > 0) {
        fd = -2;
      } else {
        absl::StatusOr<int> armed = worker_.Arm();
        fd = armed.ok() ? *armed : -3;
      }
    }
    if (fd == -2 || fd == -1) {
      // Work in flight, or events already pending: go round again, letting the owner's thread
      // take the lock for its sends and tests.
      std::this_thread::yield();
    } else if (fd == -3) {
      absl::SleepFor(absl::Milliseconds(kIdleWaitMs));
    } else {
      UcxWorker::WaitReadable(fd, kIdleWaitMs);
    }
  }
}

}  // namespace pdserve::kv
