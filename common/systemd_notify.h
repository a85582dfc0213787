// systemd service notifications (sd_notify(3)) for Type=notify units: READY once serving,
// STOPPING on shutdown, STATUS lines, and WATCHDOG keep-alives from a background thread while
// the process's work loops make progress (WatchdogSec= in the unit restarts a wedged process).
//
// A no-op when NOTIFY_SOCKET is unset (not started by systemd: tests, `pdserve up`, a shell).
// The watchdog runs only when systemd asked for one (WATCHDOG_USEC, sd_watchdog_enabled(3)); it
// pings every half interval, as sd_watchdog_enabled(3) recommends.
//
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/progress_heartbeat.h"

namespace pdserve::systemd {

class Notifier {
 public:
  // Reads NOTIFY_SOCKET and WATCHDOG_USEC from the environment now.
  Notifier();
  ~Notifier();  // stops the watchdog thread
  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;

  // True when started under systemd with a notify socket.
  bool enabled() const { return enabled_; }
  // The watchdog interval systemd asked for; zero when none.
  std::chrono::microseconds watchdog_interval() const { return watchdog_interval_; }

  void Ready();
  void Stopping();
  void Status(absl::string_view text);
  // Starts pinging WATCHDOG=1 every watchdog_interval()/2 while every one of `loops` beat within
  // the last watchdog_interval()/2 (or is idle: common/progress_heartbeat.h), so a loop wedged
  // that long stops the pings and systemd restarts the process within WatchdogSec. No-op without
  // a watchdog. REQUIRES: called at most once; the heartbeats outlive the notifier.
  void StartWatchdog(std::vector<const ProgressHeartbeat*> loops);

 private:
  void Send(const std::string& state);

  bool enabled_ = false;
  std::chrono::microseconds watchdog_interval_{0};
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread watchdog_;
};

}  // namespace pdserve::systemd
