// A process-wide pool of worker threads for simple data-parallel loops on the CPU backend.
//
// ParallelFor splits [0, n) into contiguous ranges, one per thread (the caller takes the first),
// and returns when all are done. Bodies must not call ParallelFor themselves (a nested call runs
// inline) nor OpenBLAS (it has its own threads). Thread-safe: concurrent callers are serialized.
#pragma once

#include <cstdint>
#include <functional>

namespace pdserve::kernels::cpu {

// Runs body(begin, end) over a partition of [0, n). n <= 0 is a no-op.
void ParallelFor(int64_t n, const std::function<void(int64_t begin, int64_t end)>& body);

// Number of threads ParallelFor uses: SetNumThreads's count when it was called before the pool
// started, else std::thread::hardware_concurrency() (at least 1).
int NumThreads();

// Sets the threads ParallelFor and OpenBLAS use (threads >= 1). Takes effect only before the
// first ParallelFor / NumThreads call of the process, which starts the pool; returns false
// (changing nothing) after that unless the count is the same. Call it at process start, before
// other threads run.
bool SetNumThreads(int threads);

}  // namespace pdserve::kernels::cpu
