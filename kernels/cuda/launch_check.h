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

// cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) for the current
// device, once per (func, device) while `bytes` is not above what was set: CUDA keeps the
// attribute per device (it sets it for the current device's instance of the kernel), so a
// process that launches a kernel on several devices (engine/gpu/local_comm.cc: one thread per
// GPU) must set it on each. A failure is returned and not remembered (the next call tries
// again). Thread-safe (one mutex; launchers call it before each launch). `func` is the kernel
// (a __global__ function's address).
cudaError_t SetMaxDynamicSharedMemory(const void* func, int bytes);

}  // namespace pdserve::kernels::cuda

// Returns RefuseLaunch(launcher, "cond") from the enclosing function unless `cond` holds. One
// check per macro, so the refusal names the argument that failed it.
#define PDSERVE_LAUNCH_REQUIRE(launcher, cond)                                   \
  do {                                                                           \
    if (!(cond)) return ::pdserve::kernels::cuda::RefuseLaunch(launcher, #cond); \
  } while (0)
