#include <utility>

#include "kernels/cuda/launch_check.h"

namespace pdserve::kernels::cuda {
namespace {

thread_local std::string last_refusal;

}  // namespace

cudaError_t RefuseLaunch(const char* launcher, const char* check) {
  last_refusal = std::string(launcher) + ": argument check failed: " + check;
  return cudaErrorInvalidValue;
}

std::string TakeLaunchRefusal() { return std::exchange(last_refusal, std::string()); }

}  // namespace pdserve::kernels::cuda
