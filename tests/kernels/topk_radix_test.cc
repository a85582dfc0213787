// The CPU twin of the CUDA top-k's split radix select (kernels/cpu/topk_radix.h) against TopK
// (kernels/cpu/topk.h), element for element. Narrow bins and small candidate buffers make short
// rows take the kernel's rare paths (several rounds, ties ranked across parts); the stats show
// each path ran.
#include "kernels/cpu/topk_radix.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/topk.h"

namespace pdserve::kernels::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<int32_t> Reference(const std::vector<float>& row, int32_t k) {
  std::vector<int32_t> out(static_cast<size_t>(k));
  std::vector<int32_t> scratch(row.size());
  TopK(row.data(), static_cast<int64_t>(row.size()), k, out.data(), scratch.data());
  return out;
}

// Runs the twin over every block count, with both kernels' final steps (the select kernel's also
// with kSelectPrefetch's 256-bin sample rounds and with kSelectQuantile's group ranks), and returns
// the stats of each run.
std::vector<RadixSplitStats> ExpectMatches(const std::vector<float>& row, int32_t k,
                                           RadixSplitConfig config, const std::string& what) {
  const std::vector<int32_t> want = Reference(row, k);
  std::vector<RadixSplitStats> all;
  for (int run = 0; run < 20; ++run) {
    config.blocks = std::array<int, 5>{1, 2, 3, 4, 8}[run % 5];
    config.select_sort = run >= 5;
    config.sample_bin_bits = run >= 10 ? 8 : 0;
    config.sample_quantile = run >= 15;
    std::vector<int32_t> got(static_cast<size_t>(k), 7);
    const RadixSplitStats stats =
        TopKRadixSplit(row.data(), static_cast<int32_t>(row.size()), k, config, got.data());
    EXPECT_EQ(got, want) << what << ": n " << row.size() << " k " << k << " blocks "
                         << config.blocks << " bin bits " << config.bin_bits << " buffer "
                         << config.max_candidates << " select-sort " << config.select_sort
                         << " sample bin bits " << config.sample_bin_bits << " quantile "
                         << config.sample_quantile;
    if (config.select_sort) {
      // The select kernel's first block holds the gathered candidates and sorts at most them.
      EXPECT_LE(stats.candidates, std::max(config.max_candidates, k)) << what;
      EXPECT_LE(stats.sorted, stats.candidates) << what;
    } else if (!stats.whole_sort) {
      // The kernel's buffers: a row gathers at most max_candidates (the tie path exactly the
      // picks), so each part's list and the merge copy fit.
      EXPECT_LE(stats.candidates, std::max(config.max_candidates, k)) << what;
      if (stats.tie_path) {
        EXPECT_EQ(stats.candidates, std::min<int32_t>(k, static_cast<int32_t>(row.size()))) << what;
      }
    }
    all.push_back(stats);
  }
  return all;
}

// Consecutive aligned parts that cover the row, as the 64-bit rule would cut them (the 32-bit
// arithmetic near the longest row, 2^31 - 33 entries, included).
TEST(TopKRadixTest, PartsCoverTheRowInAlignedPieces) {
  for (int32_t n : {0, 1, 5, 1023, 1024, 40001, 2147483615}) {
    for (int32_t blocks : {1, 2, 3, 4, 7, 8}) {
      int32_t next = 0;
      for (int32_t rank = 0; rank < blocks; ++rank) {
        const RowPart part = PartOfRow(n, blocks, rank);
        const int64_t cap = ((int64_t{n} + blocks - 1) / blocks + 3) / 4 * 4;
        EXPECT_EQ(part.first, std::min<int64_t>(cap * rank, n))
            << n << " " << blocks << " " << rank;
        EXPECT_EQ(part.first, next) << n << " " << blocks << " " << rank;
        EXPECT_TRUE(part.count == 0 || part.first % 4 == 0) << part.first;
        EXPECT_GE(part.count, 0);
        next = part.first + part.count;
      }
      EXPECT_EQ(next, n);
    }
  }
}

TEST(TopKRadixTest, NarrowToBinKeepsTheBinsKeys) {
  const RadixRange first = FirstRadixRange(12);
  EXPECT_EQ(first.shift, 20);
  const RadixRange second = NarrowToBin(first, 0x801, 12);
  EXPECT_EQ(second.lo, 0x80100000u);
  EXPECT_EQ(second.hi, 0x801FFFFFu);
  EXPECT_EQ(second.shift, 8);
  const RadixRange third = NarrowToBin(second, 0xFFF, 12);
  EXPECT_EQ(third.lo, 0x801FFF00u);
  EXPECT_EQ(third.hi, 0x801FFFFFu);
  EXPECT_EQ(third.shift, 0);
  // A bin past a range's end is clipped to it.
  const RadixRange clipped = NarrowToBin({0x100, 0x105, 1}, 2, 12);
  EXPECT_EQ(clipped.lo, 0x104u);
  EXPECT_EQ(clipped.hi, 0x105u);
  EXPECT_EQ(clipped.shift, 0);
}

TEST(TopKRadixTest, OrderKeysFollowFloatOrderWithOneZero) {
  const std::vector<float> ascending = {-kInf,  -3e38f, -1.0f, -1e-38f, -1e-45f, 0.0f,
                                        1e-45f, 1e-38f, 1.0f,  3e38f,   kInf};
  for (size_t i = 1; i < ascending.size(); ++i) {
    uint32_t a = 0;
    uint32_t b = 0;
    std::memcpy(&a, &ascending[i - 1], 4);
    std::memcpy(&b, &ascending[i], 4);
    EXPECT_LT(OrderKeyOfBits(a), OrderKeyOfBits(b)) << ascending[i];
  }
  EXPECT_EQ(OrderKeyOfBits(0x80000000u), OrderKeyOfBits(0u));
  EXPECT_EQ(PickIndex(PickKey(OrderKeyOfBits(0u), 12345)), 12345);
  EXPECT_GT(PickKey(5, 0), PickKey(5, 1));  // a lower index first on ties
}

// BitsAtOrAbove: comparing a score as a float with it takes exactly the scores whose order key
// is at or above the threshold key (the CUDA gathering compares floats), for every non-NaN score
// and every key: special keys (each side of -inf, -0, +0 and +inf's, NaN ranges) and random ones,
// against special scores, random bit patterns and the scores next to the threshold's own float.
// Also the list entries: float bits over the index word, turned into the PickKey.
TEST(TopKRadixTest, FloatThresholdTakesTheKeysAtOrAbove) {
  const auto float_of = [](uint32_t bits) {
    float f = 0.0f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  std::vector<uint32_t> keys = {0u,          1u,          0x007FFFFEu, 0x007FFFFFu,
                                0x00800000u, 0x00800001u, 0x7FFFFFFEu, 0x7FFFFFFFu,
                                0x80000000u, 0x80000001u, 0x80000002u, 0xBF800000u,
                                0xFF7FFFFFu, 0xFF800000u, 0xFF800001u, 0xFFFFFFFFu};
  std::vector<uint32_t> scores = {0u,          0x80000000u, 1u,          0x80000001u, 0x007FFFFFu,
                                  0x807FFFFFu, 0x00800000u, 0x80800000u, 0x3F800000u, 0xBF800000u,
                                  0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F800000u, 0xFF800000u};
  std::mt19937 rng(20261206);
  for (int i = 0; i < 2000; ++i) keys.push_back(static_cast<uint32_t>(rng()));
  for (int i = 0; i < 2000; ++i) scores.push_back(static_cast<uint32_t>(rng()));
  int compared = 0;
  for (const uint32_t key : keys) {
    const uint32_t t_bits = BitsAtOrAbove(key);
    const float t = float_of(t_bits);
    std::vector<uint32_t> near = scores;
    if (!std::isnan(t)) {  // the threshold's float and its neighbours, both signs of zero
      for (const uint32_t d : {0u, 1u, 2u}) {
        near.push_back(t_bits + d);
        near.push_back(t_bits - d);
        near.push_back((t_bits ^ 0x80000000u) + d);
      }
    }
    for (const uint32_t bits : near) {
      const float x = float_of(bits);
      if (std::isnan(x)) continue;
      ++compared;
      ASSERT_EQ(x >= t, OrderKeyOfBits(bits) >= key)
          << std::hex << "key " << key << " score bits " << bits << " threshold bits " << t_bits;
    }
  }
  EXPECT_GT(compared, 16 * 2000);
  // BitsOfOrderKey inverts OrderKeyOfBits (-0.0 as +0.0), and a list entry becomes the PickKey.
  for (const uint32_t bits : scores) {
    if (std::isnan(float_of(bits))) continue;
    const uint32_t key = OrderKeyOfBits(bits);
    EXPECT_EQ(OrderKeyOfBits(BitsOfOrderKey(key)), key) << std::hex << bits;
    EXPECT_EQ(PickOfListEntry(ListEntryOfBits(bits, 4097)), PickKey(key, 4097)) << std::hex << bits;
  }
  EXPECT_EQ(BitsOfOrderKey(OrderKeyOfBits(0x80000000u)), 0u);
}

TEST(TopKRadixTest, RandomRowsMatchTopKAtKernelSettings) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal;
  for (int32_t n : {1, 37, 1024, 1025, 5000, 33333}) {
    std::vector<float> row(static_cast<size_t>(n));
    for (float& s : row) s = normal(rng);
    for (int32_t k : {1, 512, 2048}) ExpectMatches(row, k, {}, "normal");
  }
}

// Bins of 2-4 bits take up to 16 rounds; buffers of 8-64 candidates push rows of a few hundred
// entries into the tie path.
TEST(TopKRadixTest, NarrowBinsAndSmallBuffersMatchTopK) {
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> level(-3, 3);
  std::uniform_int_distribution<int> ulps(0, 40);
  std::bernoulli_distribution rare(0.05);
  bool saw_tie_path = false;
  int most_rounds = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const int32_t n = std::uniform_int_distribution<int32_t>(1, 700)(rng);
    std::vector<float> row(static_cast<size_t>(n));
    const int kind = trial % 5;
    for (int32_t i = 0; i < n; ++i) {
      switch (kind) {
        case 0:
          row[i] = normal(rng);
          break;
        case 1:
          row[i] = static_cast<float>(level(rng));
          break;  // heavy ties
        case 2:
          row[i] = std::nextafter(1.0f, 2.0f) + static_cast<float>(ulps(rng)) * 0x1p-23f;
          break;
        case 3:
          row[i] = rare(rng) ? kInf : (rare(rng) ? -kInf : (i % 2 == 0 ? -0.0f : 0.0f));
          break;
        default:
          row[i] = i == n / 2 ? 1e30f : normal(rng);
          break;  // an outlier
      }
    }
    for (int bin_bits : {2, 3, 4, 12}) {
      for (int max_candidates : {8, 64, 4096}) {
        for (int32_t k : {1, 5, 64}) {
          RadixSplitConfig config;
          config.bin_bits = bin_bits;
          config.max_candidates = std::max(max_candidates, k);
          config.whole_sort = 16;
          for (const RadixSplitStats& stats :
               ExpectMatches(row, k, config, "kind " + std::to_string(kind))) {
            saw_tie_path = saw_tie_path || stats.tie_path;
            most_rounds = std::max(most_rounds, stats.rounds);
          }
        }
      }
    }
  }
  EXPECT_TRUE(saw_tie_path);
  EXPECT_GE(most_rounds, 8);
}

// The kernel's own settings on rows whose k-th score has more ties than the buffer: the lowest
// indices are taken across parts.
TEST(TopKRadixTest, MassiveTiesAtKernelSettingsTakeLowestIndices) {
  std::mt19937_64 rng(3);
  std::bernoulli_distribution rare(0.002);
  for (int32_t n : {4097, 40000, 50001}) {
    std::vector<float> sparse_ties(static_cast<size_t>(n));
    std::vector<float> all_equal(static_cast<size_t>(n), -kInf);
    for (int32_t i = 0; i < n; ++i) sparse_ties[i] = rare(rng) ? 2.0f : (i % 5 == 0 ? 1.0f : 0.0f);
    for (int32_t k : {1, 511, 2048}) {
      const auto stats = ExpectMatches(all_equal, k, {}, "all -inf");
      EXPECT_TRUE(stats.front().tie_path);
      ExpectMatches(sparse_ties, k, {}, "sparse ties");
    }
  }
}

// The body of SelectSortPlacesPicksByBins (below) with the sample's rounds of 2^sample_bin_bits
// bins (0: bin_bits), or its group ranks (sample_quantile).
void ExpectSelectSortPlacesPicksByBins(int sample_bin_bits, bool sample_quantile) {
  std::mt19937_64 rng(4);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> level(0, 3);
  RadixSplitConfig config;
  config.select_sort = true;
  config.sample_bin_bits = sample_bin_bits;
  config.sample_quantile = sample_quantile;
  bool saw_fallback = false;
  bool saw_narrowing = false;
  for (int32_t n : {100, 1024, 1025, 4096, 8192, 32768}) {
    std::vector<float> row(static_cast<size_t>(n));
    std::vector<float> levels(static_cast<size_t>(n));
    for (float& s : row) s = normal(rng);
    for (float& s : levels) s = static_cast<float>(level(rng));
    for (int blocks : {1, 4}) {
      config.blocks = blocks;
      for (int32_t k : {1, 37, 512, 2048}) {
        std::vector<int32_t> got(static_cast<size_t>(k));
        RadixSplitStats stats = TopKRadixSplit(row.data(), n, k, config, got.data());
        EXPECT_EQ(got, Reference(row, k)) << n << " " << k;
        if (k <= 512 && k < n) {  // bins over the picks' keys hold a few each
          EXPECT_TRUE(stats.bucket_ranked) << n << " " << k;
        }
        EXPECT_EQ(stats.sampled, n > 4096) << n << " " << k;  // the sample's threshold held
        stats = TopKRadixSplit(levels.data(), n, k, config, got.data());
        EXPECT_EQ(got, Reference(levels, k)) << n << " " << k;
        if (n == 32768) {  // a quarter of the row, 8192 entries, ties at the threshold
          EXPECT_FALSE(stats.sampled) << k;
        }
        saw_fallback = saw_fallback || !stats.bucket_ranked;
        saw_narrowing = saw_narrowing || stats.narrow_rounds > 0;
      }
    }
  }
  EXPECT_TRUE(saw_fallback);
  EXPECT_TRUE(saw_narrowing);
}

// The select variant at the kernel's settings: rows of normal scores longer than 4096 take the
// sample's threshold, and with fewer picks than entries have them placed by bins of the keys
// (rows of at most 4096 after a second count over the upper bins); four levels bunch the picks
// (and miss the sample where a quarter of the row, tied at the threshold, overflows the buffer),
// which are then narrowed (rows longer than 1024 with more entries than picks) and sorted. The
// same with kSelectPrefetch's sample rounds (256 bins) and kSelectQuantile's group ranks.
TEST(TopKRadixTest, SelectSortPlacesPicksByBins) {
  for (int sample_bin_bits : {0, 8}) {
    SCOPED_TRACE(sample_bin_bits);
    ExpectSelectSortPlacesPicksByBins(sample_bin_bits, false);
  }
  ExpectSelectSortPlacesPicksByBins(8, true);
}

// kSelectQuantile's threshold (group ranks of the sample, their median) holds the picks in
// one gathering on rows of normal scores, on rows whose scores rise or fall along the row (each
// group's samples span the row), and on normal scores plus a recency trend; the candidates stay
// between k and the buffer, near the 32 x stride x rank it aims at (rank: QuantileRank, for about
// 3k or (k + 4096) / 2). Below rank 2 (k = 37) it takes the rounds over the same sample, and rows
// past 32768 entries kSelectPrefetch's sample and rounds, which hold the picks too up to 65536
// entries (at 262144, 1M tokens, they miss for k >= 1024 and for the trending rows, as
// kSelectPrefetch does: only the picks are checked there).
TEST(TopKRadixTest, QuantileThresholdHoldsThePicks) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal;
  for (int32_t n : {4097, 8192, 32768, 40001, 65536, 262144}) {
    std::vector<std::vector<float>> rows(4, std::vector<float>(static_cast<size_t>(n)));
    for (int32_t i = 0; i < n; ++i) {
      rows[0][i] = normal(rng);
      rows[1][i] = static_cast<float>(i);
      rows[2][i] = static_cast<float>(n - i);
      rows[3][i] = normal(rng) + 4.0f * static_cast<float>(i) / static_cast<float>(n);
    }
    for (int32_t k : {37, 512, 1024, 2048}) {
      for (size_t r = 0; r < rows.size(); ++r) {
        RadixSplitConfig config;
        config.select_sort = true;
        config.sample_bin_bits = 8;
        config.sample_quantile = true;
        config.blocks = 3;
        std::vector<int32_t> got(static_cast<size_t>(k));
        const RadixSplitStats stats = TopKRadixSplit(rows[r].data(), n, k, config, got.data());
        EXPECT_EQ(got, Reference(rows[r], k)) << n << " " << k << " row " << r;
        if (n > 65536) continue;  // 1M tokens: kSelectPrefetch's sample, which may miss
        EXPECT_TRUE(stats.sampled) << n << " " << k << " row " << r;
        EXPECT_GE(stats.candidates, k) << n << " " << k << " row " << r;
        EXPECT_LE(stats.candidates, 4096) << n << " " << k << " row " << r;
        const int32_t stride = SampleStride(n, 16, kQuantileSamples);
        const int32_t rank = n <= kQuantileMaxEntries ? QuantileRank(k, stride, 4096) : 0;
        if (rank >= 2 && r == 0) {  // iid: near the aim, 32 x stride x rank
          const double aim = 32.0 * stride * rank;
          EXPECT_GT(stats.candidates, 0.6 * aim) << n << " " << k;
          EXPECT_LT(stats.candidates, 1.6 * aim) << n << " " << k;
        }
      }
    }
  }
  EXPECT_EQ(QuantileRank(512, 16, 4096), 3);
  EXPECT_EQ(QuantileRank(37, 16, 4096), 1);
  EXPECT_EQ(QuantileRank(2048, 16, 4096), 6);
  EXPECT_EQ(SampleStride(32768, 16, 2048), 16);
  EXPECT_EQ(SampleStride(32768, 16, kQuantileSamples), 32);
  EXPECT_EQ(SampleStride(65536, 16, kQuantileSamples), 64);
  EXPECT_EQ(QuantileRank(512, 32, 4096), 2);
  EXPECT_EQ(QuantileRank(512, 64, 4096), 1);
}

TEST(TopKRadixTest, ShortAndEmptyRows) {
  const std::vector<float> row = {3.0f, -kInf, 3.0f, kInf, -0.0f, 0.0f, 1.0f};
  for (int32_t k : {1, 7, 9, 2048}) {
    const auto stats = ExpectMatches(row, k, {}, "short");
    EXPECT_TRUE(stats.front().whole_sort);
  }
  std::vector<int32_t> out(4, 7);
  TopKRadixSplit(nullptr, 0, 4, {}, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>(4, -1)));
}

}  // namespace
}  // namespace pdserve::kernels::cpu
