// kernels/cuda/sink_attention against a host reference (the CPU engine's per-query key list:
// engine/attention.cc, with kernels/cpu/softmax.h SoftmaxWithSink), on fresh random inputs:
// sliding, HCA and CSA layers, several segments at mixed positions (window keys from the call's
// new rows and from the ring), odd head counts and dims, NaN in every row that must not be read.
#include "kernels/cuda/sink_attention.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/softmax.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::FromBf16;
using testing::GuardedBuffer;
using testing::kBf16NaN;
using testing::ToBf16;

enum class Kind { kSliding, kHca, kCsa };

struct Segment {
  int64_t slot;
  int64_t first_position;
  int64_t tokens;
};

struct AttnCase {
  Kind kind;
  int64_t heads;
  int64_t head_dim;
  int64_t window;
  int64_t rate;
  int64_t capacity;  // entries per slot
  int64_t topk;      // CSA
  std::vector<Segment> segments;
};

std::string Describe(const AttnCase& c) {
  const char* kinds[] = {"sliding", "hca", "csa"};
  std::string s = std::string(kinds[static_cast<int>(c.kind)]) + " heads " +
                  std::to_string(c.heads) + " dim " + std::to_string(c.head_dim) + " window " +
                  std::to_string(c.window) + " segments";
  for (const auto& g : c.segments) {
    s += " (slot " + std::to_string(g.slot) + " p0 " + std::to_string(g.first_position) + " n " +
         std::to_string(g.tokens) + ")";
  }
  return s;
}

// paged: the entries go through a page table (kernels/cuda/paged_entries.cuh) of 2-entry pages
// placed in a shuffled pool with a NaN null page 0 and spare NaN pages, the reference unchanged.
void RunCase(const AttnCase& c, std::mt19937_64& rng, bool paged = false) {
  SCOPED_TRACE(Describe(c) + (paged ? " paged" : ""));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t slots = 4;
  const int64_t hd = c.head_dim;
  int64_t rows = 0;
  for (const auto& g : c.segments) rows += g.tokens;

  // Per-row metadata.
  std::vector<int32_t> slot_of_row, position_of_row, first_position, first_row;
  for (const auto& g : c.segments) {
    const auto first = static_cast<int32_t>(slot_of_row.size());
    for (int64_t i = 0; i < g.tokens; ++i) {
      slot_of_row.push_back(static_cast<int32_t>(g.slot));
      position_of_row.push_back(static_cast<int32_t>(g.first_position + i));
      first_position.push_back(static_cast<int32_t>(g.first_position));
      first_row.push_back(first);
    }
  }
  // Source rows (host floats of the bf16 values) and the pools: NaN wherever nothing valid is.
  std::vector<uint16_t> new_kv(static_cast<size_t>(std::max<int64_t>(rows, 1) * hd));
  for (auto& v : new_kv) v = ToBf16(normal(rng));
  std::vector<uint16_t> ring(static_cast<size_t>(slots * c.window * hd), kBf16NaN);
  std::vector<uint16_t> entries(static_cast<size_t>(slots * c.capacity * hd), kBf16NaN);
  for (const auto& g : c.segments) {
    for (int64_t pos = std::max<int64_t>(0, g.first_position - c.window); pos < g.first_position;
         ++pos) {
      for (int64_t d = 0; d < hd; ++d) {
        ring[static_cast<size_t>((g.slot * c.window + pos % c.window) * hd + d)] =
            ToBf16(normal(rng));
      }
    }
    const int64_t written = std::min(c.capacity, (g.first_position + g.tokens) / c.rate);
    for (int64_t e = 0; e < written; ++e) {
      for (int64_t d = 0; d < hd; ++d) {
        entries[static_cast<size_t>((g.slot * c.capacity + e) * hd + d)] = ToBf16(normal(rng));
      }
    }
  }
  std::vector<float> q(static_cast<size_t>(std::max<int64_t>(rows, 1) * c.heads * hd));
  for (auto& v : q) v = normal(rng);
  std::vector<float> sinks(static_cast<size_t>(c.heads));
  for (auto& v : sinks) v = normal(rng);
  // CSA picks: distinct visible entries in random order, -1 padding, and now and then an entry
  // that is not visible yet (a faulty indexer), which must be skipped.
  std::vector<int32_t> picks(static_cast<size_t>(std::max<int64_t>(rows, 1) * c.topk), -1);
  for (int64_t r = 0; r < rows && c.kind == Kind::kCsa; ++r) {
    const int64_t visible = std::min(c.capacity, (position_of_row[r] + 1) / c.rate);
    std::vector<int32_t> all(static_cast<size_t>(visible));
    for (int64_t e = 0; e < visible; ++e) all[e] = static_cast<int32_t>(e);
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t k = 0; k < std::min(visible, c.topk); ++k) picks[r * c.topk + k] = all[k];
    if (visible < c.topk && rng() % 2 == 0) {
      picks[r * c.topk + visible] = static_cast<int32_t>(visible);
    }
  }

  // Host reference in double.
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<double> want(static_cast<size_t>(rows * c.heads * hd), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = position_of_row[r];
    std::vector<const uint16_t*> keys;
    for (int64_t pos = std::max<int64_t>(0, t - c.window + 1); pos <= t; ++pos) {
      keys.push_back(
          pos >= first_position[r]
              ? &new_kv[static_cast<size_t>((first_row[r] + pos - first_position[r]) * hd)]
              : &ring[static_cast<size_t>((slot_of_row[r] * c.window + pos % c.window) * hd)]);
    }
    const int64_t visible = std::min(c.capacity, (t + 1) / c.rate);
    auto entry = [&](int64_t e) {
      return &entries[static_cast<size_t>((slot_of_row[r] * c.capacity + e) * hd)];
    };
    if (c.kind == Kind::kHca) {
      for (int64_t e = 0; e < visible; ++e) keys.push_back(entry(e));
    } else if (c.kind == Kind::kCsa) {
      for (int64_t k = 0; k < c.topk; ++k) {
        const int32_t e = picks[r * c.topk + k];
        if (e >= 0 && e < visible) keys.push_back(entry(e));
      }
    }
    for (int64_t h = 0; h < c.heads; ++h) {
      const float* qh = &q[static_cast<size_t>((r * c.heads + h) * hd)];
      std::vector<double> s(keys.size());
      double m = sinks[h];
      for (size_t j = 0; j < keys.size(); ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < hd; ++d) dot += static_cast<double>(qh[d]) * FromBf16(keys[j][d]);
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      double denom = std::exp(sinks[h] - m);
      for (double& v : s) denom += (v = std::exp(v - m));
      double* o = &want[static_cast<size_t>((r * c.heads + h) * hd)];
      for (size_t j = 0; j < keys.size(); ++j) {
        for (int64_t d = 0; d < hd; ++d) o[d] += s[j] / denom * FromBf16(keys[j][d]);
      }
    }
  }

  GuardedBuffer<float> d_q(q.size()), d_sinks(sinks.size()), d_out(q.size());
  GuardedBuffer<uint16_t> d_new(new_kv.size()), d_ring(ring.size()), d_entries(entries.size());
  GuardedBuffer<int32_t> d_slot(std::max<size_t>(rows, 1)), d_pos(std::max<size_t>(rows, 1)),
      d_first(std::max<size_t>(rows, 1)), d_first_row(std::max<size_t>(rows, 1)),
      d_picks(picks.size());
  d_q.Upload(q);
  d_sinks.Upload(sinks);
  d_new.Upload(new_kv);
  d_ring.Upload(ring);
  d_entries.Upload(entries);
  constexpr int64_t kPage = 2;
  const int64_t stride = (c.capacity + kPage - 1) / kPage;
  std::vector<int32_t> table(static_cast<size_t>(std::max<int64_t>(slots * stride, 1)));
  std::vector<uint16_t> pool;
  if (paged) {
    const int64_t pages = slots * stride + 1 + 3;  // null page 0 and 3 spare pages
    std::vector<int32_t> order;
    for (int64_t i = 1; i < pages; ++i) order.push_back(static_cast<int32_t>(i));
    std::shuffle(order.begin(), order.end(), rng);
    pool.assign(static_cast<size_t>(pages * kPage * hd), kBf16NaN);
    for (int64_t s = 0; s < slots; ++s) {
      for (int64_t i = 0; i < stride; ++i) {
        const int32_t page = order[static_cast<size_t>(s * stride + i)];
        table[static_cast<size_t>(s * stride + i)] = page;
        for (int64_t e = i * kPage; e < std::min(c.capacity, (i + 1) * kPage); ++e) {
          std::copy_n(&entries[static_cast<size_t>((s * c.capacity + e) * hd)], hd,
                      &pool[static_cast<size_t>((page * kPage + e - i * kPage) * hd)]);
        }
      }
    }
  }
  GuardedBuffer<uint16_t> d_pool(std::max<size_t>(pool.size(), 1));
  GuardedBuffer<int32_t> d_table(table.size());
  if (paged) {
    d_pool.Upload(pool);
    d_table.Upload(table);
  }
  d_picks.Upload(picks);
  if (rows > 0) {
    d_slot.Upload(slot_of_row);
    d_pos.Upload(position_of_row);
    d_first.Upload(first_position);
    d_first_row.Upload(first_row);
  }
  d_out.Upload(std::vector<float>(q.size(), -7.0f));
  SinkAttentionParams p;
  p.q = d_q.get();
  p.rows = rows;
  p.heads = c.heads;
  p.head_dim = hd;
  p.slot_of_row = d_slot.get();
  p.position_of_row = d_pos.get();
  p.first_position = d_first.get();
  p.first_row = d_first_row.get();
  p.new_kv = reinterpret_cast<const __nv_bfloat16*>(d_new.get());
  p.window_ring = reinterpret_cast<const __nv_bfloat16*>(d_ring.get());
  p.window = c.window;
  if (c.kind != Kind::kSliding) {
    p.entries = reinterpret_cast<const __nv_bfloat16*>(paged ? d_pool.get() : d_entries.get());
    p.entry_capacity = c.capacity;
    if (paged) p.entry_pages = {d_table.get(), stride, kPage};
    p.rate = c.rate;
    p.indices = c.kind == Kind::kCsa ? d_picks.get() : nullptr;
    p.compressed_slots = c.kind == Kind::kCsa ? c.topk : c.capacity;
  }
  p.sinks = d_sinks.get();
  p.softmax_scale = static_cast<float>(scale);
  ASSERT_EQ(sink_attention(p, d_out.get(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = d_out.Download();
  std::vector<double> got_rows(want.size());
  for (size_t i = 0; i < want.size(); ++i) got_rows[i] = got[i];
  const auto report = testing::NormalizedError(got_rows, want);
  EXPECT_EQ(report.mismatched, 0);
  EXPECT_LE(report.normalized, 1e-5);
  for (size_t i = want.size(); i < got.size(); ++i) ASSERT_EQ(got[i], -7.0f) << "past rows " << i;
  EXPECT_TRUE(d_out.GuardsIntact());
}

TEST(CudaSinkAttentionTest, MatchesHostReferenceOnMixedSegments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = testing::FreshRng();
  const std::vector<Segment> mixed = {{0, 0, 9}, {2, 13, 1}, {1, 30, 5}, {3, 3, 0}};
  for (Kind kind : {Kind::kSliding, Kind::kHca, Kind::kCsa}) {
    for (int64_t heads : {1, 3, 64}) {
      for (int64_t hd : {24, 64, 130}) {
        RunCase({kind, heads, hd, 8, 4, 16, 3, mixed}, rng);
      }
    }
  }
  // Window 1 (only the token itself), prefill longer than the window, rate 1, and a capacity
  // smaller than the visible entries (entries past it are never read).
  RunCase({Kind::kHca, 2, 32, 1, 1, 5, 0, {{0, 0, 12}, {1, 7, 3}}}, rng);
  RunCase({Kind::kCsa, 4, 72, 5, 2, 6, 8, {{0, 0, 21}, {2, 40, 2}}}, rng);
  RunCase({Kind::kSliding, 5, 512, 128, 4, 1, 0, {{1, 200, 3}, {0, 0, 130}}}, rng);
}

// The same cases through page tables: every entry read must come from the slot's own pages.
TEST(CudaSinkAttentionTest, PagedEntriesMatchHostReference) {
  PDSERVE_SKIP_WITHOUT_GPU();
  auto rng = testing::FreshRng();
  const std::vector<Segment> mixed = {{0, 0, 9}, {2, 13, 1}, {1, 30, 5}, {3, 3, 0}};
  for (Kind kind : {Kind::kHca, Kind::kCsa}) {
    for (int64_t hd : {24, 130}) RunCase({kind, 3, hd, 8, 4, 16, 3, mixed}, rng, true);
  }
  RunCase({Kind::kHca, 2, 32, 1, 1, 5, 0, {{0, 0, 12}, {1, 7, 3}}}, rng, true);
  RunCase({Kind::kCsa, 4, 72, 5, 2, 6, 8, {{0, 0, 21}, {2, 40, 2}}}, rng, true);
}

TEST(CudaSinkAttentionTest, ZeroRowsAndBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  SinkAttentionParams p;
  p.heads = 2;
  p.head_dim = 16;
  p.window = 4;
  EXPECT_EQ(sink_attention(p, nullptr, nullptr), cudaSuccess);  // rows == 0: nothing to do
  p.rows = 1;
  EXPECT_EQ(sink_attention(p, nullptr, nullptr), cudaErrorInvalidValue);  // missing pointers
  p.rows = 0;
  p.head_dim = 2048;
  EXPECT_EQ(sink_attention(p, nullptr, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
