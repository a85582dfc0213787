// kernels/cuda/topk against the CPU rule (kernels/cpu/topk.h): descending score, lower index
// first on ties, -1 after min(length, k).
#include "kernels/cuda/topk.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::GuardedBuffer;

std::vector<int32_t> ReferenceTopK(const float* row, int64_t n, int64_t k) {
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [row](int32_t a, int32_t b) { return row[a] > row[b]; });
  std::vector<int32_t> out(static_cast<size_t>(k), -1);
  std::copy_n(order.begin(), std::min(n, k), out.begin());
  return out;
}

// Runs top_k on `scores` ([rows, stride]) with `lengths` and checks every row against the
// reference, plus the guards around the output.
void ExpectMatchesReference(const std::vector<float>& scores, int64_t stride,
                            const std::vector<int32_t>& lengths, int64_t k) {
  const int64_t rows = static_cast<int64_t>(lengths.size());
  GuardedBuffer<float> d_scores(scores.size());
  GuardedBuffer<int32_t> d_lengths(lengths.size());
  GuardedBuffer<int32_t> d_out(static_cast<size_t>(rows * k));
  ASSERT_TRUE(d_scores.ok() && d_lengths.ok() && d_out.ok());
  d_scores.Upload(scores);
  d_lengths.Upload(lengths);
  PDSERVE_CUDA_OK(top_k(d_scores.get(), rows, stride, d_lengths.get(), k, d_out.get(), nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<int32_t> got = d_out.Download();
  EXPECT_TRUE(d_out.GuardsIntact());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = std::clamp<int64_t>(lengths[r], 0, stride);
    const std::vector<int32_t> want = ReferenceTopK(scores.data() + r * stride, n, k);
    const std::vector<int32_t> row(got.begin() + r * k, got.begin() + (r + 1) * k);
    EXPECT_EQ(row, want) << "row " << r << " length " << n << " k " << k;
  }
}

TEST(CudaTopKTest, MixedLengthsWithHeavyTiesMatchCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const int64_t stride = 5003;
  const std::vector<int32_t> lengths = {0, 1, 37, 511, 512, 513, 1000, 4099, 5003, 777};
  // Few distinct values, so most rows have many exact ties at the k-th score.
  std::uniform_int_distribution<int> level(-6, 6);
  std::vector<float> scores(lengths.size() * stride);
  for (float& s : scores) s = 0.25f * static_cast<float>(level(rng));
  for (int64_t k : {1, 37, 512, 2048}) ExpectMatchesReference(scores, stride, lengths, k);
}

TEST(CudaTopKTest, DistinctRandomScoresMatchCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // Rows that fit in shared memory and rows read from global memory in every pass.
  for (int64_t stride : {32768, 50000}) {
    const std::vector<int32_t> lengths = {static_cast<int32_t>(stride), 20000, 3, 600};
    std::normal_distribution<float> normal;
    std::vector<float> scores(lengths.size() * stride);
    for (float& s : scores) s = normal(rng);
    ExpectMatchesReference(scores, stride, lengths, 512);
  }
}

// Rows of 32K+ entries (in shared memory, and past it from global memory; 16-byte aligned and
// not) whose k-th score is shared by more entries than the candidate buffer holds (4096), so the
// lowest-index ties are ranked in index order; plus rows whose scores differ only in their last
// bits, or sit next to one huge outlier, which take several selection rounds.
TEST(CudaTopKTest, LongRowsWithMassiveTiesMatchCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::normal_distribution<float> normal;
  std::bernoulli_distribution rare(0.01);
  std::uniform_int_distribution<int> level(0, 4);
  std::uniform_int_distribution<int> ulps(0, 5000);
  for (int64_t stride : {32768, 40001, 50000, 50001}) {
    const int64_t rows = 6;
    std::vector<float> scores(static_cast<size_t>(rows * stride));
    for (int64_t i = 0; i < stride; ++i) {
      float* s = scores.data() + i;
      s[0] = rare(rng) ? std::fabs(normal(rng)) + 1.0f : 0.0f;  // ~1% above a sea of zeros
      s[stride] = 0.5f * static_cast<float>(level(rng));        // 5 levels of ~stride/5 ties
      s[2 * stride] = 3.0f;                                     // one value throughout
      s[3 * stride] = std::nextafter(1.0f + static_cast<float>(ulps(rng)) * 0x1p-23f, 2.0f);
      s[4 * stride] = i == 12345 ? 1e30f : normal(rng);  // one outlier coarsens the first round
      s[5 * stride] = rare(rng) ? -0.0f : -std::fabs(normal(rng));
    }
    std::vector<int32_t> lengths(rows, static_cast<int32_t>(stride));
    lengths[1] = static_cast<int32_t>(stride - 3);
    for (int64_t k : {1, 512, 2048}) ExpectMatchesReference(scores, stride, lengths, k);
  }
}

TEST(CudaTopKTest, SignedZerosAreOneTie) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const int64_t stride = 3000;
  std::bernoulli_distribution negative(0.5);
  std::bernoulli_distribution zero(0.9);
  std::uniform_real_distribution<float> positive(0.5f, 1.0f);
  std::vector<float> scores(2 * stride);
  for (float& s : scores) s = zero(rng) ? (negative(rng) ? -0.0f : 0.0f) : positive(rng);
  ExpectMatchesReference(scores, stride, {3000, 1999}, 512);
}

TEST(CudaTopKTest, InfinitiesOrderAndTie) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t stride = 1500;
  std::uniform_int_distribution<int> pick(0, 3);
  std::normal_distribution<float> normal;
  std::vector<float> scores(3 * stride);
  for (int64_t i = 0; i < stride; ++i) {
    const int p = pick(rng);
    scores[i] = p == 0 ? inf : (p == 1 ? -inf : normal(rng));
    scores[stride + i] = -inf;                         // every score -inf: ties all the way
    scores[2 * stride + i] = i % 7 == 0 ? inf : -inf;  // more +inf than fit for small k
  }
  for (int64_t k : {5, 512}) ExpectMatchesReference(scores, stride, {1500, 1500, 1500}, k);
}

TEST(CudaTopKTest, ZeroLengthRowsAreAllInvalid) {
  PDSERVE_SKIP_WITHOUT_GPU();
  const std::vector<float> scores(4 * 100, 1.0f);
  ExpectMatchesReference(scores, 100, {0, 0, -5, 0}, 64);
}

TEST(CudaTopKTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> scores(16);
  GuardedBuffer<int32_t> lengths(1);
  GuardedBuffer<int32_t> out(kMaxTopK + 1);
  EXPECT_EQ(top_k(scores.get(), 1, 16, lengths.get(), 0, out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k(scores.get(), 1, 16, lengths.get(), kMaxTopK + 1, out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k(nullptr, 1, 16, lengths.get(), 4, out.get(), nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
