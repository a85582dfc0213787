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

void UcxLane::Submit(LaneSend* send) {
  submitted_.push_back(send);
  AddBusy(1);  // Until posted (then the send's own busy count, if it needs progress).
  Wake();
}

bool UcxLane::Withdraw(LaneSend* send) {
  auto it = std::find(submitted_.begin(), submitted_.end(), send);
  if (it == submitted_.end()) return false;
  submitted_.erase(it);
  AddBusy(-1);
  return true;
}

void UcxLane::AbandonFor(ucp_ep_h ep, const absl::Status& status) {
  for (auto it = submitted_.begin(); it != submitted_.end();) {
    if ((*it)->endpoint() != ep) {
      ++it;
      continue;
    }
    LaneSend* send = *it;
    it = submitted_.erase(it);
    AddBusy(-1);
    send->Abandon(status);
  }
}

void UcxLane::Run() {
  // The sleep bound: how late a stop or an endpoint error is noticed while the lane is idle.
  constexpr int kIdleWaitMs = 2;
  // Queued sends posted per round before the worker is progressed again.
  constexpr int kPostBatch = 16;
  while (!stop_.load()) {
    int fd = -1;
    {
      absl::MutexLock lock(&mu_);
      sleeping_ = false;
      // The owner's queued sends first, a bounded batch so its own lock requests get through.
      for (int posted = 0; posted < kPostBatch && !submitted_.empty(); ++posted) {
        LaneSend* send = submitted_.front();
        submitted_.pop_front();
        AddBusy(-1);
        send->Post();
      }
      worker_.Progress();
      if (busy() > 0) {
        fd = -2;
      } else {
        absl::StatusOr<int> armed = worker_.Arm();
        fd = armed.ok() ? *armed : -3;
        sleeping_ = fd >= 0;
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
