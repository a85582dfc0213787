// TaskPool: every task runs exactly once, on several threads, call after call.
#include "common/task_pool.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(TaskPoolTest, RunsEveryTaskOnceForManyAndFewTasks) {
  TaskPool pool(4);
  EXPECT_EQ(pool.threads(), 4);
  for (int64_t n : {0, 1, 3, 4, 5, 1000}) {
    SCOPED_TRACE(n);
    std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
    pool.Run(n, [&](int64_t i) { runs[static_cast<size_t>(i)].fetch_add(1); });
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(runs[static_cast<size_t>(i)].load(), 1) << i;
  }
}

TEST(TaskPoolTest, SpreadsTasksOverItsThreads) {
  TaskPool pool(4);
  std::mutex mu;
  std::set<std::thread::id> ids;
  // Tasks that wait for each other: with fewer than 4 threads taking part this would never end,
  // so reaching the end proves 4 ran at once.
  std::atomic<int> arrived{0};
  pool.Run(4, [&](int64_t) {
    arrived.fetch_add(1);
    while (arrived.load() < 4) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 4u);
}

TEST(TaskPoolTest, OneThreadRunsInOrderOnTheCaller) {
  TaskPool pool(0);
  EXPECT_EQ(pool.threads(), 1);
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<int64_t> order;
  pool.Run(5, [&](int64_t i) {
    EXPECT_EQ(std::this_thread::get_id(), caller);
    order.push_back(i);
  });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3, 4}));
}

TEST(TaskPoolTest, SumsMatchAcrossRepeatedRuns) {
  TaskPool pool(3);
  for (int round = 0; round < 200; ++round) {
    std::atomic<int64_t> sum{0};
    pool.Run(round, [&](int64_t i) { sum.fetch_add(i + 1); });
    EXPECT_EQ(sum.load(), static_cast<int64_t>(round) * (round + 1) / 2) << round;
  }
}

// The prefill shares one pool between its page store (the engine's thread) and the sender's
// checksums (TaskPool's contract: concurrent Run calls are serialized): each call runs its own
// tasks, each exactly once.
TEST(TaskPoolTest, ConcurrentRunsFromSeveralThreadsEachRunTheirOwnTasksOnce) {
  TaskPool pool(3);
  constexpr int kCallers = 4;
  constexpr int kRounds = 100;
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < kRounds; ++round) {
        const int64_t n = 2 + (round * 7 + c * 13) % 61;
        std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
        pool.Run(n, [&](int64_t i) { runs[static_cast<size_t>(i)].fetch_add(1); });
        for (const std::atomic<int>& r : runs) {
          if (r.load() != 1) wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

TEST(TaskPoolTest, DefaultTransferHostThreadsIsHalfTheCoresUpToEight) {
  EXPECT_EQ(DefaultTransferHostThreads(0), 1);
  EXPECT_EQ(DefaultTransferHostThreads(2), 1);
  EXPECT_EQ(DefaultTransferHostThreads(16), 8);
  EXPECT_EQ(DefaultTransferHostThreads(128), 8);
}

}  // namespace
}  // namespace pdserve
