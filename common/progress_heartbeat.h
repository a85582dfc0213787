// A work loop's proof of progress for the systemd watchdog (common/systemd_notify.h). The loop
// calls Beat() each time it moves on: a decode step, a prefill chunk, one turn of an event loop,
// and also an idle wait that ended by its bounded timeout, so an idle loop stays alive. A loop
// whose wait for work has no bound (prefill: until a request comes) calls Idle() before it waits;
// an idle heartbeat counts as fresh until the next Beat(). The watchdog pings only while every
// loop's Age() is below half of WatchdogSec, so a loop wedged past that (a hung kernel, a
// deadlock) stops the pings and systemd restarts the process.
//
// Thread-safety: every method may be called from any thread (one atomic).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "absl/time/time.h"

namespace pdserve {

class ProgressHeartbeat {
 public:
  // Starts idle: a loop that has not begun yet is not a stuck one.
  ProgressHeartbeat() = default;
  ProgressHeartbeat(const ProgressHeartbeat&) = delete;
  ProgressHeartbeat& operator=(const ProgressHeartbeat&) = delete;

  // The loop made progress now (and is not idle).
  void Beat() { last_ns_.store(NowNs(), std::memory_order_relaxed); }
  // The loop waits for work without a bound: fresh until the next Beat().
  void Idle() { last_ns_.store(kIdle, std::memory_order_relaxed); }
  // Time since the last Beat() (steady clock); zero while idle.
  absl::Duration Age() const {
    const int64_t last = last_ns_.load(std::memory_order_relaxed);
    return last == kIdle ? absl::ZeroDuration() : absl::Nanoseconds(NowNs() - last);
  }

 private:
  static constexpr int64_t kIdle = INT64_MIN;
  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  std::atomic<int64_t> last_ns_{kIdle};
};

}  // namespace pdserve
