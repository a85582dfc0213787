#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/launch_check.h"

namespace pdserve::kernels::cuda {
namespace {

thread_local std::string last_refusal;

// (kernel, device) -> the dynamic shared-memory limit set there, under SmemMutex(). Never
// destroyed: a launch on another thread may still ask while the process exits.
std::mutex& SmemMutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::map<std::pair<const void*, int>, int>& SmemSet() {
  static auto* set = new std::map<std::pair<const void*, int>, int>;
  return *set;
}

}  // namespace

cudaError_t RefuseLaunch(const char* launcher, const char* check) {
  last_refusal = std::string(launcher) + ": argument check failed: " + check;
  return cudaErrorInvalidValue;
}

std::string TakeLaunchRefusal() { return std::exchange(last_refusal, std::string()); }

cudaError_t SetMaxDynamicSharedMemory(const void* func, int bytes) {
  int device = 0;
  const cudaError_t current = cudaGetDevice(&device);
  if (current != cudaSuccess) return current;
  const std::lock_guard<std::mutex> lock(SmemMutex());
  std::map<std::pair<const void*, int>, int>& done = SmemSet();
  const auto key = std::make_pair(func, device);
  const auto it = done.find(key);
  if (it != done.end() && it->second >= bytes) return cudaSuccess;
  const cudaError_t set =
      cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (set == cudaSuccess) done[key] = bytes;
  return set;
}

}  // namespace pdserve::kernels::cuda
