// kernels/cuda/sparse_decode_attention against a float64 host evaluation of the same math
// (kernels/cpu/sink_attention.h): softmax over [scores, sink] without the sink, over window rows
// plus the selected (CSA) or all (HCA) compressed entries.
#include "kernels/cuda/sparse_decode_attention.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FreshRng;
using testing::FromBf16;
using testing::GuardedBuffer;
using testing::ToBf16;

constexpr int64_t kD = kSparseHeadDim;

struct AttentionCase {
  int64_t heads = 64;
  int64_t window_size = 128;
  int64_t page_size = 64;
  int64_t slots = 0;  // CSA top-k or HCA bound
  bool csa = true;
  std::vector<int32_t> window_len;
  std::vector<int32_t> window_page;
  std::vector<int32_t> n_compressed;
  std::vector<int32_t> indices;  // CSA only
  std::vector<uint16_t> q;
  std::vector<uint16_t> window_pool;
  std::vector<uint16_t> kv_pool;
  std::vector<int32_t> page_table;
  int64_t table_stride = 0;
  std::vector<float> sinks;
};

// Fills written rows with random values and every unwritten slot (window rows past window_len,
// page tails, spare pages) with NaN. `invalid_fraction` of the CSA indices are -1.
AttentionCase MakeCase(std::mt19937_64& rng, int64_t heads, bool csa, int64_t slots,
                       const std::vector<int32_t>& window_len,
                       const std::vector<int32_t>& n_compressed, double invalid_fraction) {
  AttentionCase c;
  c.heads = heads;
  c.csa = csa;
  c.slots = slots;
  c.window_len = window_len;
  c.n_compressed = n_compressed;
  const int64_t batch = static_cast<int64_t>(window_len.size());
  std::normal_distribution<float> normal;
  const auto fill = [&](uint16_t* row) {
    for (int64_t d = 0; d < kD; ++d) row[d] = ToBf16(normal(rng));
  };
  const int64_t window_pages = batch + 2;
  c.window_pool.assign(static_cast<size_t>(window_pages * c.window_size * kD), testing::kBf16NaN);
  std::vector<int32_t> order(static_cast<size_t>(window_pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  c.window_page.assign(order.begin(), order.begin() + batch);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t e = 0; e < window_len[b]; ++e) {
      fill(c.window_pool.data() + (c.window_page[b] * c.window_size + e) * kD);
    }
  }
  const int64_t max_compressed = *std::max_element(n_compressed.begin(), n_compressed.end());
  c.table_stride = std::max<int64_t>(1, (max_compressed + c.page_size - 1) / c.page_size);
  const int64_t pages = batch * c.table_stride + 2;
  c.kv_pool.assign(static_cast<size_t>(pages * c.page_size * kD), testing::kBf16NaN);
  order.resize(static_cast<size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  c.page_table.assign(order.begin(), order.begin() + batch * c.table_stride);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t e = 0; e < n_compressed[b]; ++e) {
      const int64_t page = c.page_table[b * c.table_stride + e / c.page_size];
      fill(c.kv_pool.data() + (page * c.page_size + e % c.page_size) * kD);
    }
  }
  if (csa) {
    std::bernoulli_distribution invalid(invalid_fraction);
    c.indices.assign(static_cast<size_t>(batch * slots), -1);
    for (int64_t b = 0; b < batch; ++b) {
      std::vector<int32_t> entries(static_cast<size_t>(n_compressed[b]));
      std::iota(entries.begin(), entries.end(), 0);
      std::shuffle(entries.begin(), entries.end(), rng);
      for (int64_t j = 0; j < std::min<int64_t>(slots, n_compressed[b]); ++j) {
        if (!invalid(rng)) c.indices[b * slots + j] = entries[j];
      }
    }
  }
  c.q.resize(static_cast<size_t>(batch * heads * kD));
  for (uint16_t& v : c.q) v = ToBf16(normal(rng));
  c.sinks.resize(static_cast<size_t>(heads));
  for (float& s : c.sinks) s = normal(rng);
  return c;
}

// out[b, h, :] in float64 from the bf16 inputs.
std::vector<double> Evaluate(const AttentionCase& c, float scale) {
  const int64_t batch = static_cast<int64_t>(c.window_len.size());
  std::vector<double> out(static_cast<size_t>(batch * c.heads * kD), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<const uint16_t*> rows;
    for (int64_t e = 0; e < c.window_len[b]; ++e) {
      rows.push_back(c.window_pool.data() + (c.window_page[b] * c.window_size + e) * kD);
    }
    const int64_t n_slots = c.csa ? c.slots : std::min<int64_t>(c.slots, c.n_compressed[b]);
    for (int64_t j = 0; j < n_slots; ++j) {
      const int64_t e = c.csa ? c.indices[b * c.slots + j] : j;
      if (e < 0 || e >= c.n_compressed[b]) continue;
      const int64_t page = c.page_table[b * c.table_stride + e / c.page_size];
      rows.push_back(c.kv_pool.data() + (page * c.page_size + e % c.page_size) * kD);
    }
    if (rows.empty()) continue;
    std::vector<double> logits(rows.size());
    for (int64_t h = 0; h < c.heads; ++h) {
      const uint16_t* q = c.q.data() + (b * c.heads + h) * kD;
      double top = c.sinks[h];
      for (size_t j = 0; j < rows.size(); ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < kD; ++d) dot += double{FromBf16(q[d])} * FromBf16(rows[j][d]);
        logits[j] = dot * scale;
        top = std::max(top, logits[j]);
      }
      double denom = std::exp(c.sinks[h] - top);
      for (double& l : logits) {
        l = std::exp(l - top);
        denom += l;
      }
      double* o = out.data() + (b * c.heads + h) * kD;
      for (size_t j = 0; j < rows.size(); ++j) {
        for (int64_t d = 0; d < kD; ++d) o[d] += logits[j] / denom * FromBf16(rows[j][d]);
      }
    }
  }
  return out;
}

// The device buffers of one case, uploaded.
struct DeviceCase {
  explicit DeviceCase(const AttentionCase& c)
      : batch(static_cast<int64_t>(c.window_len.size())),
        q(c.q.size()),
        window_pool(c.window_pool.size()),
        kv_pool(c.kv_pool.size()),
        window_len(c.window_len.size()),
        window_page(c.window_page.size()),
        n_compressed(c.n_compressed.size()),
        table(c.page_table.size()),
        indices(std::max<size_t>(1, c.indices.size())),
        sinks(c.sinks.size()) {
    q.Upload(c.q);
    window_pool.Upload(c.window_pool);
    kv_pool.Upload(c.kv_pool);
    window_len.Upload(c.window_len);
    window_page.Upload(c.window_page);
    n_compressed.Upload(c.n_compressed);
    table.Upload(c.page_table);
    if (c.csa) indices.Upload(c.indices);
    sinks.Upload(c.sinks);
  }
  SparseDecodeParams Params(const AttentionCase& c, int64_t entries_per_split, float scale,
                            SparseDecodeVariant variant) {
    SparseDecodeParams p;
    p.q = reinterpret_cast<const __nv_bfloat16*>(q.get());
    p.batch = batch;
    p.heads = c.heads;
    p.window_pool = reinterpret_cast<const __nv_bfloat16*>(window_pool.get());
    p.window_page = window_page.get();
    p.window_len = window_len.get();
    p.window_size = c.window_size;
    p.kv_pool = reinterpret_cast<const __nv_bfloat16*>(kv_pool.get());
    p.page_table = table.get();
    p.page_table_stride = c.table_stride;
    p.page_size = c.page_size;
    p.n_compressed = n_compressed.get();
    p.indices = c.csa ? indices.get() : nullptr;
    p.compressed_slots = c.slots;
    p.sinks = sinks.get();
    p.softmax_scale = scale;
    p.entries_per_split = entries_per_split;
    p.variant = variant;
    return p;
  }
  int64_t batch;
  GuardedBuffer<uint16_t> q, window_pool, kv_pool;
  GuardedBuffer<int32_t> window_len, window_page, n_compressed, table, indices;
  GuardedBuffer<float> sinks;
};

// The launch configurations every case runs with: every variant, kDependentLaunch (in clusters of
// 2 splits sharing the queries, opt-in) also without clusters (the default), launched plainly
// (programmatic_launch false) and without the lookups' prefetch, kClusterMerge also launched
// plainly and without the queries' multicast.
struct LaunchConfig {
  SparseDecodeVariant variant;
  bool programmatic_launch;
  bool prefetch_lookups;
  bool multicast_queries;
  int64_t query_cluster;
  const char* name;
};
constexpr LaunchConfig kConfigs[] = {
    {SparseDecodeVariant::kSplitCombine, true, true, true, 1, "kSplitCombine"},
    {SparseDecodeVariant::kDependentLaunch, true, true, true, 2, "kDependentLaunch"},
    {SparseDecodeVariant::kDependentLaunch, false, true, true, 2,
     "kDependentLaunch, plain launches"},
    {SparseDecodeVariant::kDependentLaunch, true, false, true, 2, "kDependentLaunch, no prefetch"},
    {SparseDecodeVariant::kDependentLaunch, true, true, true, 1, "kDependentLaunch, no clusters"},
    {SparseDecodeVariant::kClusterMerge, true, true, true, 1, "kClusterMerge"},
    {SparseDecodeVariant::kClusterMerge, false, true, true, 1, "kClusterMerge, plain launches"},
    {SparseDecodeVariant::kClusterMerge, true, true, false, 1, "kClusterMerge, no multicast"}};

// got (bf16 bits, [batch, heads, 512]) against the float64 reference.
void CheckOutput(const AttentionCase& c, const std::vector<uint16_t>& got_bits,
                 const std::vector<double>& want, const std::string& what) {
  const int64_t batch = static_cast<int64_t>(c.window_len.size());
  for (int64_t r = 0; r < batch * c.heads; ++r) {
    std::vector<double> got(static_cast<size_t>(kD));
    for (int64_t d = 0; d < kD; ++d) got[d] = FromBf16(got_bits[r * kD + d]);
    const std::vector<double> want_row(want.begin() + r * kD, want.begin() + (r + 1) * kD);
    const testing::ErrorReport err = testing::NormalizedError(got, want_row);
    ASSERT_EQ(err.mismatched, 0) << what << " request " << r / c.heads << " head " << r % c.heads;
    const bool empty =
        std::all_of(want_row.begin(), want_row.end(), [](double v) { return v == 0.0; });
    if (empty) {
      ASSERT_TRUE(std::all_of(got.begin(), got.end(), [](double v) { return v == 0.0; }))
          << what << " request " << r / c.heads << " attends to nothing but got nonzero output";
    } else {
      ASSERT_LT(err.normalized, 1e-2)
          << what << " request " << r / c.heads << " head " << r % c.heads;
    }
  }
}

// Runs the case with each launch configuration (all before the reference is computed), checks
// the outputs and the guard bands.
void RunAndCheck(const AttentionCase& c, int64_t entries_per_split,
                 float scale = 1.0f / std::sqrt(static_cast<float>(kD))) {
  DeviceCase d(c);
  std::vector<std::vector<uint16_t>> got;
  for (const LaunchConfig& config : kConfigs) {
    GuardedBuffer<uint16_t> out(static_cast<size_t>(d.batch * c.heads * kD));
    SparseDecodeParams p = d.Params(c, entries_per_split, scale, config.variant);
    p.programmatic_launch = config.programmatic_launch;
    p.prefetch_lookups = config.prefetch_lookups;
    p.multicast_queries = config.multicast_queries;
    p.query_cluster = config.query_cluster;
    GuardedBuffer<unsigned char> workspace(SparseDecodeWorkspaceBytes(p));
    ASSERT_TRUE(workspace.ok() && out.ok());
    PDSERVE_CUDA_OK(sparse_decode_attention(p, workspace.get(), workspace.size(),
                                            reinterpret_cast<__nv_bfloat16*>(out.get()), nullptr));
    PDSERVE_CUDA_OK(cudaDeviceSynchronize());
    got.push_back(out.Download());
    EXPECT_TRUE(out.GuardsIntact()) << config.name;
    EXPECT_TRUE(workspace.GuardsIntact()) << config.name;
  }
  const std::vector<double> want = Evaluate(c, scale);  // allocates after the kernels ran
  for (size_t v = 0; v < got.size(); ++v) {
    CheckOutput(c, got[v], want,
                std::string(kConfigs[v].name) + " split " + std::to_string(entries_per_split));
  }
}

TEST(CudaSparseDecodeTest, CsaMixedLengthsManySplits) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // Empty request, window only, fewer compressed entries than top-k, odd sizes, all-invalid
  // indices with an empty window, and a long request.
  const std::vector<int32_t> window_len = {0, 5, 128, 77, 0, 128, 33};
  const std::vector<int32_t> n_compressed = {0, 0, 3, 1000, 700, 515, 64};
  AttentionCase c = MakeCase(rng, 64, true, 512, window_len, n_compressed, 0.1);
  for (int64_t j = 0; j < 512; ++j) c.indices[4 * 512 + j] = -1;
  RunAndCheck(c, 64);
}

TEST(CudaSparseDecodeTest, CsaSingleSplitMatchesReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  RunAndCheck(MakeCase(rng, 64, true, 512, {128, 1, 100, 0}, {2048, 9, 513, 0}, 0.0), 640);
}

TEST(CudaSparseDecodeTest, HcaAllCompressedEntries) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  RunAndCheck(MakeCase(rng, 64, false, 1100, {128, 0, 17, 128}, {1030, 0, 1, 333}, 0.0), 192);
}

TEST(CudaSparseDecodeTest, EverySplitOneTile) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // 128 window rows + 128 slots in 8 splits of one 32-row tile: requests whose later splits are
  // empty, a request with nothing visible, tails shorter than a tile.
  RunAndCheck(MakeCase(rng, 64, true, 128, {128, 0, 31, 100, 0}, {400, 90, 33, 0, 0}, 0.3), 32);
  // 128 + 64 entries in 6 splits (HCA), and in 2.
  RunAndCheck(MakeCase(rng, 64, false, 64, {128, 7, 0}, {64, 63, 1}, 0.0), 32);
  RunAndCheck(MakeCase(rng, 64, false, 64, {128, 7, 0}, {64, 63, 1}, 0.0), 96);
}

TEST(CudaSparseDecodeTest, WideScoreRangeMovesTheReferenceMidway) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // Scores with a standard deviation of ~16 (log2 units): later rows often beat the running
  // reference maximum by more than the kernel's slack, so the output is rescaled between tiles
  // (with the usual 1/sqrt(512) scale it hardly ever is). One split and several.
  const AttentionCase c = MakeCase(rng, 64, true, 512, {128, 90, 3}, {2000, 700, 40}, 0.1);
  RunAndCheck(c, 640, 0.5f);
  RunAndCheck(c, 96, 0.5f);
}

TEST(CudaSparseDecodeTest, TilesTakenInTurnsByTheConsumerWarpgroups) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // The two consumer warpgroups own alternate 32-row tiles and hand P over: lists of 1, 2, 3, 4
  // and 5 tiles (the last tile owned by either warpgroup), and requests whose first tiles have
  // nothing visible (no window, CSA indices -1) so the reference maximum is -inf for a few
  // hand-overs before rows appear in a tile of the first or of the second warpgroup.
  const std::vector<int32_t> window_len = {0, 0, 0, 0, 0, 0, 0};
  const std::vector<int32_t> n_compressed = {32, 64, 96, 128, 160, 300, 300};
  AttentionCase c = MakeCase(rng, 64, true, 160, window_len, n_compressed, 0.0);
  for (int64_t j = 0; j < 64; ++j) c.indices[5 * 160 + j] = -1;  // rows from tile 2 (first)
  for (int64_t j = 0; j < 96; ++j) c.indices[6 * 160 + j] = -1;  // rows from tile 3 (second)
  RunAndCheck(c, 160);
  RunAndCheck(c, 160, 0.5f);  // wide score range: the reference moves in either warpgroup
}

TEST(CudaSparseDecodeTest, HundredTwentyEightHeads) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  RunAndCheck(MakeCase(rng, 128, true, 512, {128, 41}, {900, 200}, 0.2), 128);
}

TEST(CudaSparseDecodeTest, SplitSizeFollowsTheMeasuredCosts) {
  // Host arithmetic only (no GPU needed). 132 multiprocessors. Each expectation is the fastest
  // split size of the H200 sweep in docs/perf.md (2026-12-03), or within 5% of it.
  EXPECT_EQ(SparseDecodeEntriesPerSplit(128, 64, 640, 132), 640);  // a block per request
  EXPECT_EQ(SparseDecodeEntriesPerSplit(32, 64, 640, 132), 160);   // CSA b32: 4 splits
  EXPECT_EQ(SparseDecodeEntriesPerSplit(32, 128, 640, 132), 320);  // 2 head groups, 2 splits
  EXPECT_EQ(SparseDecodeEntriesPerSplit(1, 64, 640, 132), 64);     // CSA b1: 10 splits
  EXPECT_EQ(SparseDecodeEntriesPerSplit(32, 64, 160, 132), 160);   // HCA b32 x 4K: whole
  EXPECT_EQ(SparseDecodeEntriesPerSplit(1, 64, 1152, 132), 96);    // HCA b1 x 128K: 12 splits
  EXPECT_EQ(SparseDecodeEntriesPerSplit(32, 64, 1152, 132), 288);  // HCA b32 x 128K: 4 splits
  EXPECT_EQ(SparseDecodeEntriesPerSplit(1, 64, 5, 132), kSparseTile);
  for (int64_t batch = 1; batch <= 300; ++batch) {
    SparseDecodeParams p;
    p.batch = batch;
    p.window_size = 128;
    p.compressed_slots = 1021;
    p.entries_per_split = SparseDecodeEntriesPerSplit(batch, 64, 1149, 132);
    EXPECT_EQ(p.entries_per_split % kSparseTile, 0);
    EXPECT_LE(SparseDecodeSplits(p) * batch, std::max<int64_t>(132, batch));
  }
}

TEST(CudaSparseDecodeTest, ClusterSplitSizeKeepsClustersInOneWave) {
  // Host arithmetic only. 132 multiprocessors; clusters that fit at once per size (index =
  // blocks per cluster): one where 32 clusters of 4 fit, one where only 30 do.
  const int fits[kSparseMaxClusterSplits + 1] = {0, 0, 66, 44, 32, 26, 22, 16, 16};
  const int short_of_four[kSparseMaxClusterSplits + 1] = {0, 0, 66, 42, 30, 24, 18, 16, 14};
  const int none[kSparseMaxClusterSplits + 1] = {};
  EXPECT_EQ(SparseDecodeClusterEntriesPerSplit(32, 64, 640, 132, fits), 160);  // 4 splits
  // 30 clusters of 4 < 32 requests: 3 splits of 7 tiles.
  EXPECT_EQ(SparseDecodeClusterEntriesPerSplit(32, 64, 640, 132, short_of_four), 224);
  // 10 splits picked for kDependentLaunch: at most 8 in a cluster (20 tiles: 3 per split).
  EXPECT_EQ(SparseDecodeClusterEntriesPerSplit(1, 64, 640, 132, fits), 96);
  EXPECT_EQ(SparseDecodeClusterEntriesPerSplit(128, 64, 640, 132, fits), 640);  // one split
  EXPECT_EQ(SparseDecodeClusterEntriesPerSplit(32, 64, 640, 132, none), 640);   // no cluster
  for (int64_t batch = 1; batch <= 300; ++batch) {
    SparseDecodeParams p;
    p.batch = batch;
    p.window_size = 128;
    p.compressed_slots = 1021;
    p.entries_per_split = SparseDecodeClusterEntriesPerSplit(batch, 64, 1149, 132, short_of_four);
    EXPECT_EQ(p.entries_per_split % kSparseTile, 0);
    const int64_t splits = SparseDecodeSplits(p);
    EXPECT_LE(splits, kSparseMaxClusterSplits);
    if (splits > 1) {
      EXPECT_GE(short_of_four[splits], batch) << "batch " << batch;
    }
  }
}

TEST(CudaSparseDecodeTest, OddLengthsBatch33) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // 33 requests: lengths 0, 1, odd, one short of and one past multiples of 32 and 64, with window
  // rows and CSA slots mixed; split sizes that leave later splits of short requests empty and
  // requests that fit in split 0 (finished there by kDependentLaunch).
  std::vector<int32_t> window_len(33);
  std::vector<int32_t> n_compressed(33);
  const int32_t lengths[] = {0, 1, 3, 31, 33, 63, 65, 95, 97, 127, 129, 191, 255, 257, 300, 399};
  for (int b = 0; b < 33; ++b) {
    window_len[b] = b % 3 == 0 ? 0 : std::min<int32_t>(128, lengths[(b * 5) % 16]);
    n_compressed[b] = lengths[b % 16] + (b >= 16 ? 64 : 0) * (b % 2);
  }
  n_compressed[32] = 0;
  window_len[32] = 0;  // a request with nothing to attend
  const AttentionCase c = MakeCase(rng, 64, true, 256, window_len, n_compressed, 0.2);
  for (int64_t per : {32, 64, 96, 384}) RunAndCheck(c, per);
  const AttentionCase h = MakeCase(rng, 64, false, 320, window_len, n_compressed, 0.0);
  for (int64_t per : {32, 160, 448}) RunAndCheck(h, per);
}

TEST(CudaSparseDecodeTest, OneRequestManySplits) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // Batch 1: HCA over 1100 entries + 77 window rows in 37 splits of one tile, in 13 and in 2;
  // CSA with half the slots invalid.
  const AttentionCase h = MakeCase(rng, 64, false, 1100, {77}, {1100}, 0.0);
  for (int64_t per : {32, 96, 640}) RunAndCheck(h, per);
  const AttentionCase c = MakeCase(rng, 64, true, 512, {128}, {3000}, 0.5);
  for (int64_t per : {32, 64, 160}) RunAndCheck(c, per, 0.5f);
}

TEST(CudaSparseDecodeTest, Batch128Splits) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // 128 requests of 0-110 entries (window rows and CSA slots) in 32- and 64-row splits: requests
  // with no split, one split (kDependentLaunch: final output from split 0, skipped by the
  // combine kernel) and several, side by side.
  std::vector<int32_t> window_len(128);
  std::vector<int32_t> n_compressed(128);
  for (int b = 0; b < 128; ++b) {
    window_len[b] = (b * 7) % 41;
    n_compressed[b] = (b * 13) % 71;
  }
  const AttentionCase c = MakeCase(rng, 64, true, 64, window_len, n_compressed, 0.1);
  RunAndCheck(c, 32);
  RunAndCheck(c, 64);
}

// `variant` captured in a CUDA graph (as the decode step runs it: two launches, the second a
// programmatic dependent of the first's last kernel) and replayed three times, the same bits each
// time; then launched plainly (programmatic_launch false) on the same workspace with another split
// size and another batch: every output matches the reference. The graph's launch has 448 / per
// splits (kDependentLaunch at 32: 14, no clusters by default; kClusterMerge at 64: 7, one cluster),
// the plain one 11 (no clusters; kClusterMerge: run as kDependentLaunch).
void CheckGraphReplays(SparseDecodeVariant variant, int64_t per) {
  auto rng = FreshRng();
  const AttentionCase c =
      MakeCase(rng, 64, true, 320, {128, 0, 17, 90, 5}, {900, 0, 300, 41, 2}, 0.1);
  const AttentionCase small = MakeCase(rng, 64, false, 200, {3, 128}, {200, 77}, 0.0);
  DeviceCase d(c);
  DeviceCase ds(small);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  const SparseDecodeParams p = d.Params(c, per, scale, variant);
  SparseDecodeParams ps = ds.Params(small, 32, scale, variant);
  ps.programmatic_launch = false;  // the same kernel in a plain launch
  GuardedBuffer<unsigned char> workspace(
      std::max(SparseDecodeWorkspaceBytes(p), SparseDecodeWorkspaceBytes(ps)));
  GuardedBuffer<uint16_t> out(static_cast<size_t>(d.batch * c.heads * kD));
  GuardedBuffer<uint16_t> out_small(static_cast<size_t>(ds.batch * small.heads * kD));
  ASSERT_TRUE(workspace.ok() && out.ok() && out_small.ok());
  cudaStream_t stream;
  PDSERVE_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto* const o = reinterpret_cast<__nv_bfloat16*>(out.get());
  auto* const o_small = reinterpret_cast<__nv_bfloat16*>(out_small.get());
  // First call outside capture (kernel attributes).
  PDSERVE_CUDA_OK(sparse_decode_attention(p, workspace.get(), workspace.size(), o, stream));
  PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  PDSERVE_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  PDSERVE_CUDA_OK(sparse_decode_attention(p, workspace.get(), workspace.size(), o, stream));
  PDSERVE_CUDA_OK(sparse_decode_attention(p, workspace.get(), workspace.size(), o, stream));
  PDSERVE_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  PDSERVE_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<std::vector<uint16_t>> replays;
  for (int i = 0; i < 3; ++i) {
    PDSERVE_CUDA_OK(cudaMemsetAsync(out.get(), 0xFF, out.size() * 2, stream));  // NaN
    PDSERVE_CUDA_OK(cudaGraphLaunch(exec, stream));
    PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
    replays.push_back(out.Download());
  }
  PDSERVE_CUDA_OK(sparse_decode_attention(ps, workspace.get(), workspace.size(), o_small, stream));
  PDSERVE_CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> got_small = out_small.Download();
  EXPECT_TRUE(workspace.GuardsIntact());
  EXPECT_TRUE(out.GuardsIntact());
  PDSERVE_CUDA_OK(cudaGraphExecDestroy(exec));
  PDSERVE_CUDA_OK(cudaGraphDestroy(graph));
  PDSERVE_CUDA_OK(cudaStreamDestroy(stream));
  const std::vector<double> want = Evaluate(c, scale);
  for (size_t i = 0; i < replays.size(); ++i) {
    EXPECT_EQ(replays[i], replays[0]) << "replay " << i << " differs from replay 0";
    CheckOutput(c, replays[i], want, "graph replay " + std::to_string(i));
  }
  CheckOutput(small, got_small, Evaluate(small, scale), "eager after the graph");
}

TEST(CudaSparseDecodeTest, DependentLaunchGraphReplays) {
  PDSERVE_SKIP_WITHOUT_GPU();
  CheckGraphReplays(SparseDecodeVariant::kDependentLaunch, 32);
}

TEST(CudaSparseDecodeTest, ClusterMergeGraphReplays) {
  PDSERVE_SKIP_WITHOUT_GPU();
  CheckGraphReplays(SparseDecodeVariant::kClusterMerge, 64);
}

// One launch of `p` (its own workspace and output, guards checked); the output's bf16 bits.
std::vector<uint16_t> LaunchOnce(const SparseDecodeParams& p, const std::string& what) {
  GuardedBuffer<uint16_t> out(static_cast<size_t>(p.batch * p.heads * kD));
  GuardedBuffer<unsigned char> workspace(SparseDecodeWorkspaceBytes(p));
  EXPECT_TRUE(workspace.ok() && out.ok()) << what;
  EXPECT_EQ(sparse_decode_attention(p, workspace.get(), workspace.size(),
                                    reinterpret_cast<__nv_bfloat16*>(out.get()), nullptr),
            cudaSuccess)
      << what;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  EXPECT_TRUE(out.GuardsIntact()) << what;
  EXPECT_TRUE(workspace.GuardsIntact()) << what;
  return out.Download();
}

TEST(CudaSparseDecodeTest, ClustersMatchDependentLaunchBits) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = FreshRng();
  // kClusterMerge merges the same bf16 partials with the same fp32 arithmetic in the same split
  // order as kDependentLaunch's merge kernel, and kDependentLaunch in query clusters only loads
  // the queries differently: the same bits, in clusters of 2 to 8 splits (with and without the
  // queries' multicast), 128 heads (two clusters per request), requests that fit in split 0, have
  // nothing visible, or leave later splits empty.
  // List lengths of 11, 8, 7 and 9 tiles in splits of 1 to 6 tiles: 2 to 8 splits (and 11 and 9,
  // past kSparseMaxClusterSplits: run as kDependentLaunch).
  const AttentionCase cases[] = {
      MakeCase(rng, 64, true, 224, {0, 5, 128, 77, 0, 31}, {0, 0, 3, 1000, 700, 64}, 0.1),
      MakeCase(rng, 64, true, 128, {128, 1, 90}, {300, 0, 128}, 0.2),
      MakeCase(rng, 128, false, 96, {128, 7, 0}, {96, 63, 1}, 0.0),
      MakeCase(rng, 64, false, 160, {128, 100, 3}, {160, 33, 159}, 0.0)};
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  for (const AttentionCase& c : cases) {
    DeviceCase d(c);
    for (int64_t per : {32, 64, 96, 128, 192}) {
      const std::string what = std::string(c.csa ? "CSA" : "HCA") + " heads " +
                               std::to_string(c.heads) + " slots " + std::to_string(c.slots) +
                               " split " + std::to_string(per);
      const std::vector<uint16_t> want =
          LaunchOnce(d.Params(c, per, scale, SparseDecodeVariant::kDependentLaunch), what);
      // kClusterMerge with and without multicast; kDependentLaunch in clusters of 2 to 8 splits
      // sharing the queries (where that divides the splits).
      for (int64_t config = 0; config < 2 + kSparseMaxClusterSplits - 1; ++config) {
        const bool merge = config < 2;
        SparseDecodeParams p = d.Params(
            c, per, scale,
            merge ? SparseDecodeVariant::kClusterMerge : SparseDecodeVariant::kDependentLaunch);
        p.multicast_queries = config != 1;
        p.query_cluster = merge ? 1 : config;
        const std::string name = what + (merge ? (config == 0 ? " kClusterMerge multicast"
                                                              : " kClusterMerge no multicast")
                                               : " query_cluster " + std::to_string(config));
        const std::vector<uint16_t> got = LaunchOnce(p, name);
        size_t differ = 0;
        for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i] ? 1 : 0;
        EXPECT_EQ(differ, 0u) << name << ": " << differ << " of " << got.size()
                              << " outputs differ";
      }
    }
  }
}

TEST(CudaSparseDecodeTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  SparseDecodeParams p;
  p.batch = 1;
  p.heads = 96;  // not a multiple of 64
  unsigned char dummy = 0;
  EXPECT_EQ(sparse_decode_attention(p, &dummy, 1, nullptr, nullptr), cudaErrorInvalidValue);
  p.heads = 64;
  p.entries_per_split = 48;  // not a multiple of kSparseTile
  EXPECT_EQ(sparse_decode_attention(p, &dummy, 1, nullptr, nullptr), cudaErrorInvalidValue);
  p.entries_per_split = 64;
  p.softmax_scale = 0.0f;  // the kernel needs a positive scale
  EXPECT_EQ(sparse_decode_attention(p, &dummy, 1, nullptr, nullptr), cudaErrorInvalidValue);
  p.softmax_scale = 1.0f;
  p.variant = static_cast<SparseDecodeVariant>(7);  // no such variant
  EXPECT_EQ(sparse_decode_attention(p, &dummy, 1, nullptr, nullptr), cudaErrorInvalidValue);
  p.variant = SparseDecodeVariant::kDependentLaunch;
  p.query_cluster = kSparseMaxClusterSplits + 1;  // larger than a portable cluster
  EXPECT_EQ(sparse_decode_attention(p, &dummy, 1, nullptr, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
