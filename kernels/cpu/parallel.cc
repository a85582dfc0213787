#include "kernels/cpu/parallel.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

// Workers sleep on a condition variable between jobs, so they leave the cores to OpenBLAS while
// a GEMM runs. The pool lives for the whole process (never destroyed: no join at exit).
class ThreadPool {
 public:
  explicit ThreadPool(int threads) : threads_(threads) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
    for (auto& w : workers_) w.detach();
  }

  int threads() const { return threads_; }

  void Run(int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    std::lock_guard<std::mutex> run_lock(run_mu_);
    const int parts = static_cast<int>(std::min<int64_t>(threads_, n));
    {
      std::lock_guard<std::mutex> lock(mu_);
      body_ = &body;
      n_ = n;
      parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    cv_.notify_all();
    RunPart(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  void RunPart(int part) {
    const int64_t begin = n_ * part / parts_;
    const int64_t end = n_ * (part + 1) / parts_;
    if (begin < end) (*body_)(begin, end);
  }

  void WorkerLoop(int index) {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= parts_) continue;
      }
      RunPart(index);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  const int threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t n_ = 0;
  int parts_ = 0;
  int pending_ = 0;
  uint64_t generation_ = 0;
};

std::atomic<int> requested_threads{0};  // SetNumThreads's count; 0: all cores
std::atomic<bool> pool_started{false};

ThreadPool& Pool() {
  static ThreadPool* pool = [] {
    pool_started = true;
    const int requested = requested_threads.load();
    return new ThreadPool(requested > 0
                              ? requested
                              : std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  }();
  return *pool;
}

thread_local bool in_parallel_region = false;

}  // namespace

int NumThreads() { return Pool().threads(); }

bool SetNumThreads(int threads) {
  if (threads < 1) return false;
  if (pool_started.load()) return Pool().threads() == threads;
  requested_threads = threads;
  openblas_set_num_threads(threads);
  return true;
}

void ParallelFor(int64_t n, const std::function<void(int64_t begin, int64_t end)>& body) {
  if (n <= 0) return;
  if (in_parallel_region || n == 1 || Pool().threads() == 1) {
    body(0, n);
    return;
  }
  Pool().Run(n, [&body](int64_t begin, int64_t end) {
    in_parallel_region = true;
    body(begin, end);
    in_parallel_region = false;
  });
}

}  // namespace pdserve::kernels::cpu
