// kernels/cuda/indexer_generic against a host evaluation of engine/indexer.cc's scores (dot
// products in float64 rounded to fp32, then the CPU's fp32 sum over heads in index order), and
// kernels/cuda/topk on the kernel's scores against kernels/cpu/topk on the same scores.
#include "kernels/cuda/indexer_generic.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cpu/topk.h"
#include "kernels/cuda/topk.cuh"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::DevicePtr;
using testing::FreshRng;
using testing::FromBf16;
using testing::GuardedBuffer;
using testing::ToBf16;

constexpr int64_t kRate = 4;
constexpr int32_t kAllKeys = -1;              // a row spec's visible: a position past every key
constexpr uint32_t kUnwritten = 0xA5A5A5A5u;  // GuardedBuffer's fill, as float bits

// One row of a case: its request slot and how many keys it should see (kAllKeys: all there are).
struct RowSpec {
  int32_t slot;
  int32_t visible;
};

struct ScoreCase {
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t slots = 0;
  int64_t key_capacity = 0;
  int64_t max_keys = 0;
  float score_scale = 1.0f;
  std::vector<int32_t> slot_of_row;
  std::vector<int32_t> position_of_row;
  std::vector<float> q;                                 // [rows, heads, head_dim]
  std::vector<float> weights;                           // [rows, heads]
  std::vector<uint16_t> keys;                           // [slots, key_capacity, head_dim] bf16
  std::vector<std::pair<int64_t, int64_t>> duplicates;  // (slot, s): key s + 1 == key s
  int64_t rows() const { return static_cast<int64_t>(slot_of_row.size()); }
};

int64_t ExpectedVisible(const ScoreCase& c, int64_t position) {
  return std::clamp<int64_t>(std::min({(position + 1) / kRate, c.key_capacity, c.max_keys}), 0,
                             INT32_MAX);
}

// Every key slot that no row can see is NaN: slots without rows, and each slot's keys past the
// longest visible length among its rows. `dead_fraction` of the keys are all-negative against
// all-positive queries, so each of their ReLU terms is zero and they tie at exactly 0; about a
// tenth of the keys repeat their predecessor (exact ties at other values).
ScoreCase MakeCase(std::mt19937_64& rng, int64_t heads, int64_t head_dim, int64_t slots,
                   int64_t key_capacity, int64_t max_keys, const std::vector<RowSpec>& rows,
                   double dead_fraction) {
  ScoreCase c;
  c.heads = heads;
  c.head_dim = head_dim;
  c.slots = slots;
  c.key_capacity = key_capacity;
  c.max_keys = max_keys;
  c.score_scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<int64_t> filled(static_cast<size_t>(slots), 0);
  std::uniform_int_distribution<int32_t> offset(0, kRate - 1);
  for (const RowSpec& r : rows) {
    const int32_t position =
        r.visible == kAllKeys ? 1000000 : std::max(0, r.visible * int32_t{kRate} - 1 + offset(rng));
    c.slot_of_row.push_back(r.slot);
    c.position_of_row.push_back(position);
    filled[r.slot] = std::max(filled[r.slot], ExpectedVisible(c, position));
  }
  const bool ties = dead_fraction > 0.0;
  std::normal_distribution<float> normal;
  c.q.resize(static_cast<size_t>(c.rows() * heads * head_dim));
  for (float& v : c.q) v = ties ? std::fabs(normal(rng)) : normal(rng);
  c.weights.resize(static_cast<size_t>(c.rows() * heads));
  for (float& v : c.weights) v = normal(rng) / std::sqrt(static_cast<float>(heads));
  c.keys.assign(static_cast<size_t>(slots * key_capacity * head_dim), testing::kBf16NaN);
  std::bernoulli_distribution dead(dead_fraction);
  std::bernoulli_distribution repeat(0.1);
  for (int64_t slot = 0; slot < slots; ++slot) {
    for (int64_t s = 0; s < filled[slot]; ++s) {
      uint16_t* key = c.keys.data() + (slot * key_capacity + s) * head_dim;
      if (s > 0 && repeat(rng)) {
        std::copy_n(key - head_dim, head_dim, key);
        c.duplicates.emplace_back(slot, s - 1);
        continue;
      }
      const bool is_dead = dead(rng);
      for (int64_t d = 0; d < head_dim; ++d) {
        key[d] = ToBf16(is_dead ? -std::fabs(normal(rng)) : normal(rng));
      }
    }
  }
  return c;
}

// engine/indexer.cc's scores: [rows, max_keys], NaN past each row's visible length.
std::vector<float> ScoresOnCpu(const ScoreCase& c, std::vector<int32_t>* visible) {
  std::vector<float> scores(static_cast<size_t>(c.rows() * c.max_keys), std::nanf(""));
  visible->clear();
  for (int64_t r = 0; r < c.rows(); ++r) {
    const int64_t n = ExpectedVisible(c, c.position_of_row[r]);
    visible->push_back(static_cast<int32_t>(n));
    for (int64_t s = 0; s < n; ++s) {
      const uint16_t* key = c.keys.data() + (c.slot_of_row[r] * c.key_capacity + s) * c.head_dim;
      float score = 0.0f;
      for (int64_t h = 0; h < c.heads; ++h) {
        const float* qh = c.q.data() + (r * c.heads + h) * c.head_dim;
        double dot = 0.0;
        for (int64_t d = 0; d < c.head_dim; ++d) dot += double{qh[d]} * double{FromBf16(key[d])};
        const float w = c.weights[r * c.heads + h];
        score += std::max(static_cast<float>(dot), 0.0f) * c.score_scale * w;
      }
      scores[r * c.max_keys + s] = score;
    }
  }
  return scores;
}

// A case uploaded to the device, with its outputs (left at the guard fill pattern).
struct DeviceCase {
  DeviceCase(const ScoreCase& c, int64_t topk)
      : q(c.q.size()),
        weights(c.weights.size()),
        scores(static_cast<size_t>(c.rows() * c.max_keys)),
        keys(c.keys.size()),
        slot_of_row(c.slot_of_row.size()),
        position_of_row(c.position_of_row.size()),
        visible(c.slot_of_row.size()),
        picks(static_cast<size_t>(c.rows() * topk)) {
    q.Upload(c.q);
    weights.Upload(c.weights);
    keys.Upload(c.keys);
    slot_of_row.Upload(c.slot_of_row);
    position_of_row.Upload(c.position_of_row);
  }
  bool ok() const {
    return q.ok() && weights.ok() && scores.ok() && keys.ok() && slot_of_row.ok() &&
           position_of_row.ok() && visible.ok() && picks.ok();
  }
  // Scores, then top-k over them (the engine's sequence).
  cudaError_t Launch(const ScoreCase& c, int64_t topk, cudaStream_t stream) {
    const cudaError_t status = indexer_scores_generic(
        q.get(), weights.get(), c.rows(), c.heads, c.head_dim, DevicePtr(keys), c.key_capacity,
        slot_of_row.get(), position_of_row.get(), kRate, c.score_scale, c.max_keys, scores.get(),
        visible.get(), stream);
    if (status != cudaSuccess || c.rows() == 0) return status;
    return top_k(scores.get(), c.rows(), c.max_keys, visible.get(), topk, picks.get(), stream);
  }

  GuardedBuffer<float> q, weights, scores;
  GuardedBuffer<uint16_t> keys;
  GuardedBuffer<int32_t> slot_of_row, position_of_row, visible, picks;
};

// Scores are fp32 on both sides and differ by summation order only, but the weighted sum over
// heads (weights of either sign) can cancel, leaving a row's norm far below its terms': a row of
// 3 heads measured 1.3e-5 (seed 13590304243854077648). A wrong key, head or position moves a
// row by orders of magnitude more.
constexpr double kScoreTolerance = 1e-4;

void RunAndCheck(const ScoreCase& c, int64_t topk) {
  const std::string what = "heads " + std::to_string(c.heads) + " head_dim " +
                           std::to_string(c.head_dim) + " rows " + std::to_string(c.rows());
  DeviceCase d(c, topk);
  ASSERT_TRUE(d.ok()) << what;
  PDSERVE_CUDA_OK(d.Launch(c, topk, nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> got = d.scores.Download();
  const std::vector<int32_t> got_visible = d.visible.Download();
  const std::vector<int32_t> got_picks = d.picks.Download();
  EXPECT_TRUE(d.scores.GuardsIntact() && d.visible.GuardsIntact() && d.picks.GuardsIntact())
      << what;

  // The reference allocates only after the kernels ran.
  std::vector<int32_t> want_visible;
  const std::vector<float> want = ScoresOnCpu(c, &want_visible);
  ASSERT_EQ(got_visible, want_visible) << what;
  std::vector<int32_t> cpu_picks(static_cast<size_t>(topk));
  std::vector<int32_t> scratch(static_cast<size_t>(c.max_keys));
  for (int64_t r = 0; r < c.rows(); ++r) {
    const std::string row = what + " row " + std::to_string(r);
    const int64_t n = want_visible[r];
    const float* got_row = got.data() + r * c.max_keys;
    const float* want_row = want.data() + r * c.max_keys;
    testing::ExpectNear(std::vector<double>(got_row, got_row + n),
                        std::vector<double>(want_row, want_row + n), kScoreTolerance, row);
    for (int64_t s = 0; s < n; ++s) {
      if (want_row[s] == 0.0f) {
        EXPECT_EQ(got_row[s], 0.0f) << row << " key " << s;
      }
    }
    for (const auto& [slot, s] : c.duplicates) {
      if (slot == c.slot_of_row[r] && s + 1 < n) {
        EXPECT_EQ(std::memcmp(got_row + s, got_row + s + 1, sizeof(float)), 0)
            << row << " keys " << s << ", " << s + 1 << " are equal";
      }
    }
    for (int64_t s = n; s < c.max_keys; ++s) {
      uint32_t bits;
      std::memcpy(&bits, got_row + s, sizeof(bits));
      ASSERT_EQ(bits, kUnwritten) << row << " key " << s << " written past visible";
    }
    // kernels/cuda/topk on the GPU scores picks what kernels/cpu/topk picks from them.
    cpu::TopK(got_row, n, topk, cpu_picks.data(), scratch.data());
    EXPECT_EQ(
        std::vector<int32_t>(got_picks.begin() + r * topk, got_picks.begin() + (r + 1) * topk),
        cpu_picks)
        << row;
  }
}

// Rows of every kind over three used slots of four: nothing visible (positions 0 and 2), one key,
// a partial key tile, exactly one tile, one past it, a partial later tile, and everything.
std::vector<RowSpec> MixedRows() {
  return {{0, 0}, {1, 1}, {2, 37}, {0, 64}, {1, 65}, {2, 200}, {0, kAllKeys}, {2, 0}, {1, 130}};
}

TEST(CudaIndexerGenericTest, ShapesAndMixedPositionsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{3, 24},  {4, 16},  {16, 32}, {64, 128},
                                                           {3, 128}, {64, 16}, {5, 13},  {1, 1}};
  for (const auto& [heads, head_dim] : shapes) {
    RunAndCheck(MakeCase(rng, heads, head_dim, 4, 300, 300, MixedRows(), 0.0), 64);
    RunAndCheck(MakeCase(rng, heads, head_dim, 2, 300, 300, {{1, kAllKeys}}, 0.0), 7);
  }
}

// Keys through a page table (kernels/cuda/paged_entries.cuh): 16-key pages shuffled over a pool
// with a NaN null page 0, so a key tile of 64 spans several pages. Scores and visible lengths
// are bit for bit the slot layout's (same arithmetic, other addresses).
TEST(CudaIndexerGenericTest, PagedKeysScoreAsTheSlotLayout) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (const auto& [heads, head_dim] :
       std::vector<std::pair<int64_t, int64_t>>{{3, 24}, {64, 128}}) {
    const ScoreCase c = MakeCase(rng, heads, head_dim, 4, 300, 300, MixedRows(), 0.1);
    constexpr int64_t kPage = 16;
    const int64_t stride = (c.key_capacity + kPage - 1) / kPage;
    const int64_t pages = c.slots * stride + 1;
    std::vector<int32_t> order;
    for (int64_t i = 1; i < pages; ++i) order.push_back(static_cast<int32_t>(i));
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<uint16_t> pool(static_cast<size_t>(pages * kPage * head_dim), testing::kBf16NaN);
    std::vector<int32_t> table(static_cast<size_t>(c.slots * stride));
    for (int64_t slot = 0; slot < c.slots; ++slot) {
      for (int64_t k = 0; k < c.key_capacity; ++k) {
        const int32_t page = order[static_cast<size_t>(slot * stride + k / kPage)];
        table[static_cast<size_t>(slot * stride + k / kPage)] = page;
        std::copy_n(c.keys.data() + (slot * c.key_capacity + k) * head_dim, head_dim,
                    pool.data() + (page * kPage + k % kPage) * head_dim);
      }
    }
    DeviceCase d(c, 8);
    ASSERT_TRUE(d.ok());
    PDSERVE_CUDA_OK(indexer_scores_generic(
        d.q.get(), d.weights.get(), c.rows(), c.heads, c.head_dim, DevicePtr(d.keys),
        c.key_capacity, d.slot_of_row.get(), d.position_of_row.get(), kRate, c.score_scale,
        c.max_keys, d.scores.get(), d.visible.get(), nullptr));
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> want = d.scores.Download();
    const std::vector<int32_t> want_visible = d.visible.Download();
    GuardedBuffer<uint16_t> d_pool(pool.size());
    GuardedBuffer<int32_t> d_table(table.size());
    GuardedBuffer<float> scores(want.size());
    GuardedBuffer<int32_t> visible(want_visible.size());
    d_pool.Upload(pool);
    d_table.Upload(table);
    // The unwritten tail of each row must stay as it was: copy the slot layout's bits there.
    scores.Upload(want);
    PDSERVE_CUDA_OK(indexer_scores_generic(
        d.q.get(), d.weights.get(), c.rows(), c.heads, c.head_dim, DevicePtr(d_pool),
        c.key_capacity, d.slot_of_row.get(), d.position_of_row.get(), kRate, c.score_scale,
        c.max_keys, scores.get(), visible.get(), nullptr, {d_table.get(), stride, kPage}));
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(visible.Download(), want_visible);
    const std::vector<float> got = scores.Download();
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
        << "heads " << heads << " head_dim " << head_dim;
    EXPECT_TRUE(scores.GuardsIntact() && visible.GuardsIntact());
  }
}

TEST(CudaIndexerGenericTest, HeavyReluTiesFollowCpuRule) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (const auto& [heads, head_dim] :
       std::vector<std::pair<int64_t, int64_t>>{{3, 24}, {64, 128}}) {
    RunAndCheck(MakeCase(rng, heads, head_dim, 3, 700, 700, MixedRows(), 0.8), 100);
    RunAndCheck(MakeCase(rng, heads, head_dim, 2, 500, 500, {{0, 480}, {1, 333}}, 0.5), 512);
  }
}

// Keys past max_keys or key_capacity are never visible, however late the position.
TEST(CudaIndexerGenericTest, VisibleIsClampedToCapacityAndMaxKeys) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  RunAndCheck(MakeCase(rng, 16, 32, 2, 300, 100, {{0, kAllKeys}, {1, 90}, {1, 0}}, 0.0), 16);
  RunAndCheck(MakeCase(rng, 16, 32, 2, 70, 300, {{0, kAllKeys}, {1, 65}}, 0.0), 16);
}

// Prefill: consecutive positions of one request in one call (the visible length grows by one
// every `rate` rows), next to another request's rows.
TEST(CudaIndexerGenericTest, PrefillChunksMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  for (const auto& [heads, head_dim, first, count] :
       std::vector<std::tuple<int64_t, int64_t, int32_t, int32_t>>{{3, 24, 0, 2000},
                                                                   {64, 128, 3900, 64}}) {
    std::vector<RowSpec> rows;
    for (int32_t i = 0; i < count; ++i) rows.push_back({1, (first + i + 1) / int32_t{kRate}});
    rows.push_back({0, 17});
    ScoreCase c = MakeCase(rng, heads, head_dim, 3, 1100, 1100, rows, 0.2);
    for (int32_t i = 0; i < count; ++i) c.position_of_row[i] = first + i;
    RunAndCheck(c, 256);
  }
}

// A captured launch re-reads positions from device memory at every replay.
TEST(CudaIndexerGenericTest, GraphReplayFollowsPositionsInDeviceMemory) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  const int64_t topk = 32;
  ScoreCase c = MakeCase(rng, 3, 24, 2, 400, 400, {{0, 390}, {1, 10}, {0, 0}}, 0.0);
  DeviceCase d(c, topk);
  ASSERT_TRUE(d.ok());
  cudaStream_t stream = nullptr;
  PDSERVE_CUDA_OK(cudaStreamCreate(&stream));
  PDSERVE_CUDA_OK(d.Launch(c, topk, stream));  // the first launch, outside capture
  PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  PDSERVE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  PDSERVE_CUDA_OK(d.Launch(c, topk, stream));
  PDSERVE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  PDSERVE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  c.position_of_row = {4 * 100, 4 * 10 + 2, 4 * 3};
  d.position_of_row.Upload(c.position_of_row);
  PDSERVE_CUDA_OK(cudaGraphLaunch(exec, stream));
  PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(d.visible.Download(), (std::vector<int32_t>{100, 10, 3}));
  const std::vector<float> replayed = d.scores.Download();
  std::vector<int32_t> visible;
  const std::vector<float> want = ScoresOnCpu(c, &visible);
  for (int64_t r = 0; r < c.rows(); ++r) {
    const auto got_row = replayed.begin() + r * c.max_keys;
    const auto want_row = want.begin() + r * c.max_keys;
    testing::ExpectNear(std::vector<double>(got_row, got_row + visible[r]),
                        std::vector<double>(want_row, want_row + visible[r]), kScoreTolerance,
                        "row " + std::to_string(r));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaIndexerGenericTest, ZeroRowsWritesNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  ScoreCase c = MakeCase(rng, 3, 24, 1, 64, 64, {{0, 10}}, 0.0);
  DeviceCase d(c, 8);
  ASSERT_TRUE(d.ok());
  PDSERVE_CUDA_OK(indexer_scores_generic(d.q.get(), d.weights.get(), 0, 3, 24, DevicePtr(d.keys),
                                         64, d.slot_of_row.get(), d.position_of_row.get(), kRate,
                                         1.0f, 64, d.scores.get(), d.visible.get(), nullptr));
  PDSERVE_CUDA_OK(cudaDeviceSynchronize());
  for (float v : d.scores.Download()) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    EXPECT_EQ(bits, kUnwritten);
  }
  for (int32_t v : d.visible.Download()) EXPECT_EQ(static_cast<uint32_t>(v), kUnwritten);
}

TEST(CudaIndexerGenericTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  GuardedBuffer<float> f(64);
  GuardedBuffer<uint16_t> k(64);
  GuardedBuffer<int32_t> i(64);
  ASSERT_TRUE(f.ok() && k.ok() && i.ok());
  const auto call = [&](int64_t rows, int64_t heads, int64_t head_dim, int64_t rate,
                        int64_t max_keys, float* scores) {
    return indexer_scores_generic(f.get(), f.get(), rows, heads, head_dim, DevicePtr(k), 8, i.get(),
                                  i.get(), rate, 1.0f, max_keys, scores, i.get(), nullptr);
  };
  EXPECT_EQ(call(1, 0, 8, 4, 8, f.get()), cudaErrorInvalidValue);
  EXPECT_EQ(call(1, 4, 0, 4, 8, f.get()), cudaErrorInvalidValue);
  EXPECT_EQ(call(-1, 4, 8, 4, 8, f.get()), cudaErrorInvalidValue);
  EXPECT_EQ(call(1, 4, 8, 0, 8, f.get()), cudaErrorInvalidValue);
  EXPECT_EQ(call(1, 4, 8, 4, -1, f.get()), cudaErrorInvalidValue);
  EXPECT_EQ(call(1, 4, 8, 4, int64_t{1} << 32, f.get()), cudaErrorInvalidValue);
  EXPECT_EQ(call(1, 64, 1024, 4, 8, f.get()), cudaErrorInvalidValue);  // shared memory
  EXPECT_EQ(call(1, 4, 8, 4, 8, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
