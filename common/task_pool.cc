#include "common/task_pool.h"

#include <algorithm>

namespace pdserve {

TaskPool::TaskPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { Work(); });
}

TaskPool::~TaskPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void TaskPool::Drain() {
  const std::function<void(int64_t)>& task = *task_;
  for (int64_t i = next_.fetch_add(1); i < tasks_; i = next_.fetch_add(1)) {
    task(i);
    finished_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void TaskPool::Work() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || (task_ != nullptr && generation_ != seen); });
      if (stop_) return;
      seen = generation_;
      ++active_;
    }
    // task_ and tasks_ stay set until every active worker has left (Run waits for active_ 0).
    Drain();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --active_;
    }
    idle_.notify_all();
  }
}

void TaskPool::Run(int64_t n, const std::function<void(int64_t)>& task) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = &task;
    tasks_ = n;
    next_.store(0);
    finished_.store(0);
    ++generation_;
  }
  wake_.notify_all();
  Drain();
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] { return active_ == 0 && finished_.load() == n; });
  task_ = nullptr;
}

int DefaultTransferHostThreads(unsigned cores) {
  return std::clamp(static_cast<int>(cores / 2), 1, 8);
}

}  // namespace pdserve
