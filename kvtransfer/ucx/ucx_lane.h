// A lane: one UCX worker, the mutex that serializes every UCX call on it, and (when threaded) the
// thread that progresses it. A transfer spread over several lanes moves its pages through
// several workers, endpoints and threads at once, so no single core bounds it
// (docs/protocol.md, "Lanes").
//
// Thread-safety: every UCX call on worker() and on the endpoints and requests made from it must
// hold mu(). A threaded lane's callbacks (AM handlers, send and receive completions, endpoint
// errors) run on its thread with mu() held.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/env_switch.h"
#include "kvtransfer/ucx/ucx.h"

namespace pdserve::kv {

// A send a lane's thread posts for its owner (UcxTransport's page sends with several lanes), so
// the posting (and the copy UCX makes there for an eager message) runs on the lane's core, not
// on the owner's. Both calls run with the lane's mu() held; a send leaves the lane's queue and
// is posted (or abandoned) within one hold of mu(), so whoever holds mu() finds it either still
// queued (Withdraw) or posted.
class LaneSend {
 public:
  virtual ~LaneSend() = default;
  // Posts the send (on the lane's thread).
  virtual void Post() = 0;
  // The send will never be posted (its endpoint closed): it completes with `status`.
  virtual void Abandon(absl::Status status) = 0;
  virtual ucp_ep_h endpoint() const = 0;
};

// How many lanes a transfer endpoint uses when the deployment does not say (transfer.lanes 0):
// one per four cores of the host, at least 1 and at most kMaxTransferLanes, so a 2-core machine
// runs one lane and a 16-core GPU host four. `cores` 0 (unknown) gives 1.
inline constexpr int kMaxTransferLanes = 16;
int DefaultTransferLanes(unsigned cores);

// How long a lane's thread keeps progressing its worker (yielding between rounds) after it last
// posted or received something, before it arms the worker's event fd and sleeps: a wake-up by
// the event fd can be missed on UCX 1.13's shared-memory transports (the thread then sleeps out
// its 2 ms; measured: a commit or a page reference delivered 1-2 ms late, docs/perf.md), and a
// transfer's messages come in bursts. PDSERVE_LANE_LINGER_US from the environment (read once),
// else kDefaultLaneLingerUs; 0: sleep as soon as idle.
inline constexpr int64_t kDefaultLaneLingerUs = 0;
// The longest linger taken from the environment: 5x the lane's 2 ms idle wait, which a linger
// exists to beat. A larger value is clamped to it: a lane that lingered for minutes would keep
// a core busy after every transfer (breaker58: 99999999999999 kept two idle workers at 60% CPU
// each with 4 lanes).
inline constexpr int64_t kMaxLaneLingerUs = 10'000;
// `text` as PDSERVE_LANE_LINGER_US, in microseconds (kernels::ParseSwitchNumber): null or empty
// gives the default; a whole number in [0, kMaxLaneLingerUs] itself; a larger one (up to
// INT64_MAX) the maximum, a negative one 0; anything else (a fractional number, trailing text,
// past INT64_MAX) the default; each of the last three with a warning.
kernels::SwitchReading<int64_t> ParseLaneLingerUs(const char* text);
// PDSERVE_LANE_LINGER_US from the environment, read once; its warning, if any, is logged at that
// first read (kernels/env_switch.h; the workers read it at start).
absl::Duration LaneLinger();

class UcxLane {
 public:
  // A lane with a fresh worker of `context`. Errors: UcsToStatus of the worker's creation.
  static absl::StatusOr<std::unique_ptr<UcxLane>> Create(const UcxContext& context);
  UcxLane(const UcxLane&) = delete;
  UcxLane& operator=(const UcxLane&) = delete;
  // Stops the thread (if started); the worker goes with the lane.
  ~UcxLane();

  // Starts the thread that progresses the worker: it spins (yielding) while busy() > 0 and
  // otherwise sleeps on the worker's event fd for at most 2 ms at a time; a send posted on the
  // lane wakes it (Wake). Call once.
  void StartThread();
  // Stops and joins the thread; no callback of this lane runs after it returns. Idempotent.
  void StopThread();
  // Between StartThread and the end of StopThread (so a lane thread still running sees true).
  // Thread-safe.
  bool threaded() const { return threaded_.load(); }

  // Runs `fn` after each progress of the worker by the lane's thread (with the lane's mutex
  // held): what the lane's handlers queued in that progress is finished there in one batch (the
  // receive transport's GPU page landings). Set before the thread starts or with the mutex held.
  void SetAfterProgress(std::function<void()> fn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    after_progress_ = std::move(fn);
  }
  absl::Mutex& mu() ABSL_LOCK_RETURNED(mu_) { return mu_; }
  UcxWorker& worker() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return worker_; }
  // The packed address of the worker (immutable after creation; no lock needed).
  const std::vector<std::byte>& address() const { return address_; }
  // Wakes the thread if it sleeps (the caller just posted or queued work on the lane). Signals
  // (a system call) only when the thread armed the worker's event fd since it last woke: a
  // thread that is awake looks at its queue and its worker before it sleeps again. Thread-safe.
  void Wake() {
    if (sleeping_.exchange(false)) worker_.Signal();  // ucp_worker_signal: any thread.
  }
  // Queues `send` for the lane's thread to post (it must stay alive until posted, withdrawn or
  // abandoned); sends post in the order queued. Takes only the queue's own lock, not mu(): the
  // owner does not wait for the lane's progress to queue a page. REQUIRES: threaded().
  void Submit(LaneSend* send) ABSL_LOCKS_EXCLUDED(queue_mu_);
  // Removes `send` if still queued; returns whether it was.
  bool Withdraw(LaneSend* send) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_LOCKS_EXCLUDED(queue_mu_);
  // Abandons every queued send on endpoint `ep` with `status` (before the endpoint closes).
  void AbandonFor(ucp_ep_h ep, const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_)
      ABSL_LOCKS_EXCLUDED(queue_mu_);
  // Operations whose completion needs progress (pending sends, rendezvous receives); the thread
  // spins while this is positive. Thread-safe.
  void AddBusy(int delta) { busy_.fetch_add(delta, std::memory_order_relaxed); }
  int busy() const { return busy_.load(std::memory_order_relaxed); }

 private:
  explicit UcxLane(UcxWorker worker) : worker_(std::move(worker)), address_(worker_.address()) {}
  void Run();

  // Posts up to `limit` queued sends (the thread, under mu_).
  void PostQueued(int limit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) ABSL_LOCKS_EXCLUDED(queue_mu_);

  absl::Mutex mu_;
  // The worker's handle is immutable after creation; every UCX call on it needs mu_, except
  // ucp_worker_signal (Wake).
  UcxWorker worker_;
  std::function<void()> after_progress_ ABSL_GUARDED_BY(mu_);  // SetAfterProgress
  // Acquired after mu_ where both are held; never held around a UCX call.
  absl::Mutex queue_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::deque<LaneSend*> submitted_ ABSL_GUARDED_BY(queue_mu_);  // Queued, not yet posted.
  std::atomic<size_t> queued_{0};  // submitted_.size(), readable without queue_mu_.
  // The thread armed the event fd and may be asleep on it (or about to be); no signal sent since.
  std::atomic<bool> sleeping_{false};
  const std::vector<std::byte> address_;
  std::atomic<int> busy_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> threaded_{false};
  std::thread thread_;  // Started and joined by the owner's thread only.
};

}  // namespace pdserve::kv
