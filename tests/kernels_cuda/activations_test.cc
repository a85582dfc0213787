// kernels/cuda/activations against the CPU reference (kernels/cpu/activations.h, ClampedSwiGlu),
// fp32 and bf16.
#include "kernels/cuda/activations.cuh"

#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/activations.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DevicePtr;
using testing::GuardedBuffer;
using testing::HostFromFloat;
using testing::HostToFloat;
using testing::ToFloats;

constexpr float kLimit = 10.0f;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

template <typename T>
class CudaSwiGluTest : public ::testing::Test {
 protected:
  // The fused expert layout: input [rows, 2 * cols + pad] holding [gate | up | NaN pad], output
  // [rows, cols + pad] whose pad must stay untouched. `special` entries overwrite random ones.
  void ExpectFusedMatchesCpu(int64_t rows, int64_t cols, int64_t pad, float scale,
                             const std::vector<std::pair<int64_t, float>>& special = {}) {
    const std::string what = "rows " + std::to_string(rows) + " cols " + std::to_string(cols) +
                             " pad " + std::to_string(pad) + " scale " + std::to_string(scale);
    const int64_t in_stride = 2 * cols + pad;
    const int64_t out_stride = cols + pad;
    std::normal_distribution<float> normal;
    std::vector<T> in(static_cast<size_t>(rows * in_stride));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < in_stride; ++i) {
        in[r * in_stride + i] = HostFromFloat<T>(i < 2 * cols ? scale * normal(rng_) : kNaN);
      }
    }
    for (const auto& [index, value] : special) in[index] = HostFromFloat<T>(value);
    const std::vector<T> out_init(static_cast<size_t>(rows * out_stride), HostFromFloat<T>(-7.0f));
    GuardedBuffer<T> d_in(in.size());
    GuardedBuffer<T> d_out(out_init.size());
    ASSERT_TRUE(d_in.ok() && d_out.ok());
    d_in.Upload(in);
    d_out.Upload(out_init);
    PDSERVE_CUDA_OK(clamped_swiglu(DevicePtr(d_in), DevicePtr(d_in) + cols, rows, cols, in_stride,
                                   kLimit, DevicePtr(d_out), out_stride, nullptr));
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<T> got = d_out.Download();
    EXPECT_TRUE(d_in.GuardsIntact() && d_out.GuardsIntact()) << what;

    std::vector<float> want = ToFloats(out_init);
    std::vector<float> gate(static_cast<size_t>(cols));
    std::vector<float> up(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < cols; ++i) {
        gate[i] = HostToFloat(in[r * in_stride + i]);
        up[i] = HostToFloat(in[r * in_stride + cols + i]);
      }
      cpu::ClampedSwiGlu(gate.data(), up.data(), cols, kLimit, want.data() + r * out_stride);
    }
    testing::ExpectNearReference(got, want, what);
  }

  std::mt19937_64 rng_ = testing::FreshRng();
};

using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(CudaSwiGluTest, StorageTypes);

TYPED_TEST(CudaSwiGluTest, OddShapesAndNaNPaddingMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  this->ExpectFusedMatchesCpu(1, 1, 0, 3.0f);
  this->ExpectFusedMatchesCpu(7, 13, 3, 3.0f);
  this->ExpectFusedMatchesCpu(33, 2048, 0, 3.0f);
  this->ExpectFusedMatchesCpu(3, 1001, 5, 3.0f);
  // More elements than one pass of the grid covers.
  this->ExpectFusedMatchesCpu(600, 2048, 8, 3.0f);
}

TYPED_TEST(CudaSwiGluTest, ClampsLargeValuesAndKeepsNonFinite) {
  PDSERVE_SKIP_WITHOUT_GPU();
  // rows 2, cols 64: gate of row 0 at 0..63, up at 64..127.
  this->ExpectFusedMatchesCpu(2, 64, 0, 1e6f,
                              {{0, kNaN}, {1, kInf}, {2, -kInf}, {64 + 3, kNaN}, {64 + 4, kInf}});
}

TYPED_TEST(CudaSwiGluTest, FlatInPlaceMatchesCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const int64_t n = 5003;
  std::normal_distribution<float> normal;
  std::vector<T> gate(n);
  std::vector<T> up(n);
  for (T& v : gate) v = HostFromFloat<T>(20.0f * normal(this->rng_));
  for (T& v : up) v = HostFromFloat<T>(20.0f * normal(this->rng_));
  GuardedBuffer<T> d_gate(gate.size());
  GuardedBuffer<T> d_up(up.size());
  ASSERT_TRUE(d_gate.ok() && d_up.ok());
  d_gate.Upload(gate);
  d_up.Upload(up);
  PDSERVE_CUDA_OK(clamped_swiglu(DevicePtr(d_gate), DevicePtr(d_up), 1, n, n, kLimit,
                                 DevicePtr(d_gate), n, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<T> got = d_gate.Download();
  EXPECT_TRUE(d_gate.GuardsIntact());
  std::vector<float> want = ToFloats(gate);
  const std::vector<float> up_f = ToFloats(up);
  cpu::ClampedSwiGlu(want.data(), up_f.data(), n, kLimit, want.data());
  testing::ExpectNearReference(got, want, "flat in place");
}

TYPED_TEST(CudaSwiGluTest, ZeroLengthWritesNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  GuardedBuffer<T> buffer(8);
  ASSERT_TRUE(buffer.ok());
  const std::vector<T> init(8, HostFromFloat<T>(1.0f));
  buffer.Upload(init);
  PDSERVE_CUDA_OK(clamped_swiglu(DevicePtr(buffer), DevicePtr(buffer), 0, 8, 8, kLimit,
                                 DevicePtr(buffer), 8, nullptr));
  PDSERVE_CUDA_OK(clamped_swiglu(DevicePtr(buffer), DevicePtr(buffer), 1, 0, 8, kLimit,
                                 DevicePtr(buffer), 8, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(buffer.Download(), init);
  EXPECT_TRUE(buffer.GuardsIntact());
}

TYPED_TEST(CudaSwiGluTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  GuardedBuffer<T> buffer(64);
  auto* p = DevicePtr(buffer);
  EXPECT_EQ(clamped_swiglu(p, p, 1, 16, 8, kLimit, p, 16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(clamped_swiglu(p, p, 1, 16, 16, kLimit, p, 8, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(clamped_swiglu(p, decltype(p){nullptr}, 1, 16, 16, kLimit, p, 16, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(clamped_swiglu(p, p, -1, 16, 16, kLimit, p, 16, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
