// Helpers for the GPU kernel tests: device detection, guarded device buffers, host bf16
// conversion, fresh random seeds and normalized error. Test-only; not thread-safe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace pdserve::kernels::cuda::testing {

inline bool HasCudaDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

#define PDSERVE_SKIP_WITHOUT_GPU()                             \
  do {                                                         \
    if (!::pdserve::kernels::cuda::testing::HasCudaDevice()) { \
      GTEST_SKIP() << "no CUDA device";                        \
    }                                                          \
  } while (0)

#define PDSERVE_CUDA_OK(expr)                                                     \
  do {                                                                            \
    const cudaError_t pdserve_status = (expr);                                    \
    ASSERT_EQ(pdserve_status, cudaSuccess) << cudaGetErrorString(pdserve_status); \
  } while (0)

// A device array of T with `kGuard` elements of a fixed byte pattern on each side, so a kernel
// that writes out of bounds is caught by GuardsIntact().
template <typename T>
class GuardedBuffer {
 public:
  static constexpr size_t kGuard = 256;
  static constexpr unsigned char kPattern = 0xA5;

  explicit GuardedBuffer(size_t n) : n_(n) {
    const size_t bytes = (n + 2 * kGuard) * sizeof(T);
    if (cudaMalloc(&base_, bytes) != cudaSuccess) base_ = nullptr;
    if (base_ != nullptr) cudaMemset(base_, kPattern, bytes);
  }
  ~GuardedBuffer() { cudaFree(base_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  T* get() { return base_ + kGuard; }
  size_t size() const { return n_; }
  bool ok() const { return base_ != nullptr; }

  void Upload(const std::vector<T>& host) {
    cudaMemcpy(get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> host(n_);
    cudaMemcpy(host.data(), base_ + kGuard, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  // True when no byte of either guard region was overwritten.
  bool GuardsIntact() const {
    std::vector<unsigned char> guard(kGuard * sizeof(T));
    for (const T* region : {base_, base_ + kGuard + n_}) {
      cudaMemcpy(guard.data(), region, guard.size(), cudaMemcpyDeviceToHost);
      for (unsigned char c : guard) {
        if (c != kPattern) return false;
      }
    }
    return true;
  }

 private:
  size_t n_;
  T* base_ = nullptr;
};

inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float FromBf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline constexpr uint16_t kBf16NaN = 0x7FC0;

// A generator seeded freshly for every test; the seed is printed so a failure can be replayed
// with PDSERVE_TEST_SEED=<seed> (every test of that run then starts from it).
inline std::mt19937_64 FreshRng() {
  const char* fixed = std::getenv("PDSERVE_TEST_SEED");
  const uint64_t seed = fixed != nullptr ? std::strtoull(fixed, nullptr, 10)
                                         : (static_cast<uint64_t>(std::random_device{}()) << 32) ^
                                               std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

// n values drawn from N(mean, stddev^2).
inline std::vector<float> NormalValues(std::mt19937_64& rng, size_t n, float mean, float stddev) {
  std::normal_distribution<float> normal(mean, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// ||got - want|| / ||want|| over positions where both are finite; NaN/Inf positions must agree
// (counted in `mismatched`).
struct ErrorReport {
  double normalized = 0.0;
  int64_t mismatched = 0;
};

inline ErrorReport NormalizedError(const std::vector<double>& got,
                                   const std::vector<double>& want) {
  ErrorReport report;
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool got_finite = std::isfinite(got[i]);
    const bool want_finite = std::isfinite(want[i]);
    if (!got_finite || !want_finite) {
      const bool same = (std::isnan(got[i]) && std::isnan(want[i])) || got[i] == want[i];
      report.mismatched += same ? 0 : 1;
      continue;
    }
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  report.normalized = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  return report;
}

// Host storage of a kernel's element type: float, or bf16 held as its uint16_t bit pattern.
template <typename T>
float HostToFloat(T v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return FromBf16(v);
  } else {
    return v;
  }
}
template <typename T>
T HostFromFloat(float f) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return ToBf16(f);
  } else {
    return f;
  }
}
// The device pointer a kernel takes for host storage type T (uint16_t -> __nv_bfloat16).
template <typename T>
auto DevicePtr(GuardedBuffer<T>& buffer) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return reinterpret_cast<__nv_bfloat16*>(buffer.get());
  } else {
    return buffer.get();
  }
}

template <typename T>
std::vector<double> Widen(const std::vector<T>& values) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = HostToFloat(values[i]);
  return out;
}

// got matches want: NaN/Inf at the same positions and normalized error at most `tolerance`.
inline void ExpectNear(const std::vector<double>& got, const std::vector<double>& want,
                       double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const ErrorReport report = NormalizedError(got, want);
  EXPECT_EQ(report.mismatched, 0) << what;
  EXPECT_LE(report.normalized, tolerance) << what;
}

template <typename T>
std::vector<float> ToFloats(const std::vector<T>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = HostToFloat(values[i]);
  return out;
}

// Normalized-error tolerance of a kernel that computes what the fp32 CPU reference computes and
// rounds once to storage type T: fp32 differs by summation order or an ulp of a math function,
// bf16 by at most one bf16 rounding (2^-8 relative).
template <typename T>
inline constexpr double kStorageTolerance = std::is_same_v<T, float> ? 1e-6 : 4e-3;

// got (storage T) against the fp32 reference `want` rounded to T, by ExpectNear.
template <typename T>
void ExpectNearReference(const std::vector<T>& got, const std::vector<float>& want,
                         const std::string& what) {
  std::vector<T> rounded(want.size());
  for (size_t i = 0; i < want.size(); ++i) rounded[i] = HostFromFloat<T>(want[i]);
  ExpectNear(Widen(got), Widen(rounded), kStorageTolerance<T>, what);
}

}  // namespace pdserve::kernels::cuda::testing
