// kernels/cuda/topk against the CPU rule (kernels/cpu/topk.h): descending score, lower index
// first on ties, -1 after min(length, k). Every case runs with every kernel (TopKVariant), each
// with the block count top_k picks and with 1, 2, 4 and 8 blocks per row (top_k_variant; the
// select kernels also with 3), so each path runs whole and split.
#include "kernels/cuda/topk.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/topk_radix.h"
#include "kernels/cuda/block_trace.h"
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

constexpr TopKVariant kAllVariants[] = {TopKVariant::kRadixCluster, TopKVariant::kSelectSort,
                                        TopKVariant::kSelectPrefetch, TopKVariant::kSelectQuantile,
                                        TopKVariant::kSelectQuantilePush};

const char* VariantName(TopKVariant variant) {
  switch (variant) {
    case TopKVariant::kRadixCluster:
      return "radix-cluster";
    case TopKVariant::kSelectSort:
      return "select-sort";
    case TopKVariant::kSelectPrefetch:
      return "select-prefetch";
    case TopKVariant::kSelectQuantile:
      return "select-quantile";
    case TopKVariant::kSelectQuantilePush:
      return "select-quantile-push";
  }
  return "?";
}

// Runs top_k_variant on `scores` ([rows, stride]) with `lengths`, for each of `variants` and each
// block count (0: the one top_k picks), and checks every row against the reference, plus the
// guards around the output.
void ExpectMatchesReference(const std::vector<float>& scores, int64_t stride,
                            const std::vector<int32_t>& lengths, int64_t k,
                            const std::vector<TopKVariant>& variants = {std::begin(kAllVariants),
                                                                        std::end(kAllVariants)}) {
  const int64_t rows = static_cast<int64_t>(lengths.size());
  GuardedBuffer<float> d_scores(scores.size());
  GuardedBuffer<int32_t> d_lengths(lengths.size());
  ASSERT_TRUE(d_scores.ok() && d_lengths.ok());
  d_scores.Upload(scores);
  d_lengths.Upload(lengths);
  std::vector<std::vector<int32_t>> want(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    want[r] =
        ReferenceTopK(scores.data() + r * stride, std::clamp<int64_t>(lengths[r], 0, stride), k);
  }
  for (const TopKVariant variant : variants) {
    const char* name = VariantName(variant);
    for (int64_t blocks : {0, 1, 2, 3, 4, 8}) {
      if (blocks == 3 && variant == TopKVariant::kRadixCluster) continue;  // powers of two only
      GuardedBuffer<int32_t> d_out(static_cast<size_t>(rows * k));
      ASSERT_TRUE(d_out.ok());
      PDSERVE_CUDA_OK(top_k_variant(d_scores.get(), rows, stride, d_lengths.get(), k, variant,
                                    blocks, d_out.get(), nullptr));
      PDSERVE_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<int32_t> got = d_out.Download();
      EXPECT_TRUE(d_out.GuardsIntact()) << name << " blocks per row " << blocks;
      for (int64_t r = 0; r < rows; ++r) {
        const std::vector<int32_t> row(got.begin() + r * k, got.begin() + (r + 1) * k);
        EXPECT_EQ(row, want[r]) << "row " << r << " length " << lengths[r] << " k " << k << " "
                                << name << " blocks per row " << blocks;
      }
    }
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

// Split rows whose picks all sit in one block's part (ascending and descending scores), in no
// block's part but the last, or spread over every part; lengths that leave later blocks a short
// or empty part, and NaN past the length; odd strides (rows not 16-byte aligned); parts too long
// for shared memory (90000 and 100003 at 1 and 2 blocks per row), read from global memory in
// every pass.
TEST(CudaTopKTest, SplitRowsWithUnevenPicksMatchCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::normal_distribution<float> normal;
  for (int64_t stride : {9000, 9001, 33333, 90000, 100003}) {
    const int64_t rows = 5;
    std::vector<float> scores(static_cast<size_t>(rows * stride));
    for (int64_t i = 0; i < stride; ++i) {
      float* s = scores.data() + i;
      s[0] = static_cast<float>(i);        // the picks are the last entries
      s[stride] = -static_cast<float>(i);  // the picks are the first entries
      s[2 * stride] = normal(rng);         // picks in every part
      s[3 * stride] = i >= stride - 700 ? 5.0f + normal(rng) : normal(rng);  // last part only
      s[4 * stride] = normal(rng);
    }
    const std::vector<int32_t> lengths = {static_cast<int32_t>(stride),
                                          static_cast<int32_t>(stride - 1), 4097,
                                          static_cast<int32_t>(stride), 1025};
    for (int64_t r = 0; r < rows; ++r) {  // NaN past each length, as in stale page tails
      std::fill(scores.begin() + r * stride + lengths[r], scores.begin() + (r + 1) * stride,
                std::numeric_limits<float>::quiet_NaN());
    }
    for (int64_t k : {1, 512, 2048}) ExpectMatchesReference(scores, stride, lengths, k);
  }
}

TEST(CudaTopKTest, RowsShorterThanKIgnoreNanTails) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::uniform_int_distribution<int> level(-3, 3);
  const int64_t stride = 2048;
  const std::vector<int32_t> lengths = {1, 2, 3, 5, 7, 31, 33, 511, 1023, 1025, 2047, 2048};
  // Past each row's length: NaN, which no part may read.
  std::vector<float> scores(lengths.size() * stride, std::numeric_limits<float>::quiet_NaN());
  for (size_t r = 0; r < lengths.size(); ++r) {
    for (int32_t i = 0; i < lengths[r]; ++i)
      scores[r * stride + i] = static_cast<float>(level(rng));
  }
  for (int64_t k : {2048, 1500}) ExpectMatchesReference(scores, stride, lengths, k);
}

// One value in every entry: the picks are the lowest indices, whichever blocks hold them.
TEST(CudaTopKTest, AllEqualRowsPickLowestIndices) {
  PDSERVE_SKIP_WITHOUT_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  for (float value : {0.0f, -inf, inf, 1.5f}) {
    const int64_t stride = 40000;
    const std::vector<float> scores(3 * stride, value);
    for (int64_t k : {1, 512, 2048}) {
      ExpectMatchesReference(scores, stride, {40000, 4097, 39999}, k);
    }
  }
}

// The k-th best score has more ties than the candidate buffer holds and the lowest-index ties
// span several blocks' parts, with entries above it in every part; -inf fills the rest of a row
// or all of it.
TEST(CudaTopKTest, TiesSpanningBlocksRankByIndex) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const float inf = std::numeric_limits<float>::infinity();
  std::bernoulli_distribution rare(0.002);
  for (int64_t stride : {40000, 50001}) {
    const int64_t rows = 4;
    std::vector<float> scores(static_cast<size_t>(rows * stride));
    for (int64_t i = 0; i < stride; ++i) {
      float* s = scores.data() + i;
      s[0] = rare(rng) ? 2.0f : (i % 5 == 0 ? 1.0f : 0.0f);  // 1/5 ties at 1.0 under a few 2.0
      s[stride] = rare(rng) ? inf : (i % 3 == 0 ? -1.0f : -inf);
      s[2 * stride] = -inf;
      s[3 * stride] = i % 2 == 0 ? -0.0f : 0.0f;
    }
    for (int64_t k : {1, 511, 2048}) {
      ExpectMatchesReference(scores, stride, std::vector<int32_t>(rows, stride), k);
    }
  }
}

// A captured graph of top-k launches of every kernel on one stream (each after the first launched
// with programmatic serialization) follows scores and lengths changed between replays.
TEST(CudaTopKTest, GraphReplayFollowsScoresAndLengths) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::normal_distribution<float> normal;
  const int64_t rows = 32;
  const int64_t stride = 32768;
  const int64_t k = 512;
  std::vector<float> scores(static_cast<size_t>(rows * stride));
  for (float& s : scores) s = normal(rng);
  std::vector<int32_t> lengths(rows, static_cast<int32_t>(stride));
  GuardedBuffer<float> d_scores(scores.size());
  GuardedBuffer<int32_t> d_lengths(lengths.size());
  GuardedBuffer<int32_t> d_first(static_cast<size_t>(rows * k));
  GuardedBuffer<int32_t> d_second(static_cast<size_t>(rows * k));
  GuardedBuffer<int32_t> d_third(static_cast<size_t>(rows * k));
  GuardedBuffer<int32_t> d_fourth(static_cast<size_t>(rows * k));
  GuardedBuffer<int32_t> d_fifth(static_cast<size_t>(rows * k));
  GuardedBuffer<int32_t> d_sixth(static_cast<size_t>(rows * k));
  ASSERT_TRUE(d_scores.ok() && d_lengths.ok() && d_first.ok() && d_second.ok() && d_third.ok() &&
              d_fourth.ok() && d_fifth.ok() && d_sixth.ok());
  d_scores.Upload(scores);
  d_lengths.Upload(lengths);
  cudaStream_t stream = nullptr;
  PDSERVE_CUDA_OK(cudaStreamCreate(&stream));
  auto launch = [&] {
    PDSERVE_CUDA_OK(top_k(d_scores.get(), rows, stride, d_lengths.get(), k, d_first.get(), stream));
    PDSERVE_CUDA_OK(
        top_k_split(d_scores.get(), rows, stride, d_lengths.get(), k, 2, d_second.get(), stream));
    PDSERVE_CUDA_OK(top_k_variant(d_scores.get(), rows, stride, d_lengths.get(), k,
                                  TopKVariant::kSelectSort, 0, d_third.get(), stream));
    PDSERVE_CUDA_OK(top_k_variant(d_scores.get(), rows, stride, d_lengths.get(), k,
                                  TopKVariant::kSelectPrefetch, 0, d_fourth.get(), stream));
    PDSERVE_CUDA_OK(top_k_variant(d_scores.get(), rows, stride, d_lengths.get(), k,
                                  TopKVariant::kSelectQuantile, 0, d_fifth.get(), stream));
    PDSERVE_CUDA_OK(top_k_variant(d_scores.get(), rows, stride, d_lengths.get(), k,
                                  TopKVariant::kSelectQuantilePush, 0, d_sixth.get(), stream));
  };
  launch();  // the first launch outside capture sets the kernel attribute
  PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  PDSERVE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch();
  PDSERVE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  PDSERVE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    for (float& s : scores) s = normal(rng);
    for (int32_t& n : lengths)
      n = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(stride))(rng);
    d_scores.Upload(scores);
    d_lengths.Upload(lengths);
    PDSERVE_CUDA_OK(cudaGraphLaunch(exec, stream));
    PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<int32_t> first = d_first.Download();
    const std::vector<int32_t> second = d_second.Download();
    const std::vector<int32_t> third = d_third.Download();
    const std::vector<int32_t> fourth = d_fourth.Download();
    const std::vector<int32_t> fifth = d_fifth.Download();
    const std::vector<int32_t> sixth = d_sixth.Download();
    EXPECT_TRUE(d_first.GuardsIntact() && d_second.GuardsIntact() && d_third.GuardsIntact() &&
                d_fourth.GuardsIntact() && d_fifth.GuardsIntact() && d_sixth.GuardsIntact());
    for (int64_t r = 0; r < rows; ++r) {
      const std::vector<int32_t> want = ReferenceTopK(scores.data() + r * stride, lengths[r], k);
      EXPECT_EQ(std::vector<int32_t>(first.begin() + r * k, first.begin() + (r + 1) * k), want)
          << "replay " << replay << " row " << r;
      EXPECT_EQ(std::vector<int32_t>(second.begin() + r * k, second.begin() + (r + 1) * k), want)
          << "replay " << replay << " row " << r;
      EXPECT_EQ(std::vector<int32_t>(third.begin() + r * k, third.begin() + (r + 1) * k), want)
          << "replay " << replay << " row " << r << " select-sort";
      EXPECT_EQ(std::vector<int32_t>(fourth.begin() + r * k, fourth.begin() + (r + 1) * k), want)
          << "replay " << replay << " row " << r << " select-prefetch";
      EXPECT_EQ(std::vector<int32_t>(fifth.begin() + r * k, fifth.begin() + (r + 1) * k), want)
          << "replay " << replay << " row " << r << " select-quantile";
      EXPECT_EQ(std::vector<int32_t>(sixth.begin() + r * k, sixth.begin() + (r + 1) * k), want)
          << "replay " << replay << " row " << r << " select-quantile-push";
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Decode batch sizes (1, 33, 128 rows) at the bench's row lengths (1K, 8K, 32K entries: 4K, 32K
// and 128K tokens at compression 4) with lengths that are no multiple of 64 or 4, some below k:
// the automatic block counts of both kernels, and the select kernel's first-block narrowing from
// the whole key range (rows of at most 4096) and from the selected bin (longer rows).
TEST(CudaTopKTest, DecodeBatchesMatchCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::normal_distribution<float> normal;
  for (int64_t rows : {1, 33, 128}) {
    for (int64_t stride : {1024, 8192, 32768}) {
      std::uniform_int_distribution<int32_t> length(0, static_cast<int32_t>(stride));
      std::vector<float> scores(static_cast<size_t>(rows * stride));
      for (float& s : scores) s = normal(rng);
      std::vector<int32_t> lengths(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        lengths[r] = r % 3 == 0 ? static_cast<int32_t>(stride) - 13 : length(rng);
      }
      lengths[0] = static_cast<int32_t>(stride) - 1;
      ExpectMatchesReference(scores, stride, lengths, 512);
    }
  }
}

// Rows around the select kernel's whole-row limit (4096 entries: loaded by one block) whose
// scores leave more than 4096 candidates after each narrowing round or none to narrow: one value
// throughout, a few levels, and values that differ only in their last bits.
TEST(CudaTopKTest, RowsAtTheWholeRowLimitNarrowToK) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::uniform_int_distribution<int> level(0, 3);
  std::uniform_int_distribution<int> ulps(0, 300);
  for (int64_t stride : {4095, 4096, 4097, 8193}) {
    const int64_t rows = 4;
    std::vector<float> scores(static_cast<size_t>(rows * stride));
    for (int64_t i = 0; i < stride; ++i) {
      float* s = scores.data() + i;
      s[0] = -2.5f;
      s[stride] = static_cast<float>(level(rng));
      s[2 * stride] = std::nextafter(1.0f + static_cast<float>(ulps(rng)) * 0x1p-23f, 2.0f);
      s[3 * stride] = i % 1000 == 0 ? 7.0f : 1.0f + static_cast<float>(i % 2);
    }
    const std::vector<int32_t> lengths = {static_cast<int32_t>(stride),
                                          static_cast<int32_t>(stride) - 1,
                                          static_cast<int32_t>(stride), 4000};
    for (int64_t k : {1, 100, 512, 2048}) ExpectMatchesReference(scores, stride, lengths, k);
  }
}

// kSelectPrefetch's and kSelectQuantile's own paths on rows longer than 4096, each reached as
// their CPU twin (kernels/cpu/topk_radix.h with sample_bin_bits 8, and sample_quantile) says: picks
// placed by bins from the blocks' lists; picks tied at the top so that the bins stay crowded (the
// candidates go to the first block, are narrowed and sorted); a sample that misses (ties at the
// threshold past the buffer: the radix selection); every candidate in the last block's part
// (ascending scores); parts longer than the registers' first load (one block, 40000 entries) and
// not 16-byte aligned (odd strides); NaN past the length; -inf and +inf among the picks.
// The paths the CPU twin takes on a row at the prefetch kernels' settings (kSelectPrefetch: the
// sample's rounds of 8-bit bins; quantile: kSelectQuantile's group ranks).
cpu::RadixSplitStats PrefetchTwin(const float* row, int32_t n, int32_t k, bool quantile) {
  cpu::RadixSplitConfig config;
  config.select_sort = true;
  config.sample_bin_bits = 8;
  config.sample_quantile = quantile;
  std::vector<int32_t> twin(static_cast<size_t>(k));
  return cpu::TopKRadixSplit(row, n, k, config, twin.data());
}

TEST(CudaTopKTest, SelectPrefetchPathsMatchCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> level(0, 3);
  const float inf = std::numeric_limits<float>::infinity();
  // 40000 and 40001: parts longer than the first load (one block); 32768 and 20003 (at most
  // cpu::kQuantileMaxEntries): the quantile kernel's own threshold.
  for (int64_t stride : {40000, 40001, 32771, 32768, 20003}) {
    const int64_t rows = 6;
    std::vector<float> scores(static_cast<size_t>(rows * stride));
    for (int64_t i = 0; i < stride; ++i) {
      float* s = scores.data() + i;
      s[0] = normal(rng);                              // placed by bins
      s[stride] = i % 37 == 0 ? 5.0f : normal(rng);    // ~1000 ties at the top
      s[2 * stride] = static_cast<float>(level(rng));  // misses: ties past the buffer
      s[3 * stride] = static_cast<float>(i);           // picks in the last part
      s[4 * stride] = i % 501 == 0 ? inf : (i % 3 == 0 ? -inf : normal(rng));
      s[5 * stride] = normal(rng);
    }
    const std::vector<int32_t> lengths = {
        static_cast<int32_t>(stride),     static_cast<int32_t>(stride),
        static_cast<int32_t>(stride),     static_cast<int32_t>(stride),
        static_cast<int32_t>(stride) - 2, 20001};
    std::fill(scores.begin() + 5 * stride + lengths[5], scores.end(),
              std::numeric_limits<float>::quiet_NaN());
    // The paths the twin takes at k = 512 (the first row's are the ordinary ones), with the
    // sample's rounds (kSelectPrefetch) and its group ranks (kSelectQuantile).
    for (const bool quantile : {false, true}) {
      const auto stats = [&](int64_t r) {
        return PrefetchTwin(scores.data() + r * stride, lengths[r], 512, quantile);
      };
      EXPECT_TRUE(stats(0).sampled && stats(0).bucket_ranked) << quantile;
      EXPECT_TRUE(stats(1).sampled && !stats(1).bucket_ranked) << quantile;
      EXPECT_FALSE(stats(2).sampled) << quantile;
      EXPECT_TRUE(stats(3).sampled && stats(3).bucket_ranked) << quantile;
    }
    for (int64_t k : {1, 512, 2048}) {
      ExpectMatchesReference(scores, stride, lengths, k,
                             {TopKVariant::kSelectPrefetch, TopKVariant::kSelectQuantile,
                              TopKVariant::kSelectQuantilePush});
    }
  }
}

// The prefetch kernels gather by comparing scores as floats with cpu::BitsAtOrAbove of the
// threshold key, and start the placing's bins at the smallest and largest score taken (kept as
// floats): rows of negative normal scores with about 1500 denormals of both signs and zeros,
// whose picks at k = 512 (positive denormals), threshold and taken range are denormal. Fewer than
// kMaxCandidates entries lie at or above zero, so even a comparison that flushed them to zero
// would gather (not fall back), and a range flushed to zero would misplace the picks. The twin
// confirms that each row's first try gathers. Rows of one block's first load (12000), of several
// chunks (40000) and of the quantile kernel's threshold (20003, unaligned parts past block 0).
TEST(CudaTopKTest, SelectPrefetchGathersDenormalScores) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::uniform_int_distribution<uint32_t> magnitude(1u, 0x007FFFFFu);
  std::uniform_real_distribution<float> negative(-2.0f, -1.0f);
  std::uniform_int_distribution<int> kind(0, 999);
  for (int64_t stride : {12000, 40000, 20003}) {
    const int64_t rows = 3;
    const int small_per_mille = static_cast<int>(1500 * 1000 / stride);  // ~1500 a row
    std::vector<float> scores(static_cast<size_t>(rows * stride));
    for (float& x : scores) {
      const int what = kind(rng);
      if (what >= small_per_mille) {
        x = negative(rng);
        continue;
      }
      // Of the small ones: 50% positive denormals, 10% zeros of either sign, 40% negative
      // denormals.
      const int part = what * 10 / small_per_mille;
      uint32_t bits = magnitude(rng);
      if (part == 5) bits = (what & 1) != 0 ? 0x80000000u : 0u;
      if (part >= 6) bits |= 0x80000000u;
      std::memcpy(&x, &bits, 4);
    }
    const std::vector<int32_t> lengths = {static_cast<int32_t>(stride),
                                          static_cast<int32_t>(stride) - 3,
                                          static_cast<int32_t>(stride / 2)};
    for (const bool quantile : {false, true}) {
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_TRUE(PrefetchTwin(scores.data() + r * stride, lengths[r], 512, quantile).sampled)
            << stride << " row " << r << " quantile " << quantile;
      }
    }
    for (int64_t k : {1, 512}) {
      ExpectMatchesReference(scores, stride, lengths, k,
                             {TopKVariant::kSelectPrefetch, TopKVariant::kSelectQuantile,
                              TopKVariant::kSelectQuantilePush});
    }
  }
}

// kSelectQuantile on rows of at most 4096 entries starts its bins at an estimate of the picks'
// lowest key from the row's mean and standard deviation (kernels/cuda/topk.cu BinStart): rows of
// mixed signs whose picks would crowd bins counted from the smallest key (normal scores, as the
// indexer's weighted sums are, with a positive estimate: placed at the first count), and rows whose
// estimate lies above the picks-th best score, so that the count is made again from the smallest
// key: distinct picks (placed by bins after the narrowing), picks tied at three values, an estimate
// above the row's largest score (zeros and a few -100), and a constant row (narrowed, then sorted).
// Which counts ran is read from the traced kernel's marks (BucketRankPlace: kTraceExtra3 a count
// made again from the smallest key, kTraceExtra2 a narrowed count).
TEST(CudaTopKTest, WholeRowsWhoseBinStartMissesThePicks) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::normal_distribution<float> normal(0.5f, 0.6f);
  std::normal_distribution<float> shifted(1.0f, 0.6f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const int64_t stride = 4096;
  const int64_t rows = 6;
  std::vector<float> scores(static_cast<size_t>(rows * stride));
  for (int64_t i = 0; i < stride; ++i) {
    float* s = scores.data() + i;
    s[0] = normal(rng);
    s[stride] = shifted(rng);  // its first 1024 entries (length 1024)
    // 3000 low entries, 600 in [1, 2) and 496 in [10, 11): 496 < 512 picks above the estimate.
    const float base = i < 3000 ? 0.0f : (i < 3600 ? 1.0f : 10.0f);
    s[2 * stride] = base + (i < 3000 ? 0.01f : 1.0f) * unit(rng);
    s[3 * stride] = base;
    s[4 * stride] = i % 43 == 0 ? -100.0f : 0.0f;
    s[5 * stride] = 3.0f;
  }
  std::shuffle(scores.begin() + 2 * stride, scores.begin() + 3 * stride, rng);
  std::shuffle(scores.begin() + 3 * stride, scores.begin() + 4 * stride, rng);
  const std::vector<int32_t> lengths = {4096, 1024, 4096, 4096, 4096, 4096};
  // The estimate as the kernel makes it (in double here; the rows leave a wide margin): the
  // mean plus the logistic quantile of 1 - (1.5 k + 64) / n standard deviations.
  const auto start = [&](int64_t r, int64_t k) {
    const int64_t n = lengths[r];
    double sum = 0;
    double squares = 0;
    for (int64_t i = 0; i < n; ++i) {
      sum += scores[r * stride + i];
      squares += static_cast<double>(scores[r * stride + i]) * scores[r * stride + i];
    }
    const double mean = sum / n;
    const double share = (1.5 * k + 64) / n;
    return mean + std::sqrt(squares / n - mean * mean) * std::log((1 - share) / share) / 1.702;
  };
  const auto kth = [&](int64_t r, int64_t k) {
    std::vector<float> row(scores.begin() + r * stride, scores.begin() + r * stride + lengths[r]);
    std::nth_element(row.begin(), row.begin() + (k - 1), row.end(), std::greater<float>());
    return static_cast<double>(row[k - 1]);
  };
  EXPECT_LT(start(0, 512), kth(0, 512));
  EXPECT_LT(start(1, 512), kth(1, 512));
  EXPECT_GT(start(2, 512), kth(2, 512) + 1.0);
  EXPECT_GT(start(3, 512), kth(3, 512) + 1.0);
  EXPECT_GT(start(4, 512), 1.0);  // above the row's largest score, 0
  for (int64_t k : {1, 100, 512}) {
    ExpectMatchesReference(scores, stride, lengths, k, {TopKVariant::kSelectQuantile});
  }
  // The traced kernel at k = 512, one block a row: its marks say which counts ran.
  GuardedBuffer<float> d_scores(scores.size());
  GuardedBuffer<int32_t> d_lengths(lengths.size());
  GuardedBuffer<int32_t> d_out(static_cast<size_t>(rows * 512));
  GuardedBuffer<uint64_t> slots(static_cast<size_t>(rows * kBlockTraceSlots));
  ASSERT_TRUE(d_scores.ok() && d_lengths.ok() && d_out.ok() && slots.ok());
  d_scores.Upload(scores);
  d_lengths.Upload(lengths);
  slots.Upload(std::vector<uint64_t>(slots.size(), 0));
  set_block_trace(slots.get(), rows);
  const cudaError_t launched = top_k_variant(d_scores.get(), rows, stride, d_lengths.get(), 512,
                                             TopKVariant::kSelectQuantile, 1, d_out.get(), nullptr);
  set_block_trace(nullptr, 0);
  PDSERVE_CUDA_OK(launched);
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint64_t> marks = slots.Download();
  const std::vector<int32_t> got = d_out.Download();
  const auto marked = [&](int64_t r, int slot) { return marks[r * kBlockTraceSlots + slot] != 0; };
  const bool restarted[] = {false, false, true, true, true, false};
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(marked(r, kTraceExtra3), restarted[r]) << "row " << r;
    EXPECT_EQ(std::vector<int32_t>(got.begin() + r * 512, got.begin() + (r + 1) * 512),
              ReferenceTopK(scores.data() + r * stride, lengths[r], 512))
        << "row " << r;
  }
  // The normal rows, whose estimate is positive: placed at the first count. (Where it falls
  // below zero, as for normal(0.5, 0.6) at 1024 entries and k = 512, the bins span the tiny
  // magnitudes of both signs again and the picks may still crowd them.)
  EXPECT_FALSE(marked(0, kTraceExtra2));
  EXPECT_FALSE(marked(1, kTraceExtra2));
  EXPECT_TRUE(marked(5, kTraceExtra2));  // the constant row: narrowed (then sorted)
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
  EXPECT_EQ(top_k_split(scores.get(), 1, 16, lengths.get(), 4, 3, out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k_split(scores.get(), 1, 16, lengths.get(), 4, 16, out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k_variant(scores.get(), 1, 16, lengths.get(), 4, static_cast<TopKVariant>(7), 0,
                          out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k_variant(scores.get(), 1, 16, lengths.get(), 0, TopKVariant::kSelectSort, 0,
                          out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k_variant(scores.get(), 1, 16, lengths.get(), 4, TopKVariant::kRadixCluster, 3,
                          out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k_variant(scores.get(), 1, 16, lengths.get(), 4, TopKVariant::kSelectSort, 9,
                          out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k_variant(scores.get(), 1, 16, lengths.get(), 4, TopKVariant::kSelectPrefetch, 9,
                          out.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(top_k_select_stages(scores.get(), 1, 16, lengths.get(), 4, TopKVariant::kRadixCluster,
                                0, out.get(), nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
