#include "common/systemd_notify.h"

#include <systemd/sd-daemon.h>

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace pdserve::systemd {

Notifier::Notifier() {
  const char* socket = std::getenv("NOTIFY_SOCKET");
  enabled_ = socket != nullptr && socket[0] != '\0';
  uint64_t usec = 0;
  if (enabled_ && sd_watchdog_enabled(/*unset_environment=*/0, &usec) > 0) {
    watchdog_interval_ = std::chrono::microseconds(usec);
  }
}

Notifier::~Notifier() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
}

void Notifier::Send(const std::string& state) {
  if (enabled_) sd_notify(/*unset_environment=*/0, state.c_str());
}

void Notifier::Ready() { Send("READY=1"); }
void Notifier::Stopping() { Send("STOPPING=1"); }
void Notifier::Status(absl::string_view text) { Send(absl::StrCat("STATUS=", text)); }

void Notifier::StartWatchdog(std::vector<const ProgressHeartbeat*> loops) {
  if (!enabled_ || watchdog_interval_.count() == 0) return;
  const absl::Duration period = absl::Microseconds(watchdog_interval_.count() / 2);
  watchdog_ = std::thread([this, period, loops = std::move(loops)] {
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) {
      const bool progressing = std::all_of(loops.begin(), loops.end(),
                                           [&](const auto* loop) { return loop->Age() < period; });
      if (progressing) Send("WATCHDOG=1");
    }
  });
}

}  // namespace pdserve::systemd
