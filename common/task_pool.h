// A small fixed pool of host threads for the data-parallel host work around a state transfer:
// the prefill's page store and checksums, the decode's page import (docs/protocol.md,
// "Host threads of a transfer"). Unlike kernels/cpu/parallel.h (the CPU engine's process-wide
// pool, split into one contiguous range per thread), a TaskPool is owned by whoever runs the
// work, and its tasks are handed out one index at a time from a shared counter, so uneven tasks
// (64 KiB entry pages next to a few compressor rows) still spread evenly.
//
// Thread-safety: Run may be called from any thread; concurrent Run calls are serialized. A task
// must not call Run on the same pool (it would deadlock).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace pdserve {

class TaskPool {
 public:
  // A pool of `threads` threads in all, the caller of Run being one of them (so threads - 1 are
  // started here); threads < 1 counts as 1 (every task runs on the caller, in index order).
  explicit TaskPool(int threads);
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;
  // Joins the threads. REQUIRES: no Run in progress.
  ~TaskPool();

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs task(i) once for every i in [0, n) on the pool's threads and the caller, and returns
  // when all have returned. Tasks start in index order (not necessarily finish in it); n <= 0
  // runs nothing.
  void Run(int64_t n, const std::function<void(int64_t)>& task);

 private:
  void Work();
  // Takes and runs tasks of the current job until none is left.
  void Drain();

  std::mutex run_mu_;  // Serializes Run calls.
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  const std::function<void(int64_t)>* task_ = nullptr;  // Guarded by mu_; null: no job.
  int64_t tasks_ = 0;                                   // Guarded by mu_.
  uint64_t generation_ = 0;                             // Guarded by mu_.
  int active_ = 0;                                      // Workers inside a job; mu_.
  bool stop_ = false;                                   // Guarded by mu_.
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> finished_{0};
  std::vector<std::thread> workers_;
};

// The host threads a transfer's page work uses when the deployment does not say: half the
// host's cores, at least 1 and at most 8 (memory bandwidth, not cores, bounds these copies past
// a few threads). `cores` 0 (unknown) gives 1.
int DefaultTransferHostThreads(unsigned cores);

}  // namespace pdserve
