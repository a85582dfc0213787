// Owning device and pinned-host arrays for the GPU engine, and the status helpers its host code
// shares. Not thread-safe; move-only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/launch_check.h"

namespace pdserve::engine::gpu {

// `what` failed with `e`; for a launcher's refusal (cudaErrorInvalidValue) the message also says
// which argument check failed (kernels/cuda/launch_check.h). A failure is also taken off the
// thread's last-error slot (cudaGetLastError; sticky errors stay): reported once here, it must
// not come back from the next launch's check (a failed cudaMalloc made a later, good kernel
// launch return "out of memory": the IPC arena's GPU test, 2026-12-05).
inline absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string refusal =
      e == cudaErrorInvalidValue ? kernels::cuda::TakeLaunchRefusal() : std::string();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e),
                                          refusal.empty() ? "" : " (", refusal,
                                          refusal.empty() ? "" : ")"));
}

#define PDSERVE_CUDA_RETURN(expr)                                                               \
  do {                                                                                          \
    const absl::Status pdserve_cuda_status = ::pdserve::engine::gpu::CudaStatus((expr), #expr); \
    if (!pdserve_cuda_status.ok()) return pdserve_cuda_status;                                  \
  } while (0)

// n elements of T in device memory (uninitialized unless Zero() / Upload()).
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(DeviceArray&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), n_(o.n_) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  absl::Status Allocate(size_t n) {
    cudaFree(ptr_);
    ptr_ = nullptr;
    n_ = n;
    if (n == 0) return absl::OkStatus();
    return CudaStatus(cudaMalloc(&ptr_, n * sizeof(T)), "cudaMalloc");
  }
  absl::Status Upload(const std::vector<T>& host) {
    if (absl::Status s = Allocate(host.size()); !s.ok()) return s;
    if (host.empty()) return absl::OkStatus();
    return CudaStatus(
        cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
        "cudaMemcpy");
  }
  // n elements from host memory at `host` (pageable; any alignment).
  absl::Status Upload(const T* host, size_t n) {
    if (absl::Status s = Allocate(n); !s.ok()) return s;
    if (n == 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpy(ptr_, host, n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  // Fills every byte with `byte` (0 for zeros; 0xFF makes NaN for float / bf16 state).
  absl::Status Fill(int byte) {
    if (n_ == 0) return absl::OkStatus();
    return CudaStatus(cudaMemset(ptr_, byte, n_ * sizeof(T)), "cudaMemset");
  }

  T* get() { return ptr_; }
  const T* get() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// n elements of T in page-locked host memory (staging for asynchronous copies).
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  ~PinnedArray() { cudaFreeHost(ptr_); }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;

  absl::Status Allocate(size_t n) {
    cudaFreeHost(ptr_);
    ptr_ = nullptr;
    n_ = n;
    if (n == 0) return absl::OkStatus();
    return CudaStatus(cudaMallocHost(&ptr_, n * sizeof(T)), "cudaMallocHost");
  }
  T* get() { return ptr_; }
  T& operator[](size_t i) { return ptr_[i]; }
  size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace pdserve::engine::gpu
