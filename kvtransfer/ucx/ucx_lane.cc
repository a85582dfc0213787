#include "kvtransfer/ucx/ucx_lane.h"

#include <algorithm>
#include <utility>
#include <vector>

namespace pdserve::kv {
namespace {

constexpr char kLaneLingerSwitch[] = "PDSERVE_LANE_LINGER_US";

}  // namespace

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
  AddBusy(1);  // Until posted (then the send's own busy count, if it needs progress).
  {
    absl::MutexLock lock(&queue_mu_);
    submitted_.push_back(send);
    queued_.store(submitted_.size());
  }
  // After the push (seq_cst, as the thread's store of sleeping_ and load of queued_ before it
  // sleeps): either the thread sees the send queued, or this sees it asleep and signals.
  Wake();
}

bool UcxLane::Withdraw(LaneSend* send) {
  absl::MutexLock lock(&queue_mu_);
  auto it = std::find(submitted_.begin(), submitted_.end(), send);
  if (it == submitted_.end()) return false;
  submitted_.erase(it);
  queued_.store(submitted_.size());
  AddBusy(-1);
  return true;
}

void UcxLane::AbandonFor(ucp_ep_h ep, const absl::Status& status) {
  std::vector<LaneSend*> abandoned;
  {
    absl::MutexLock lock(&queue_mu_);
    for (auto it = submitted_.begin(); it != submitted_.end();) {
      if ((*it)->endpoint() != ep) {
        ++it;
        continue;
      }
      abandoned.push_back(*it);
      it = submitted_.erase(it);
      AddBusy(-1);
    }
    queued_.store(submitted_.size());
  }
  for (LaneSend* send : abandoned) send->Abandon(status);
}

void UcxLane::PostQueued(int limit) {
  std::vector<LaneSend*> batch;
  {
    absl::MutexLock lock(&queue_mu_);
    while (static_cast<int>(batch.size()) < limit && !submitted_.empty()) {
      batch.push_back(submitted_.front());
      submitted_.pop_front();
    }
    queued_.store(submitted_.size());
  }
  // Still under mu_: a send taken off the queue is posted before anyone else holds mu_.
  for (LaneSend* send : batch) {
    AddBusy(-1);
    send->Post();
  }
}

kernels::SwitchReading<int64_t> ParseLaneLingerUs(const char* text) {
  return kernels::ParseSwitchNumber(kLaneLingerSwitch, text, kDefaultLaneLingerUs, 0,
                                    kMaxLaneLingerUs);
}

absl::Duration LaneLinger() {
  static const absl::Duration linger = absl::Microseconds(kernels::TakeSwitchReading(
      kLaneLingerSwitch, ParseLaneLingerUs(kernels::SwitchText(kLaneLingerSwitch))));
  return linger;
}

void UcxLane::Run() {
  // The sleep bound: how late a stop or an endpoint error is noticed while the lane is idle.
  constexpr int kIdleWaitMs = 2;
  // Queued sends posted per round before the worker is progressed again.
  constexpr int kPostBatch = 16;
  const absl::Duration linger = LaneLinger();
  absl::Time active_at = absl::InfinitePast();
  while (!stop_.load()) {
    int fd = -1;
    {
      absl::MutexLock lock(&mu_);
      sleeping_.store(false);
      // The owner's queued sends first, a bounded batch so its own lock requests get through.
      const bool posted = queued_.load() > 0;
      if (posted) PostQueued(kPostBatch);
      const bool progressed = worker_.Progress();
      if (after_progress_) after_progress_();
      if (linger > absl::ZeroDuration() && (posted || progressed)) active_at = absl::Now();
      if (busy() > 0 || (linger > absl::ZeroDuration() && absl::Now() - active_at < linger)) {
        fd = -2;
      } else {
        absl::StatusOr<int> armed = worker_.Arm();
        fd = armed.ok() ? *armed : -3;
        if (fd >= 0) {
          sleeping_.store(true);
          // A send queued before that store found the lane awake and did not signal it.
          if (queued_.load() > 0 && sleeping_.exchange(false)) fd = -2;
        }
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
