// The sd_notify wrapper against a real AF_UNIX datagram socket standing in for systemd's.
#include "common/systemd_notify.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

namespace pdserve::systemd {
namespace {

class NotifySocket {
 public:
  NotifySocket() {
    path_ = (std::filesystem::temp_directory_path() /
             ("pdserve-notify-" + std::to_string(getpid()) + ".sock"))
                .string();
    unlink(path_.c_str());
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    path_.copy(addr.sun_path, sizeof(addr.sun_path) - 1);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  ~NotifySocket() {
    close(fd_);
    unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  // The next datagram, or "" when none arrives within `timeout_ms`.
  std::string Receive(int timeout_ms = 2000) {
    timeval timeout{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    char buf[256];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, n) : "";
  }

 private:
  std::string path_;
  int fd_ = -1;
};

TEST(SystemdNotifyTest, NoOpWithoutNotifySocket) {
  unsetenv("NOTIFY_SOCKET");
  Notifier notifier;
  EXPECT_FALSE(notifier.enabled());
  notifier.Ready();
  notifier.StartWatchdog([] { return true; });
  EXPECT_EQ(notifier.watchdog_interval().count(), 0);
}

TEST(SystemdNotifyTest, SendsReadyAndStatus) {
  NotifySocket socket;
  setenv("NOTIFY_SOCKET", socket.path().c_str(), 1);
  unsetenv("WATCHDOG_USEC");
  Notifier notifier;
  ASSERT_TRUE(notifier.enabled());
  notifier.Ready();
  EXPECT_EQ(socket.Receive(), "READY=1");
  notifier.Status("serving");
  EXPECT_EQ(socket.Receive(), "STATUS=serving");
  unsetenv("NOTIFY_SOCKET");
}

TEST(SystemdNotifyTest, WatchdogPingsOnlyWhileHealthy) {
  NotifySocket socket;
  setenv("NOTIFY_SOCKET", socket.path().c_str(), 1);
  setenv("WATCHDOG_USEC", "100000", 1);
  setenv("WATCHDOG_PID", std::to_string(getpid()).c_str(), 1);
  std::atomic<bool> healthy{true};
  {
    Notifier notifier;
    EXPECT_EQ(notifier.watchdog_interval().count(), 100000);
    notifier.StartWatchdog([&healthy] { return healthy.load(); });
    EXPECT_EQ(socket.Receive(), "WATCHDOG=1");
    healthy = false;
    // Pings are 50 ms apart: after 120 ms any ping sent before the switch has arrived.
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
    while (!socket.Receive(1).empty()) {
    }
    EXPECT_EQ(socket.Receive(300), "");
  }
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  unsetenv("WATCHDOG_PID");
}

}  // namespace
}  // namespace pdserve::systemd
