#include "kernels/cpu/topk_radix.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

uint32_t KeyOf(float score) {
  uint32_t bits = 0;
  std::memcpy(&bits, &score, sizeof(bits));
  return OrderKeyOfBits(bits);
}

// The kernel's FindBin over the row's histogram (the parts' counts summed): the largest bin whose
// entries plus those above number at least `need`; returns it with the entries above it.
struct FoundBin {
  uint32_t bin;
  uint32_t above;
  uint32_t in_bin;
};
FoundBin FindBin(const std::vector<uint32_t>& hist, uint32_t need) {
  uint32_t running = 0;
  for (size_t b = hist.size(); b-- > 0;) {
    if (running < need && running + hist[b] >= need) {
      return {static_cast<uint32_t>(b), running, hist[b]};
    }
    running += hist[b];
  }
  return {0, 0, 0};  // need exceeds the count: the kernel's callers never ask
}

// The select kernel's NarrowCandidates: `cand` holds every entry with a key above hi and those
// with keys in [lo, hi], of which the `need` best complete the picks. Rounds of 2^bin_bits bins
// over the keys in [lo, hi] keep the bin where the picks end (and everything above it) until at
// most `cap` entries remain or one key is left; returns the rounds.
int NarrowSelected(std::vector<uint64_t>& cand, uint32_t lo, uint32_t hi, uint32_t need,
                   int bin_bits, size_t cap) {
  int rounds = 0;
  std::vector<uint32_t> hist(size_t{1} << bin_bits);
  while (cand.size() > cap && lo != hi) {
    const uint32_t span = hi - lo;
    int bits = 0;  // bit length of span
    while (bits < 32 && (span >> bits) != 0) ++bits;
    const int shift = std::max(bits - bin_bits, 0);
    std::fill(hist.begin(), hist.end(), 0u);
    for (uint64_t entry : cand) {
      const uint32_t key = static_cast<uint32_t>(entry >> 32);
      if (key >= lo && key <= hi) ++hist[(key - lo) >> shift];
    }
    const FoundBin found = FindBin(hist, need);
    need -= found.above;
    const uint32_t new_lo = lo + (found.bin << shift);
    const uint32_t width = (1u << shift) - 1u;
    hi = hi - new_lo > width ? new_lo + width : hi;
    lo = new_lo;
    std::erase_if(cand, [lo](uint64_t entry) { return static_cast<uint32_t>(entry >> 32) < lo; });
    ++rounds;
  }
  return rounds;
}

int BitLength(uint32_t v) {
  int bits = 0;
  while (bits < 32 && (v >> bits) != 0) ++bits;
  return bits;
}

// The select kernel's BucketRankWrite: the candidates' keys in [lo, hi] (first the smallest and
// largest) counted in 2^bin_bits bins; a bin's first place is the count of the bins above it,
// an entry's place its bin's plus its bin's entries greater than it. A bin holding picks with
// more than max_bin entries moves lo up to the picks-th best's bin, once; a second such bin
// returns false (nothing written).
bool BucketRank(const std::vector<uint64_t>& cand, int32_t picks, int bin_bits, uint32_t max_bin,
                int32_t* out) {
  uint32_t lo = 0xFFFFFFFFu;
  uint32_t hi = 0;
  for (uint64_t entry : cand) {
    lo = std::min(lo, static_cast<uint32_t>(entry >> 32));
    hi = std::max(hi, static_cast<uint32_t>(entry >> 32));
  }
  const size_t bins = size_t{1} << bin_bits;
  std::vector<uint32_t> counts(bins);
  std::vector<uint32_t> first(bins);
  const uint32_t need = static_cast<uint32_t>(picks);
  int shift = 0;
  uint32_t total = 0;
  for (int attempt = 0;; ++attempt) {
    shift = std::max(BitLength(hi - lo) - bin_bits, 0);
    std::fill(counts.begin(), counts.end(), 0u);
    for (uint64_t entry : cand) {
      const uint32_t key = static_cast<uint32_t>(entry >> 32);
      if (key >= lo) ++counts[(key - lo) >> shift];
    }
    uint32_t running = 0;
    bool crowded = false;
    uint32_t picks_bin = 0;
    for (size_t b = bins; b-- > 0;) {
      first[b] = running;
      crowded = crowded || (running < need && counts[b] > max_bin);
      if (running < need && running + counts[b] >= need) picks_bin = static_cast<uint32_t>(b);
      running += counts[b];
    }
    total = running;
    if (!crowded) break;
    if (attempt == 1) return false;
    lo += picks_bin << shift;
  }
  for (uint64_t entry : cand) {
    const uint32_t key = static_cast<uint32_t>(entry >> 32);
    if (key < lo) continue;
    const uint32_t bin = (key - lo) >> shift;
    if (first[bin] >= need) continue;
    const uint32_t end = bin == 0 ? total : first[bin - 1];
    uint32_t place = first[bin];
    for (uint64_t other : cand) {
      const uint32_t other_key = static_cast<uint32_t>(other >> 32);
      if (other_key >= lo && ((other_key - lo) >> shift) == bin && other > entry) ++place;
    }
    if (place >= end) std::abort();  // the bin's places are [first, end)
    if (place < need) out[place] = PickIndex(entry);
  }
  return true;
}

// The select kernels' SampleThreshold (SampleThresholdByWarp for kSelectPrefetch): every stride-th
// key (stride >= sample_stride, at most max_samples samples), and the lower bound of the bin
// holding the sample's r-th best key, r = ceil(1.5 picks / stride) + 24, by histogram rounds of
// 2^sample_bin_bits bins that stop once that bin holds at most 8 samples or one key.
// With sample_quantile, rows of at most kQuantileMaxEntries: kSelectQuantile's sample, and with a
// QuantileRank of at least 2 its group ranks instead of the rounds.
uint32_t SampleThreshold(const std::vector<uint32_t>& keys, int32_t picks,
                         const RadixSplitConfig& config) {
  const int32_t n = static_cast<int32_t>(keys.size());
  const bool quantile = config.sample_quantile && n <= kQuantileMaxEntries;
  const int32_t max_samples =
      quantile ? std::min(config.max_samples, kQuantileSamples) : config.max_samples;
  const int32_t stride = SampleStride(n, config.sample_stride, max_samples);
  const int32_t samples = (n + stride - 1) / stride;
  const int32_t rank = quantile ? QuantileRank(picks, stride, config.max_candidates) : 0;
  if (rank >= 2) {
    std::vector<uint32_t> group_keys;
    for (int32_t g = 0; g < kQuantileGroups; ++g) {
      std::vector<uint32_t> group;
      for (int32_t e = g; e < samples; e += kQuantileGroups) {
        group.push_back(keys[static_cast<size_t>(e) * stride]);
      }
      std::sort(group.begin(), group.end(), std::greater<>());
      group_keys.push_back(static_cast<size_t>(rank) <= group.size() ? group[rank - 1] : 0u);
    }
    std::sort(group_keys.begin(), group_keys.end(), std::greater<>());
    return group_keys[kQuantileMedianRank - 1];
  }
  uint32_t need =
      static_cast<uint32_t>(std::min(samples, (3 * picks + 2 * stride - 1) / (2 * stride) + 24));
  const int bin_bits = config.sample_bin_bits > 0 ? config.sample_bin_bits : config.bin_bits;
  std::vector<uint32_t> hist(size_t{1} << bin_bits);
  RadixRange range = FirstRadixRange(bin_bits);
  for (;;) {
    std::fill(hist.begin(), hist.end(), 0u);
    for (int32_t j = 0; j < samples; ++j) {
      const uint32_t key = keys[static_cast<size_t>(j) * stride];
      if (key - range.lo <= range.hi - range.lo) ++hist[(key - range.lo) >> range.shift];
    }
    const FoundBin found = FindBin(hist, need);
    need -= found.above;
    if (found.in_bin <= 8 || range.shift == 0) return BinLow(range, found.bin);
    range = NarrowToBin(range, found.bin, bin_bits);
  }
}

}  // namespace

RadixSplitStats TopKRadixSplit(const float* scores, int32_t n, int32_t k,
                               const RadixSplitConfig& config, int32_t* out) {
  RadixSplitStats stats;
  const int32_t picks = std::min(k, std::max(n, 0));
  std::fill(out, out + k, -1);
  if (picks == 0) return stats;
  std::vector<uint32_t> keys(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) keys[i] = KeyOf(scores[i]);
  const int blocks = config.blocks;
  std::vector<RowPart> parts(blocks);
  for (int b = 0; b < blocks; ++b) parts[b] = PartOfRow(n, blocks, b);
  std::vector<std::vector<uint64_t>> cand(blocks);
  // Each part gathers what `take(key, index within the part, block)` accepts, in index order
  // (the kernel's order is arbitrary; the sort makes it irrelevant).
  const auto gather = [&](const std::function<bool(uint32_t, int32_t, int)>& take) {
    for (int b = 0; b < blocks; ++b) {
      for (int32_t i = 0; i < parts[b].count; ++i) {
        const int32_t index = parts[b].first + i;
        if (take(keys[index], i, b)) cand[b].push_back(PickKey(keys[index], index));
      }
    }
  };
  // What the selection leaves for the select variant's narrowing: every gathered entry above
  // sel_hi, and those in [sel_lo, sel_hi] of which the sel_need best are picks.
  uint32_t sel_lo = 0;
  uint32_t sel_hi = 0xFFFFFFFFu;
  uint32_t sel_need = static_cast<uint32_t>(picks);
  bool sampled = false;
  if (config.select_sort && n > config.max_candidates) {
    // The select kernel's first try: the entries at or above a sample's threshold, when they hold
    // at least the picks and fit the buffer.
    const uint32_t threshold = SampleThreshold(keys, picks, config);
    const auto above = std::count_if(keys.begin(), keys.end(),
                                     [threshold](uint32_t key) { return key >= threshold; });
    sampled = above >= picks && above <= config.max_candidates;
    if (sampled) {
      stats.sampled = true;
      sel_lo = threshold;
      gather([threshold](uint32_t key, int32_t, int) { return key >= threshold; });
    }
  }
  if (config.select_sort ? n <= config.max_candidates : n <= std::max(picks, config.whole_sort)) {
    stats.whole_sort = !config.select_sort || n <= config.whole_sort;
    gather([](uint32_t, int32_t, int) { return true; });
  } else if (!sampled) {
    RadixRange range = FirstRadixRange(config.bin_bits);
    uint32_t need = static_cast<uint32_t>(picks);
    uint32_t in_range = static_cast<uint32_t>(n);
    std::vector<uint32_t> hist(size_t{1} << config.bin_bits);
    for (;;) {
      FoundBin found{0, 0, in_range};
      if (range.hi != range.lo) {
        // The parts' histograms summed: one histogram of the row.
        std::fill(hist.begin(), hist.end(), 0u);
        for (uint32_t key : keys) {
          if (key - range.lo <= range.hi - range.lo) ++hist[(key - range.lo) >> range.shift];
        }
        ++stats.rounds;
        found = FindBin(hist, need);
      }
      need -= found.above;
      const uint32_t bin_lo = BinLow(range, found.bin);
      const uint32_t at_or_above = static_cast<uint32_t>(picks) - need + found.in_bin;
      sel_lo = bin_lo;
      sel_need = need;
      if (at_or_above <= static_cast<uint32_t>(config.max_candidates)) {
        sel_hi = range.shift == 0 ? bin_lo : NarrowToBin(range, found.bin, config.bin_bits).hi;
        gather([&](uint32_t key, int32_t, int) { return key >= bin_lo; });
        break;
      }
      sel_hi = bin_lo;
      if (range.shift == 0) {
        // bin_lo is the picks-th best key: everything above it, then the row's first `need`
        // ties by index, a part's ties after those of the parts before it.
        stats.tie_path = true;
        std::vector<uint32_t> ties_before(blocks, 0);
        for (int b = 1; b < blocks; ++b) {
          ties_before[b] = ties_before[b - 1] +
                           static_cast<uint32_t>(std::count(
                               keys.begin() + parts[b - 1].first,
                               keys.begin() + parts[b - 1].first + parts[b - 1].count, bin_lo));
        }
        std::vector<uint32_t> seen(blocks, 0);
        gather([&](uint32_t key, int32_t, int b) {
          if (key > bin_lo) return true;
          return key == bin_lo && ties_before[b] + seen[b]++ < need;
        });
        break;
      }
      range = NarrowToBin(range, found.bin, config.bin_bits);
      in_range = found.in_bin;
    }
  }
  if (config.select_sort) {
    // The first block gathers every part's candidates and places the picks by bins of their keys
    // (BucketRank); where that finds them bunched, it narrows them to the smallest power of two
    // >= max(picks, 32) where it can (not rows of at most whole_sort), sorts them and writes the
    // first picks.
    std::vector<uint64_t> all;
    for (const auto& part : cand) all.insert(all.end(), part.begin(), part.end());
    stats.candidates = static_cast<int>(all.size());
    stats.bucket_ranked = BucketRank(all, picks, config.bin_bits, config.max_bin_entries, out);
    if (stats.bucket_ranked) return stats;
    size_t cap = 32;
    while (cap < static_cast<size_t>(picks)) cap <<= 1;
    if (n > config.whole_sort) {
      stats.narrow_rounds = NarrowSelected(all, sel_lo, sel_hi, sel_need, config.bin_bits, cap);
    }
    stats.sorted = static_cast<int>(all.size());
    std::sort(all.begin(), all.end(), std::greater<uint64_t>());
    for (int32_t j = 0; j < picks; ++j) out[j] = PickIndex(all[j]);
    return stats;
  }
  // Each part sorts its candidates; then an entry's place is its place in its part plus the
  // entries greater than it in the other parts' first min(size, picks) entries.
  std::vector<std::vector<uint64_t>> lists(blocks);
  for (int b = 0; b < blocks; ++b) {
    stats.candidates += static_cast<int>(cand[b].size());
    stats.max_part_candidates =
        std::max(stats.max_part_candidates, static_cast<int>(cand[b].size()));
    std::sort(cand[b].begin(), cand[b].end(), std::greater<uint64_t>());
    lists[b].assign(cand[b].begin(),
                    cand[b].begin() + std::min<size_t>(cand[b].size(), static_cast<size_t>(picks)));
  }
  for (int b = 0; b < blocks; ++b) {
    for (size_t i = 0; i < lists[b].size(); ++i) {
      size_t place = i;
      for (int other = 0; other < blocks; ++other) {
        if (other == b) continue;
        const auto& list = lists[other];
        // Entries greater than lists[b][i] in a descending list: a lower bound.
        place += static_cast<size_t>(
            std::lower_bound(list.begin(), list.end(), lists[b][i], std::greater<uint64_t>()) -
            list.begin());
      }
      if (place < static_cast<size_t>(picks)) out[place] = PickIndex(lists[b][i]);
    }
  }
  return stats;
}

}  // namespace pdserve::kernels::cpu
