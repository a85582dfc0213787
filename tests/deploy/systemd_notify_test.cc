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
  notifier.StartWatchdog({});
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

// WATCHDOG_USEC=200 ms: pings every 100 ms while each loop beat within the last 100 ms.
class WatchdogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("NOTIFY_SOCKET", socket_.path().c_str(), 1);
    setenv("WATCHDOG_USEC", "200000", 1);
    setenv("WATCHDOG_PID", std::to_string(getpid()).c_str(), 1);
  }
  void TearDown() override {
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
  }
  // Reads datagrams until none comes for `quiet_ms` (at most for 1 s); returns when the last one
  // came (`since` when none came).
  std::chrono::steady_clock::time_point LastPing(std::chrono::steady_clock::time_point since,
                                                 int quiet_ms) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (std::chrono::steady_clock::now() < give_up && !socket_.Receive(quiet_ms).empty()) {
      since = std::chrono::steady_clock::now();
    }
    return since;
  }

  NotifySocket socket_;
};

TEST_F(WatchdogTest, StuckLoopStopsThePingsWithinWatchdogSec) {
  ProgressHeartbeat loop;
  std::atomic<bool> stuck{false};
  std::thread worker([&] {
    while (!stuck) {
      loop.Beat();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  {
    Notifier notifier;
    EXPECT_EQ(notifier.watchdog_interval().count(), 200000);
    notifier.StartWatchdog({&loop});
    EXPECT_EQ(socket_.Receive(), "WATCHDOG=1");
    EXPECT_EQ(socket_.Receive(), "WATCHDOG=1");
    stuck = true;
    worker.join();
    const auto stalled = std::chrono::steady_clock::now();
    // A ping may still come while the last beat is younger than 100 ms; none after that.
    const auto last = LastPing(stalled, /*quiet_ms=*/150);
    EXPECT_LT(last - stalled, std::chrono::milliseconds(200)) << "pings went on past WatchdogSec";
    EXPECT_EQ(socket_.Receive(600), "");
  }
}

TEST_F(WatchdogTest, IdleLoopKeepsPinging) {
  ProgressHeartbeat loop;  // never beat: idle from the start
  ProgressHeartbeat waiting;
  waiting.Beat();
  waiting.Idle();  // waits for work without a bound
  Notifier notifier;
  notifier.StartWatchdog({&loop, &waiting});
  for (int i = 0; i < 5; ++i) EXPECT_EQ(socket_.Receive(), "WATCHDOG=1") << "ping " << i;
}

TEST_F(WatchdogTest, OneStuckLoopOfTwoStopsThePings) {
  ProgressHeartbeat idle;
  ProgressHeartbeat stuck;
  stuck.Beat();  // and never again
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  Notifier notifier;
  notifier.StartWatchdog({&idle, &stuck});
  // The first ping is due 100 ms after the start, when the stuck beat is 120 ms old.
  EXPECT_EQ(socket_.Receive(500), "");
}

}  // namespace
}  // namespace pdserve::systemd
