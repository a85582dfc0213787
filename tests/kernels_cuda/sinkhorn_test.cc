// kernels/cuda/sinkhorn against the CPU reference (kernels/cpu/sinkhorn.h), one matrix per token.
#include "kernels/cuda/sinkhorn.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/sinkhorn.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;
using testing::Widen;

constexpr float kEps = 1e-6f;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Projects `logits` ([count, n, n]) on the GPU and on the CPU and compares them, plus the guards.
void ExpectMatchesCpu(const std::vector<float>& logits, int64_t count, int64_t n, int64_t iters,
                      SinkhornVariant variant = SinkhornVariant::kAuto) {
  const std::string what = "count " + std::to_string(count) + " n " + std::to_string(n) +
                           " iters " + std::to_string(iters);
  GuardedBuffer<float> d_m(logits.size());
  ASSERT_TRUE(d_m.ok());
  d_m.Upload(logits);
  PDSERVE_CUDA_OK(sinkhorn_project(d_m.get(), count, n, iters, kEps, nullptr, variant));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = d_m.Download();
  EXPECT_TRUE(d_m.GuardsIntact()) << what;
  std::vector<float> want(logits);
  for (int64_t t = 0; t < count; ++t) cpu::SinkhornProject(want.data() + t * n * n, n, iters, kEps);
  // Same operations in the same order; only exp may differ by an ulp or two.
  testing::ExpectNear(Widen(got), Widen(want), 1e-5, what);
}

std::vector<float> RandomLogits(std::mt19937_64& rng, int64_t count, int64_t n, float scale) {
  std::normal_distribution<float> normal;
  std::vector<float> logits(static_cast<size_t>(count * n * n));
  for (float& v : logits) v = scale * normal(rng);
  return logits;
}

TEST(CudaSinkhornTest, HyperConnectionShapeMatchesCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // hc_mult 4, 20 iterations; counts that leave the last warp and block partly empty.
  for (int64_t count : {1, 7, 64, 1000, 4099}) {
    ExpectMatchesCpu(RandomLogits(rng, count, 4, 2.0f), count, 4, 20);
  }
}

TEST(CudaSinkhornTest, OddSizesAndIterationCountsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (int64_t n : {1, 3, 5, 7, 16, 31, 32}) {
    for (int64_t iters : {0, 1, 2, 20}) {
      ExpectMatchesCpu(RandomLogits(rng, 37, n, 1.0f), 37, n, iters);
    }
  }
}

TEST(CudaSinkhornTest, LargeAndInfiniteLogitsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const int64_t n = 4;
  std::vector<float> logits = RandomLogits(rng, 6, n, 1e30f);
  for (int64_t c = 0; c < n; ++c) logits[16 + c] = -kInf;  // matrix 1, row 0: all -inf
  logits[33] = -kInf;                                      // matrix 2: one -inf entry
  logits[50] = kInf;                                       // matrix 3: +inf (NaN row, as on CPU)
  ExpectMatchesCpu(logits, 6, n, 20);                      // kAuto: kEntries at n = 4
  ExpectMatchesCpu(logits, 6, n, 20, SinkhornVariant::kRowRegisters);
  ExpectMatchesCpu(logits, 6, n, 20, SinkhornVariant::kSharedMemory);
}

TEST(CudaSinkhornTest, NaNStaysInItsMatrix) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::vector<float> logits = RandomLogits(rng, 40, 4, 1.0f);
  logits[5 * 16 + 6] = std::numeric_limits<float>::quiet_NaN();
  ExpectMatchesCpu(logits, 40, 4, 20);
  // Every other matrix is finite.
  GuardedBuffer<float> d_m(logits.size());
  ASSERT_TRUE(d_m.ok());
  d_m.Upload(logits);
  PDSERVE_CUDA_OK(sinkhorn_project(d_m.get(), 40, 4, 20, kEps, nullptr));
  const std::vector<float> got = d_m.Download();
  for (size_t i = 0; i < got.size(); ++i) {
    if (i / 16 != 5) {
      EXPECT_TRUE(std::isfinite(got[i])) << i;
    }
  }
}

TEST(CudaSinkhornTest, ZeroCountWritesNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> m(16);
  ASSERT_TRUE(m.ok());
  const std::vector<float> init(16, 0.5f);
  m.Upload(init);
  PDSERVE_CUDA_OK(sinkhorn_project(m.get(), 0, 4, 20, kEps, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(m.Download(), init);
  EXPECT_TRUE(m.GuardsIntact());
}

// The kernels (kAuto = one entry per lane at n = 2, 4, rows in registers at n = 8; kEntries;
// kRowRegisters; kSharedMemory) are the same operations in the same order per entry, so the
// same bits, for random, huge, infinite and NaN logits (a row of -inf among them: kEntries's
// first version shuffled inside a branch such a row's lanes skip), counts that leave warps and
// blocks partly empty, and 0, 1, 2 and 20 iterations; the guards around the output intact.
TEST(CudaSinkhornTest, KernelsEqualEachOtherBitForBit) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const SinkhornVariant variants[] = {SinkhornVariant::kAuto, SinkhornVariant::kEntries,
                                      SinkhornVariant::kRowRegisters,
                                      SinkhornVariant::kSharedMemory};
  for (int64_t n : {2, 4, 8}) {
    for (int64_t count : {1, 7, 33, 4099}) {
      for (int64_t iters : {0, 1, 2, 20}) {
        std::vector<float> logits = RandomLogits(rng, count, n, count == 33 ? 1e30f : 2.0f);
        if (count == 7) {
          for (int64_t c = 0; c < n; ++c) logits[n * n + c] = -kInf;  // matrix 1, row 0
          logits[2 * n * n + 1] = kInf;
          logits[3 * n * n + n + 1] = std::numeric_limits<float>::quiet_NaN();
        }
        std::vector<float> out[4];
        for (int v = 0; v < 4; ++v) {
          GuardedBuffer<float> d_m(logits.size());
          ASSERT_TRUE(d_m.ok());
          d_m.Upload(logits);
          PDSERVE_CUDA_OK(sinkhorn_project(d_m.get(), count, n, iters, kEps, nullptr, variants[v]));
          PDSERVE_CUDA_OK(cudaDeviceSynchronize());
          out[v] = d_m.Download();
          EXPECT_TRUE(d_m.GuardsIntact());
        }
        const std::string what = "n " + std::to_string(n) + " count " + std::to_string(count) +
                                 " iters " + std::to_string(iters);
        for (int v = 0; v < 3; ++v) {
          ASSERT_EQ(out[v].size(), out[3].size()) << what;
          EXPECT_EQ(std::memcmp(out[v].data(), out[3].data(), out[v].size() * sizeof(float)), 0)
              << what << " variant " << v << " against shared memory";
        }
        // Not the input: the projection ran.
        EXPECT_NE(std::memcmp(out[0].data(), logits.data(), out[0].size() * sizeof(float)), 0)
            << what;
      }
    }
  }
}

TEST(CudaSinkhornTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> m(64);
  EXPECT_EQ(sinkhorn_project(m.get(), 1, 0, 20, kEps, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(sinkhorn_project(m.get(), 1, kMaxSinkhornN + 1, 20, kEps, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(sinkhorn_project(m.get(), -1, 4, 20, kEps, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(sinkhorn_project(nullptr, 1, 4, 20, kEps, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
