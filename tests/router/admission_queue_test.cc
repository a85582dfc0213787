// router::AdmissionQueue on its own: first come first served, a try per freed slot, back-offs
// for unsignalled tries, PushBack keeps an entry's place, deadlines and removal.
#include "router/admission_queue.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace pdserve::router {
namespace {

// Records what the queue's thread did, in order ("try a", "expire b").
class Log {
 public:
  void Add(std::string event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(std::move(event));
  }
  std::vector<std::string> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  // Waits (at most 5 s) until `n` events are logged.
  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return events_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(5));
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_ ABSL_GUARDED_BY(mu_);
};

AdmissionQueue::Entry Named(Log& log, const std::string& name,
                            absl::Time deadline = absl::InfiniteFuture(), bool sends = true) {
  AdmissionQueue::Entry e;
  e.deadline = deadline;
  e.admit = [&log, name, sends] {
    log.Add("try " + name);
    return sends;
  };
  e.expire = [&log, name] { log.Add("expire " + name); };
  return e;
}

// Backoffs far longer than the test: only signalled tries happen.
AdmissionQueue::Options NoTimerTries() { return {absl::Seconds(100), absl::Seconds(100)}; }

TEST(AdmissionQueueTest, EachFreedSlotTriesTheNextInArrivalOrder) {
  Log log;
  AdmissionQueue queue(NoTimerTries());
  queue.Push(Named(log, "a"));
  queue.Push(Named(log, "b"));
  queue.Push(Named(log, "c"));
  EXPECT_EQ(queue.size(), 3);
  queue.RoomFreed();
  ASSERT_TRUE(log.WaitFor(1));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(log.events(), std::vector<std::string>{"try a"});  // one slot, one try
  queue.Admitted();  // a found room: b gets a try, room may be left
  ASSERT_TRUE(log.WaitFor(2));
  queue.RoomFreed();
  ASSERT_TRUE(log.WaitFor(3));
  EXPECT_EQ(log.events(), (std::vector<std::string>{"try a", "try b", "try c"}));
  EXPECT_EQ(queue.size(), 0);
}

TEST(AdmissionQueueTest, PushBackKeepsTheEntrysPlace) {
  Log log;
  AdmissionQueue queue(NoTimerTries());
  const uint64_t a = queue.Push(Named(log, "a"));
  queue.Push(Named(log, "b"));
  queue.RoomFreed();
  ASSERT_TRUE(log.WaitFor(1));
  queue.PushBack(a, Named(log, "a again"));  // a's try found no room
  queue.RoomFreed();
  ASSERT_TRUE(log.WaitFor(2));
  EXPECT_EQ(log.events(), (std::vector<std::string>{"try a", "try a again"}));
}

TEST(AdmissionQueueTest, UnsignalledTriesBackOffWithoutABusyLoop) {
  Log log;
  AdmissionQueue queue({absl::Milliseconds(5), absl::Milliseconds(40)});
  uint64_t ticket = 0;
  // The entry never finds room: each try puts it back.
  std::function<AdmissionQueue::Entry()> make = [&] {
    AdmissionQueue::Entry e;
    e.admit = [&] {
      log.Add("try");
      queue.PushBack(ticket, make());
      return true;
    };
    e.expire = [] {};
    return e;
  };
  ticket = queue.Push(make());
  absl::SleepFor(absl::Milliseconds(400));
  const size_t tries = log.events().size();
  // 5, 10, 20, 40, 40, ... ms apart: about 12 in 400 ms.
  EXPECT_GE(tries, 5u);
  EXPECT_LE(tries, 16u);
}

TEST(AdmissionQueueTest, DeadlinePassesWhileWaiting) {
  Log log;
  AdmissionQueue queue(NoTimerTries());
  const absl::Time start = absl::Now();
  queue.Push(Named(log, "late", start + absl::Milliseconds(100)));
  queue.Push(Named(log, "patient"));
  ASSERT_TRUE(log.WaitFor(1));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_EQ(log.events(), std::vector<std::string>{"expire late"});
  EXPECT_EQ(queue.size(), 1);
}

TEST(AdmissionQueueTest, RemovedEntriesAreNeverTried) {
  Log log;
  AdmissionQueue queue(NoTimerTries());
  const uint64_t a = queue.Push(Named(log, "a"));
  queue.Push(Named(log, "b"));
  EXPECT_TRUE(queue.Remove(a));
  EXPECT_FALSE(queue.Remove(a));
  queue.RoomFreed();
  ASSERT_TRUE(log.WaitFor(1));
  EXPECT_EQ(log.events(), std::vector<std::string>{"try b"});
}

TEST(AdmissionQueueTest, ATryForAGoneRequestPassesItOn) {
  Log log;
  AdmissionQueue queue(NoTimerTries());
  queue.Push(Named(log, "gone", absl::InfiniteFuture(), /*sends=*/false));
  queue.Push(Named(log, "b"));
  queue.RoomFreed();  // one slot: "gone" sends nothing, so b gets the try
  ASSERT_TRUE(log.WaitFor(2));
  EXPECT_EQ(log.events(), (std::vector<std::string>{"try gone", "try b"}));
}

}  // namespace
}  // namespace pdserve::router
