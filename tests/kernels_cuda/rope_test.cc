// kernels/cuda/rope against the CPU path: engine/rope_table.cc's cos / sin rule (below, in
// ReferenceAngles) followed by kernels/cpu/rope.h, fp32 and bf16.
#include "kernels/cuda/rope.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/rope.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DevicePtr;
using testing::GuardedBuffer;
using testing::HostFromFloat;
using testing::ToFloats;

struct RopeCase {
  int64_t rows;
  int64_t row_stride;
  int64_t heads;
  int64_t head_dim;
  int64_t rope_dim;
  bool inverse;
};

std::string Describe(const RopeCase& c) {
  return "rows " + std::to_string(c.rows) + " stride " + std::to_string(c.row_stride) + " heads " +
         std::to_string(c.heads) + " head_dim " + std::to_string(c.head_dim) + " rope_dim " +
         std::to_string(c.rope_dim) + (c.inverse ? " inverse" : "");
}

// cos / sin [rows, rope_dim / 2] as engine::RopeTable::Compute forms them: fp32 angle, fp64
// cos / sin rounded to fp32, times the attention factor.
void ReferenceAngles(const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                     float attention_scaling, std::vector<float>* cos, std::vector<float>* sin) {
  const size_t half = inv_freq.size();
  cos->resize(positions.size() * half);
  sin->resize(positions.size() * half);
  for (size_t p = 0; p < positions.size(); ++p) {
    for (size_t i = 0; i < half; ++i) {
      const double angle = inv_freq[i] * static_cast<float>(positions[p]);
      (*cos)[p * half + i] = static_cast<float>(std::cos(angle)) * attention_scaling;
      (*sin)[p * half + i] = static_cast<float>(std::sin(angle)) * attention_scaling;
    }
  }
}

template <typename T>
class CudaRopeTest : public ::testing::Test {
 protected:
  // YaRN-shaped frequencies: theta^(-2i/d), the slow half divided by a scaling factor.
  std::vector<float> Frequencies(int64_t rope_dim) {
    std::vector<float> inv_freq(static_cast<size_t>(rope_dim / 2));
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(rope_dim);
      inv_freq[i] = 1.0f / std::pow(10000.0f, exponent) / (2 * i >= inv_freq.size() ? 16.0f : 1.0f);
    }
    return inv_freq;
  }

  // Random x with NaN in every row's tail (past heads * head_dim), positions up to 2^20.
  void Fill(const RopeCase& c, std::vector<T>* x, std::vector<int32_t>* positions) {
    std::normal_distribution<float> normal;
    std::uniform_int_distribution<int32_t> position(0, 1 << 20);
    x->resize(static_cast<size_t>(c.rows * c.row_stride));
    for (int64_t r = 0; r < c.rows; ++r) {
      for (int64_t i = 0; i < c.row_stride; ++i) {
        (*x)[r * c.row_stride + i] = HostFromFloat<T>(
            i < c.heads * c.head_dim ? normal(rng_) : std::numeric_limits<float>::quiet_NaN());
      }
    }
    positions->resize(static_cast<size_t>(c.rows));
    for (int32_t& p : *positions) p = position(rng_);
    if (c.rows > 0) (*positions)[0] = 0;
  }

  // The whole of `got` ([rows, row_stride]) against the reference applied to `x`.
  void ExpectMatchesCpu(const RopeCase& c, const std::vector<T>& x,
                        const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                        float attention_scaling, const std::vector<T>& got) {
    std::vector<float> cos;
    std::vector<float> sin;
    ReferenceAngles(positions, inv_freq, attention_scaling, &cos, &sin);
    std::vector<float> xf = ToFloats(x);
    cpu::ApplyInterleavedRope(xf.data(), c.rows, c.row_stride, c.heads, c.head_dim, c.rope_dim,
                              cos.data(), sin.data(), c.inverse);
    testing::ExpectNearReference(got, xf, Describe(c));
  }

  void ExpectRandomMatchesCpu(const RopeCase& c) {
    std::vector<T> x;
    std::vector<int32_t> positions;
    Fill(c, &x, &positions);
    const std::vector<float> inv_freq = Frequencies(c.rope_dim);
    const float attention_scaling = std::uniform_real_distribution<float>(1.0f, 1.3f)(rng_);
    GuardedBuffer<T> d_x(x.size());
    GuardedBuffer<int32_t> d_positions(positions.size());
    GuardedBuffer<float> d_inv_freq(inv_freq.size());
    ASSERT_TRUE(d_x.ok() && d_positions.ok() && d_inv_freq.ok());
    d_x.Upload(x);
    d_positions.Upload(positions);
    d_inv_freq.Upload(inv_freq);
    PDSERVE_CUDA_OK(apply_interleaved_rope(
        DevicePtr(d_x), c.rows, c.row_stride, c.heads, c.head_dim, c.rope_dim, d_positions.get(),
        d_inv_freq.get(), attention_scaling, c.inverse, nullptr));
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<T> got = d_x.Download();
    EXPECT_TRUE(d_x.GuardsIntact()) << Describe(c);
    ExpectMatchesCpu(c, x, positions, inv_freq, attention_scaling, got);
  }

  std::mt19937_64 rng_ = testing::FreshRng();
};

using StorageTypes = ::testing::Types<float, uint16_t>;
TYPED_TEST_SUITE(CudaRopeTest, StorageTypes);

TYPED_TEST(CudaRopeTest, V4ShapesMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  for (bool inverse : {false, true}) {
    this->ExpectRandomMatchesCpu({5, 64 * 512, 64, 512, 64, inverse});   // queries
    this->ExpectRandomMatchesCpu({9, 512, 1, 512, 64, inverse});         // the shared K=V head
    this->ExpectRandomMatchesCpu({17, 64 * 128, 64, 128, 64, inverse});  // indexer queries
  }
}

TYPED_TEST(CudaRopeTest, OddShapesAndNaNTailsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  this->ExpectRandomMatchesCpu({3, 3 * 10 + 5, 3, 10, 6, false});
  this->ExpectRandomMatchesCpu({4, 9, 1, 8, 8, true});  // rope_dim == head_dim
  this->ExpectRandomMatchesCpu({2, 7 * 1030 + 1, 7, 1030, 1024, false});
  this->ExpectRandomMatchesCpu({1, 2, 1, 2, 2, false});
}

TYPED_TEST(CudaRopeTest, ZeroLengthWritesNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  GuardedBuffer<T> x(64);
  GuardedBuffer<int32_t> positions(1);
  GuardedBuffer<float> inv_freq(4);
  ASSERT_TRUE(x.ok() && positions.ok() && inv_freq.ok());
  const std::vector<T> init(64, HostFromFloat<T>(1.5f));
  x.Upload(init);
  positions.Upload({7});
  inv_freq.Upload({1.0f, 0.5f, 0.25f, 0.125f});
  for (const RopeCase& c : std::vector<RopeCase>{
           {0, 64, 8, 8, 8, false}, {1, 64, 0, 8, 8, false}, {1, 64, 8, 8, 0, false}}) {
    PDSERVE_CUDA_OK(apply_interleaved_rope(DevicePtr(x), c.rows, c.row_stride, c.heads, c.head_dim,
                                           c.rope_dim, positions.get(), inv_freq.get(), 1.0f,
                                           c.inverse, nullptr));
  }
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(x.Download(), init);
  EXPECT_TRUE(x.GuardsIntact());
}

// Positions come from device memory when the kernel runs: a captured graph replayed after the
// positions changed rotates by the new angles.
TYPED_TEST(CudaRopeTest, GraphReplayReadsCurrentPositions) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  const RopeCase c{6, 4 * 128, 4, 128, 64, false};
  std::vector<T> x;
  std::vector<int32_t> positions;
  this->Fill(c, &x, &positions);
  const std::vector<float> inv_freq = this->Frequencies(c.rope_dim);
  GuardedBuffer<T> d_x(x.size());
  GuardedBuffer<int32_t> d_positions(positions.size());
  GuardedBuffer<float> d_inv_freq(inv_freq.size());
  ASSERT_TRUE(d_x.ok() && d_positions.ok() && d_inv_freq.ok());
  d_inv_freq.Upload(inv_freq);
  d_positions.Upload(std::vector<int32_t>(positions.size(), 3));

  cudaStream_t stream = nullptr;
  PDSERVE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  PDSERVE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launched =
      apply_interleaved_rope(DevicePtr(d_x), c.rows, c.row_stride, c.heads, c.head_dim, c.rope_dim,
                             d_positions.get(), d_inv_freq.get(), 1.0f, false, stream);
  PDSERVE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  PDSERVE_CUDA_OK(launched);
  cudaGraphExec_t exec = nullptr;
  PDSERVE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  d_x.Upload(x);
  d_positions.Upload(positions);
  PDSERVE_CUDA_OK(cudaGraphLaunch(exec, stream));
  PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<T> got = d_x.Download();
  EXPECT_TRUE(d_x.GuardsIntact());
  PDSERVE_CUDA_OK(cudaGraphExecDestroy(exec));
  PDSERVE_CUDA_OK(cudaGraphDestroy(graph));
  PDSERVE_CUDA_OK(cudaStreamDestroy(stream));
  this->ExpectMatchesCpu(c, x, positions, inv_freq, 1.0f, got);
}

TYPED_TEST(CudaRopeTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  GuardedBuffer<T> x(64);
  GuardedBuffer<int32_t> positions(1);
  GuardedBuffer<float> inv_freq(32);
  auto call = [&](int64_t row_stride, int64_t heads, int64_t head_dim, int64_t rope_dim,
                  const int32_t* pos) {
    return apply_interleaved_rope(DevicePtr(x), 1, row_stride, heads, head_dim, rope_dim, pos,
                                  inv_freq.get(), 1.0f, false, nullptr);
  };
  EXPECT_EQ(call(64, 1, 64, 7, positions.get()), cudaErrorInvalidValue);   // odd rope_dim
  EXPECT_EQ(call(64, 1, 16, 32, positions.get()), cudaErrorInvalidValue);  // rope > head
  EXPECT_EQ(call(60, 2, 32, 16, positions.get()), cudaErrorInvalidValue);  // stride too small
  EXPECT_EQ(call(64, 1, 64, 16, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(call(4096, 1, 4096, 2048, positions.get()), cudaErrorInvalidValue);  // > kMaxRopeDim
}

}  // namespace
}  // namespace pdserve::kernels::cuda
