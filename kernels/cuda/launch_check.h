// Argument checks of the CUDA launchers. A launcher that refuses its arguments returns
// cudaErrorInvalidValue, as the CUDA runtime does, and records which check failed, naming the
// argument: "rms_norm: argument check failed: stride >= dim". The caller that turns the error
// into a message (engine/gpu's CudaStatus) takes the record with TakeLaunchRefusal.
//
// Plain C++ (no device code), so host code compiled without nvcc includes it too.
// Thread-safety: the record is per thread; a launcher's refusal is taken on the thread that
// called it.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace pdserve::kernels::cuda {

// Records "`launcher`: argument check failed: `check`" as this thread's launch refusal (replacing
// any earlier one) and returns cudaErrorInvalidValue.
cudaError_t RefuseLaunch(const char* launcher, const char* check);

// This thread's last launch refusal, which it clears; empty when none was recorded since the
// last call.
std::string TakeLaunchRefusal();

}  // namespace pdserve::kernels::cuda

// Returns RefuseLaunch(launcher, "cond") from the enclosing function unless `cond` holds. One
// check per macro, so the refusal names the argument that failed it.
#define PDSERVE_LAUNCH_REQUIRE(launcher, cond)                                   \
  do {                                                                           \
    if (!(cond)) return ::pdserve::kernels::cuda::RefuseLaunch(launcher, #cond); \
  } while (0)
