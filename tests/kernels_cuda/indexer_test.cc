// kernels/cuda/indexer against a float64 host evaluation of the same math (engine/indexer.cc):
// score = scale * sum_h w_h * ReLU(q_h . k), visible = min(n_keys, (position + 1) / rate).
#include "kernels/cuda/indexer.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/topk.cuh"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::FromBf16;
using testing::GuardedBuffer;
using testing::ToBf16;

constexpr int64_t kH = kIndexHeads;
constexpr int64_t kD = kIndexHeadDim;

// Paged indexer keys of a batch: requests own shuffled pool pages; every slot that holds no key
// (page tails, spare pages) is NaN.
struct IndexerCase {
  int64_t page_size = 64;
  int64_t rate = 4;
  int64_t max_keys = 0;
  std::vector<int32_t> n_keys;
  std::vector<int32_t> positions;
  std::vector<uint16_t> q;
  std::vector<float> w;
  std::vector<uint16_t> pool;
  std::vector<int32_t> page_table;
  int64_t table_stride = 0;
};

// `dead_fraction` of the keys are all-negative against all-positive queries, so every head's
// dot product is negative and the score is exactly zero (the ReLU ties the CPU rule must order).
IndexerCase MakeCase(std::mt19937_64& rng, const std::vector<int32_t>& n_keys,
                     const std::vector<int32_t>& positions, int64_t page_size,
                     double dead_fraction) {
  IndexerCase c;
  c.page_size = page_size;
  c.n_keys = n_keys;
  c.positions = positions;
  const int64_t batch = static_cast<int64_t>(n_keys.size());
  c.max_keys = *std::max_element(n_keys.begin(), n_keys.end()) + 5;
  c.table_stride = (c.max_keys + page_size - 1) / page_size;
  const int64_t pages = batch * c.table_stride + 3;
  c.pool.assign(static_cast<size_t>(pages * page_size * kD), testing::kBf16NaN);
  std::vector<int32_t> order(static_cast<size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  c.page_table.assign(static_cast<size_t>(batch * c.table_stride), 0);
  std::copy_n(order.begin(), c.page_table.size(), c.page_table.begin());

  std::normal_distribution<float> normal;
  std::bernoulli_distribution dead(dead_fraction);
  const bool ties = dead_fraction > 0.0;
  c.q.resize(static_cast<size_t>(batch * kH * kD));
  for (uint16_t& v : c.q) v = ToBf16(ties ? std::fabs(normal(rng)) : normal(rng));
  c.w.resize(static_cast<size_t>(batch * kH));
  for (float& v : c.w) v = normal(rng) / 8.0f;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < n_keys[b]; ++s) {
      const int64_t page = c.page_table[b * c.table_stride + s / page_size];
      uint16_t* key = c.pool.data() + (page * page_size + s % page_size) * kD;
      const bool is_dead = dead(rng);
      for (int64_t d = 0; d < kD; ++d) {
        key[d] = ToBf16(is_dead ? -std::fabs(normal(rng)) : normal(rng));
      }
    }
  }
  return c;
}

struct Reference {
  std::vector<int32_t> visible;
  std::vector<double> scores;  // [batch, max_keys], NaN past visible
  // [batch, max_keys]: scale x the sum over heads of |w| relu(q . k), the size of the terms a
  // score adds (the heads' weights have both signs, so a score can be far smaller than its terms;
  // float accumulation errs relative to the terms, not the sum).
  std::vector<double> magnitude;
};

Reference Evaluate(const IndexerCase& c, float scale) {
  Reference r;
  const int64_t batch = static_cast<int64_t>(c.n_keys.size());
  r.scores.assign(static_cast<size_t>(batch * c.max_keys), std::nan(""));
  r.magnitude.assign(static_cast<size_t>(batch * c.max_keys), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t visible = std::clamp<int64_t>(
        std::min<int64_t>(c.n_keys[b], (int64_t{c.positions[b]} + 1) / c.rate), 0, c.max_keys);
    r.visible.push_back(static_cast<int32_t>(visible));
    for (int64_t s = 0; s < visible; ++s) {
      const int64_t page = c.page_table[b * c.table_stride + s / c.page_size];
      const uint16_t* key = c.pool.data() + (page * c.page_size + s % c.page_size) * kD;
      double score = 0.0;
      double magnitude = 0.0;
      for (int64_t h = 0; h < kH; ++h) {
        double dot = 0.0;
        for (int64_t d = 0; d < kD; ++d) {
          dot += double{FromBf16(c.q[(b * kH + h) * kD + d])} * double{FromBf16(key[d])};
        }
        score += double{c.w[b * kH + h]} * std::max(dot, 0.0);
        magnitude += std::abs(double{c.w[b * kH + h]}) * std::max(dot, 0.0);
      }
      r.scores[b * c.max_keys + s] = score * scale;
      r.magnitude[b * c.max_keys + s] = magnitude * std::abs(double{scale});
    }
  }
  return r;
}

// A case uploaded to the device, with its launch parameters and outputs.
struct DeviceCase {
  DeviceCase(const IndexerCase& c, int64_t topk)
      : q(c.q.size()),
        pool(c.pool.size()),
        w(c.w.size()),
        scores(c.n_keys.size() * static_cast<size_t>(c.max_keys)),
        table(c.page_table.size()),
        n_keys(c.n_keys.size()),
        positions(c.positions.size()),
        visible(c.n_keys.size()),
        picks(c.n_keys.size() * static_cast<size_t>(topk)) {
    q.Upload(c.q);
    pool.Upload(c.pool);
    w.Upload(c.w);
    table.Upload(c.page_table);
    n_keys.Upload(c.n_keys);
    positions.Upload(c.positions);
    params.q = reinterpret_cast<const __nv_bfloat16*>(q.get());
    params.weights = w.get();
    params.key_pool = reinterpret_cast<const __nv_bfloat16*>(pool.get());
    params.page_table = table.get();
    params.page_table_stride = c.table_stride;
    params.page_size = c.page_size;
    params.n_keys = n_keys.get();
    params.positions = positions.get();
    params.rate = c.rate;
    params.batch = static_cast<int64_t>(c.n_keys.size());
    params.max_keys = c.max_keys;
    params.softmax_scale = 1.0f / std::sqrt(static_cast<float>(kD));
  }
  cudaError_t Launch(int64_t topk, cudaStream_t stream) {
    return lightning_indexer(params, topk, scores.get(), visible.get(), picks.get(), stream);
  }

  GuardedBuffer<uint16_t> q, pool;
  GuardedBuffer<float> w, scores;
  GuardedBuffer<int32_t> table, n_keys, positions, visible, picks;
  IndexerParams params;
};

// Every scores kernel and every top-k kernel runs every case (the register-query wgmma scores
// with the select top-k, the wgmma scores with the radix-cluster and the select-prefetch top-k,
// the mma.sync scores with the radix-cluster top-k, the wgmma scores with the select-quantile
// top-k).
struct Variant {
  IndexerScoresVariant scores;
  TopKVariant topk;
};
constexpr Variant kVariants[] = {
    {IndexerScoresVariant::kMmaSync, TopKVariant::kRadixCluster},
    {IndexerScoresVariant::kWgmma, TopKVariant::kRadixCluster},
    {IndexerScoresVariant::kWgmmaQueryRegisters, TopKVariant::kSelectSort},
    {IndexerScoresVariant::kWgmma, TopKVariant::kSelectPrefetch},
    {IndexerScoresVariant::kWgmma, TopKVariant::kSelectQuantile}};

std::string VariantName(const Variant& v) {
  const char* scores =
      v.scores == IndexerScoresVariant::kMmaSync
          ? "mma.sync"
          : (v.scores == IndexerScoresVariant::kWgmma ? "wgmma" : "wgmma, register queries");
  const char* topk =
      v.topk == TopKVariant::kSelectSort
          ? " + select-sort top-k"
          : (v.topk == TopKVariant::kSelectPrefetch
                 ? " + select-prefetch top-k"
                 : (v.topk == TopKVariant::kSelectQuantile ? " + select-quantile top-k"
                                                           : " + radix-cluster top-k"));
  return std::string(scores) + topk;
}

void RunAndCheckVariant(const IndexerCase& c, int64_t topk, const Variant& variant) {
  SCOPED_TRACE(VariantName(variant));
  const int64_t batch = static_cast<int64_t>(c.n_keys.size());
  DeviceCase d(c, topk);
  d.params.scores_variant = variant.scores;
  d.params.topk_variant = variant.topk;
  const float scale = d.params.softmax_scale;
  PDSERVE_CUDA_OK(d.Launch(topk, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got_scores = d.scores.Download();
  const std::vector<int32_t> got_visible = d.visible.Download();
  const std::vector<int32_t> got_picks = d.picks.Download();
  EXPECT_TRUE(d.scores.GuardsIntact() && d.visible.GuardsIntact() && d.picks.GuardsIntact());

  // The reference allocates only now, after the kernel ran.
  const Reference want = Evaluate(c, scale);
  EXPECT_EQ(got_visible, want.visible);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = want.visible[b];
    std::vector<double> got_row(got_scores.begin() + b * c.max_keys,
                                got_scores.begin() + b * c.max_keys + n);
    std::vector<double> want_row(want.scores.begin() + b * c.max_keys,
                                 want.scores.begin() + b * c.max_keys + n);
    const testing::ErrorReport err = testing::NormalizedError(got_row, want_row);
    EXPECT_EQ(err.mismatched, 0) << "request " << b;
    // The error's norm against the terms' (Reference::magnitude): a request of a few keys whose
    // heads nearly cancel measured 2.0e-4 against its own small norm (2026-12-06, H100) with every
    // scores kernel alike.
    double diff = 0.0;
    double terms = 0.0;
    for (int64_t s = 0; s < n; ++s) {
      diff += (got_row[s] - want_row[s]) * (got_row[s] - want_row[s]);
      terms += want.magnitude[b * c.max_keys + s] * want.magnitude[b * c.max_keys + s];
    }
    EXPECT_LE(std::sqrt(diff), 1e-4 * std::sqrt(terms)) << "request " << b;
    for (int64_t s = 0; s < n; ++s) {
      if (want_row[s] == 0.0) {
        EXPECT_EQ(got_row[s], 0.0) << "request " << b << " entry " << s;
      }
    }
    // Past visible the scores buffer keeps its fill pattern (0xA5A5A5A5 as float).
    for (int64_t s = n; s < c.max_keys; ++s) {
      uint32_t bits;
      std::memcpy(&bits, &got_scores[b * c.max_keys + s], sizeof(bits));
      ASSERT_EQ(bits, 0xA5A5A5A5u) << "request " << b << " entry " << s << " written";
    }
    // Picks: the CPU tie rule over the kernel's own scores, element for element...
    std::vector<int32_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    const float* row = got_scores.data() + b * c.max_keys;
    std::stable_sort(order.begin(), order.end(),
                     [row](int32_t x, int32_t y) { return row[x] > row[y]; });
    std::vector<int32_t> expected(static_cast<size_t>(topk), -1);
    std::copy_n(order.begin(), std::min(n, topk), expected.begin());
    const std::vector<int32_t> got_row_picks(got_picks.begin() + b * topk,
                                             got_picks.begin() + (b + 1) * topk);
    EXPECT_EQ(got_row_picks, expected) << "request " << b;
    // ...and as good as the exact top-k by the float64 scores.
    std::vector<double> exact(want_row);
    std::sort(exact.begin(), exact.end(), std::greater<>());
    double got_sum = 0.0;
    double want_sum = 0.0;
    double magnitude = 0.0;
    for (int64_t j = 0; j < std::min(n, topk); ++j) {
      got_sum += want_row[got_row_picks[j]];
      want_sum += exact[j];
      magnitude += std::fabs(exact[j]);
    }
    EXPECT_NEAR(got_sum, want_sum, 1e-4 * magnitude + 1e-12) << "request " << b;
  }
}

void RunAndCheck(const IndexerCase& c, int64_t topk) {
  for (const Variant& variant : kVariants) RunAndCheckVariant(c, topk, variant);
}

TEST(CudaIndexerTest, MixedLengthsMatchReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // Zero keys, one, a page tail, exact pages, fewer keys than top-k, more than top-k, and
  // positions that hide keys already written (causal limit below n_keys).
  const std::vector<int32_t> n_keys = {0, 1, 63, 64, 65, 300, 1500, 777, 129};
  std::vector<int32_t> positions;
  for (int32_t n : n_keys) positions.push_back(4 * n + static_cast<int32_t>(rng() % 4) - 1);
  positions[7] = 4 * 500 - 1;  // sees 500 of 777
  positions[8] = 2;            // sees none of 129
  RunAndCheck(MakeCase(rng, n_keys, positions, 64, 0.0), 512);
}

TEST(CudaIndexerTest, HeavyReluTiesFollowCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const std::vector<int32_t> n_keys = {2000, 700, 513, 90};
  std::vector<int32_t> positions;
  for (int32_t n : n_keys) positions.push_back(4 * n);
  RunAndCheck(MakeCase(rng, n_keys, positions, 64, 0.8), 512);
}

TEST(CudaIndexerTest, SmallPagesAndOddTopK) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const std::vector<int32_t> n_keys = {37, 1, 250, 0, 99};
  std::vector<int32_t> positions;
  for (int32_t n : n_keys) positions.push_back(4 * n + 3);
  RunAndCheck(MakeCase(rng, n_keys, positions, 16, 0.3), 37);
}

// More tiles than the grid has blocks, so each block's share of the tiles runs across several
// requests (empty ones among them), reloading queries at each: whole pages (64, 128 slots: one or
// two tiles per page) and pages a tile straddles (48).
TEST(CudaIndexerTest, BlocksSpanningRequestsMatchReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::uniform_int_distribution<int32_t> length(0, 700);
  std::bernoulli_distribution empty(0.3);
  for (int64_t page_size : {64, 128, 48}) {
    std::vector<int32_t> n_keys;
    std::vector<int32_t> positions;
    for (int r = 0; r < 300; ++r) {
      const int32_t n = empty(rng) ? 0 : length(rng);
      n_keys.push_back(n);
      positions.push_back(r % 7 == 0 ? 2 * n : 4 * n + 3);  // every 7th sees half its keys
    }
    n_keys[17] = 4100;  // one long request: a block's whole share
    positions[17] = 4 * 4100;
    RunAndCheck(MakeCase(rng, n_keys, positions, page_size, 0.2), 512);
  }
}

// Decode batch sizes (1, 33, 128 requests) with lengths that are no multiple of the 64-key tile,
// some below top-k, and rows long enough (up to 9000 keys at batch 1) for the top-k kernels'
// multi-block paths.
TEST(CudaIndexerTest, DecodeBatchSizesMatchReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (int64_t batch : {1, 33, 128}) {
    const int32_t longest = batch == 128 ? 1500 : (batch == 33 ? 6000 : 9000);
    std::uniform_int_distribution<int32_t> length(1, longest);
    std::vector<int32_t> n_keys;
    std::vector<int32_t> positions;
    for (int64_t r = 0; r < batch; ++r) {
      n_keys.push_back(r == 0 ? longest - 7
                              : (r % 5 == 4 ? 300 + static_cast<int32_t>(r) : length(rng)));
      positions.push_back(4 * n_keys.back() + static_cast<int32_t>(r % 4));
    }
    RunAndCheck(MakeCase(rng, n_keys, positions, 64, 0.0), 512);
  }
}

// More requests than one launch takes (1024): the batch runs as several launches.
TEST(CudaIndexerTest, MoreRequestsThanOneLaunch) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  std::uniform_int_distribution<int32_t> length(0, 90);
  std::vector<int32_t> n_keys;
  std::vector<int32_t> positions;
  for (int r = 0; r < 1100; ++r) {
    n_keys.push_back(length(rng));
    positions.push_back(4 * n_keys.back());
  }
  RunAndCheck(MakeCase(rng, n_keys, positions, 64, 0.0), 40);
}

// A captured launch re-reads the lengths from device memory at every replay.
TEST(CudaIndexerTest, GraphReplayFollowsLengthsInDeviceMemory) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const int64_t topk = 64;
  const IndexerCase c = MakeCase(rng, {900, 300, 0}, {4 * 900, 4 * 300, 0}, 64, 0.0);
  for (const Variant& variant : kVariants) {
    SCOPED_TRACE(VariantName(variant));
    DeviceCase d(c, topk);
    d.params.scores_variant = variant.scores;
    d.params.topk_variant = variant.topk;
    cudaStream_t stream = nullptr;
    PDSERVE_CUDA_OK(cudaStreamCreate(&stream));
    PDSERVE_CUDA_OK(d.Launch(topk, stream));  // first launch outside capture sets attributes
    PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<int32_t> before = d.picks.Download();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    PDSERVE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    PDSERVE_CUDA_OK(d.Launch(topk, stream));
    PDSERVE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    PDSERVE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    d.n_keys.Upload({40, 250, 0});
    PDSERVE_CUDA_OK(cudaGraphLaunch(exec, stream));
    PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<int32_t> replayed = d.picks.Download();
    PDSERVE_CUDA_OK(d.Launch(topk, stream));
    PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(replayed, d.picks.Download());
    EXPECT_NE(replayed, before);
    EXPECT_EQ(d.visible.Download(), (std::vector<int32_t>{40, 250, 0}));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

}  // namespace
}  // namespace pdserve::kernels::cuda
