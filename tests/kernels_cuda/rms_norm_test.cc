// kernels/cuda/rms_norm against the CPU reference (kernels/cpu/rms_norm.h), fp32 and bf16.
#include "kernels/cuda/rms_norm.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/rms_norm.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DevicePtr;
using testing::GuardedBuffer;
using testing::HostFromFloat;
using testing::ToFloats;

constexpr float kEps = 1e-6f;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct NormCase {
  int64_t rows;
  int64_t dim;
  int64_t stride;
  bool weighted;
  bool in_place;
};

std::string Describe(const NormCase& c) {
  return "rows " + std::to_string(c.rows) + " dim " + std::to_string(c.dim) + " stride " +
         std::to_string(c.stride) + (c.weighted ? " weighted" : "") +
         (c.in_place ? " in place" : "");
}

template <typename T>
class CudaRmsNormTest : public ::testing::Test {
 protected:
  // Runs the kernel on `x` ([rows, stride]: slots past dim should hold NaN) and checks the whole
  // output buffer, tails included, against the CPU reference, plus the guards.
  void ExpectMatchesCpu(const NormCase& c, const std::vector<T>& x, const std::vector<T>& weight) {
    const std::vector<T> y_init(x.size(), HostFromFloat<T>(-3.0f));
    GuardedBuffer<T> d_x(x.size());
    GuardedBuffer<T> d_w(weight.size());
    GuardedBuffer<T> d_y(x.size());
    ASSERT_TRUE(d_x.ok() && d_w.ok() && d_y.ok());
    d_x.Upload(x);
    d_w.Upload(weight);
    d_y.Upload(y_init);
    GuardedBuffer<T>& d_out = c.in_place ? d_x : d_y;
    PDSERVE_CUDA_OK(rms_norm(DevicePtr(d_x), c.weighted ? DevicePtr(d_w) : nullptr, c.rows, c.dim,
                             c.stride, kEps, DevicePtr(d_out), nullptr));
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<T> got = d_out.Download();
    EXPECT_TRUE(d_x.GuardsIntact() && d_y.GuardsIntact()) << Describe(c);

    // The reference allocates only after the kernel ran.
    const std::vector<float> xf = ToFloats(x);
    const std::vector<float> wf = ToFloats(weight);
    std::vector<float> yf = ToFloats(c.in_place ? x : y_init);
    cpu::RmsNorm(xf.data(), c.weighted ? wf.data() : nullptr, c.rows, c.dim, c.stride, kEps,
                 yf.data());
    testing::ExpectNearReference(got, yf, Describe(c));
  }

  // Random rows of N(0, scale^2) with NaN in every slot past dim; weights around 1.
  void ExpectRandomMatchesCpu(const NormCase& c, float scale) {
    std::normal_distribution<float> normal;
    std::vector<T> x(static_cast<size_t>(c.rows * c.stride));
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int64_t i = 0; i < c.stride; ++i) {
        x[r * c.stride + i] = HostFromFloat<T>(i < c.dim ? scale * normal(rng_) : kNaN);
      }
    }
    std::vector<T> weight(static_cast<size_t>(c.dim));
    for (T& w : weight) w = HostFromFloat<T>(1.0f + 0.5f * normal(rng_));
    ExpectMatchesCpu(c, x, weight);
  }

  std::mt19937_64 rng_ = testing::FreshRng();
};

using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(CudaRmsNormTest, StorageTypes);

TYPED_TEST(CudaRmsNormTest, OddShapesAndNaNTailsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  // Warp rows and block rows, 16-byte and scalar accesses, row tails of NaN.
  for (const NormCase& c : std::vector<NormCase>{{1, 1, 1, true, false},
                                                 {7, 13, 17, true, false},
                                                 {65, 512, 512, false, false},
                                                 {9, 512, 520, true, false},
                                                 {3, 4096, 4100, true, false},
                                                 {33, 1000, 1003, false, false},
                                                 {2, 16384, 16384, false, false}}) {
    this->ExpectRandomMatchesCpu(c, 1.0f);
  }
}

TYPED_TEST(CudaRmsNormTest, InPlaceMatchesCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  for (const NormCase& c :
       std::vector<NormCase>{{11, 512, 512, true, true}, {5, 4099, 4101, true, true}}) {
    this->ExpectRandomMatchesCpu(c, 3.0f);
  }
}

TYPED_TEST(CudaRmsNormTest, LargeAndTinyValuesMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  // 1e19: squares overflow fp32, the fp64 sum of squares does not. 1e-20: squares underflow.
  for (float scale : {1e19f, 1e-20f}) {
    this->ExpectRandomMatchesCpu({6, 4096, 4096, true, false}, scale);
    this->ExpectRandomMatchesCpu({6, 24, 24, false, false}, scale);
  }
}

TYPED_TEST(CudaRmsNormTest, NonFiniteInputStaysInItsRow) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const NormCase c{4, 300, 300, true, false};
  std::normal_distribution<float> normal;
  std::vector<T> x(static_cast<size_t>(c.rows * c.stride));
  for (T& v : x) v = HostFromFloat<T>(normal(this->rng_));
  x[1 * c.stride + 17] = HostFromFloat<T>(kNaN);
  x[2 * c.stride + 5] = HostFromFloat<T>(std::numeric_limits<float>::infinity());
  std::vector<T> weight(static_cast<size_t>(c.dim), HostFromFloat<T>(1.0f));
  this->ExpectMatchesCpu(c, x, weight);
}

TYPED_TEST(CudaRmsNormTest, ZeroRowsOrDimWritesNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  GuardedBuffer<T> x(8);
  GuardedBuffer<T> y(8);
  ASSERT_TRUE(x.ok() && y.ok());
  const std::vector<T> init(8, HostFromFloat<T>(2.0f));
  x.Upload(init);
  y.Upload(init);
  PDSERVE_CUDA_OK(rms_norm(DevicePtr(x), nullptr, 0, 8, 8, kEps, DevicePtr(y), nullptr));
  PDSERVE_CUDA_OK(rms_norm(DevicePtr(x), nullptr, 1, 0, 8, kEps, DevicePtr(y), nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(y.Download(), init);
  EXPECT_TRUE(y.GuardsIntact());
}

TYPED_TEST(CudaRmsNormTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  GuardedBuffer<T> x(16);
  GuardedBuffer<T> y(16);
  EXPECT_EQ(rms_norm(DevicePtr(x), nullptr, 1, 16, 8, kEps, DevicePtr(y), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(rms_norm(DevicePtr(x), nullptr, -1, 16, 16, kEps, DevicePtr(y), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      rms_norm(DevicePtr(x), nullptr, 1, 16, 16, kEps, decltype(DevicePtr(y)){nullptr}, nullptr),
      cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
