// kernels/cuda/compressor against the CPU path: a host replica of engine/compressor.cc's
// Extend / EmitEntry bookkeeping (below, ReferenceCompressor) over kernels/cpu GatedPool, RmsNorm
// and ApplyInterleavedRope with engine/rope_table.cc's angle rule. Every call checks the whole ring
// pool and entry pool: emitted entries by normalized error against the bf16-rounded reference,
// everything else bit-exactly unchanged (NaN included), plus the guards.
#include "kernels/cuda/compressor.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/gated_pool.h"
#include "kernels/cpu/rms_norm.h"
#include "kernels/cpu/rope.h"
#include "tests/kernels_cuda/cuda_test_util.h"

namespace pdserve::kernels::cuda {
namespace {

using testing::GuardedBuffer;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kEps = 1e-6f;

struct Config {
  bool overlapping;
  int64_t rate;
  int64_t dim;
  int64_t rope_dim;
  int64_t slots = 8;
  int64_t entry_capacity = 64;
  int64_t width() const { return overlapping ? 2 * dim : dim; }
  // kv / gate rows a call may use, gap rows included.
  int64_t max_rows() const { return std::max<int64_t>(1024, 10 * rate + 64); }
};

std::string Describe(const Config& c) {
  return std::string(c.overlapping ? "overlapping" : "HCA") + " rate " + std::to_string(c.rate) +
         " dim " + std::to_string(c.dim) + " rope_dim " + std::to_string(c.rope_dim) +
         " capacity " + std::to_string(c.entry_capacity);
}

struct Weights {
  std::vector<float> position_bias;  // [rate, width]
  std::vector<float> norm_weight;    // [dim]
  std::vector<float> inv_freq;       // [rope_dim / 2]
  float attention_scaling = 1.0f;
};

// engine/compressor.cc for one request: raw rows in, entries (fp32, before the bf16 store) out.
class ReferenceCompressor {
 public:
  ReferenceCompressor(const Config& c, const Weights* weights) : c_(c), weights_(weights) {}

  int64_t position() const { return position_; }

  // Appends n rows of width floats; returns the emitted entries as (w, values).
  std::vector<std::pair<int64_t, std::vector<float>>> Extend(const float* kv, const float* gate,
                                                             int64_t n) {
    const int64_t width = c_.width();
    buffer_kv_.insert(buffer_kv_.end(), kv, kv + n * width);
    buffer_gate_.insert(buffer_gate_.end(), gate, gate + n * width);
    position_ += n;
    std::vector<std::pair<int64_t, std::vector<float>>> emitted;
    int64_t consumed = 0;
    while (static_cast<int64_t>(buffer_kv_.size()) / width - consumed >= c_.rate) {
      const int64_t w = entries_;  // EmitEntry advances entries_
      emitted.emplace_back(w, EmitEntry(buffer_kv_.data() + consumed * width,
                                        buffer_gate_.data() + consumed * width));
      consumed += c_.rate;
    }
    buffer_kv_.erase(buffer_kv_.begin(), buffer_kv_.begin() + consumed * width);
    buffer_gate_.erase(buffer_gate_.begin(), buffer_gate_.begin() + consumed * width);
    return emitted;
  }

 private:
  // EmitEntry's slot order: the previous window's Ca rows, then this window's (Cb) rows.
  std::vector<float> EmitEntry(const float* kv, const float* gate) {
    const int64_t m = c_.rate;
    const int64_t dim = c_.dim;
    const int64_t width = c_.width();
    const int64_t own_offset = c_.overlapping ? dim : 0;
    const bool has_overlap = c_.overlapping && !overlap_kv_.empty();
    const float* bias = weights_->position_bias.data();
    std::vector<float> biased((has_overlap ? 2 : 1) * m * dim);
    std::vector<const float*> kv_rows;
    std::vector<const float*> gate_rows;
    auto add_slot = [&](const float* kv_row, const float* gate_row, const float* bias_row) {
      float* g = biased.data() + kv_rows.size() * dim;
      for (int64_t i = 0; i < dim; ++i) g[i] = gate_row[i] + bias_row[i];
      kv_rows.push_back(kv_row);
      gate_rows.push_back(g);
    };
    for (int64_t r = 0; has_overlap && r < m; ++r) {
      add_slot(overlap_kv_.data() + r * dim, overlap_gate_.data() + r * dim, bias + r * width);
    }
    for (int64_t r = 0; r < m; ++r) {
      add_slot(kv + r * width + own_offset, gate + r * width + own_offset,
               bias + r * width + own_offset);
    }
    std::vector<float> entry(static_cast<size_t>(dim));
    cpu::GatedPool(kv_rows.data(), gate_rows.data(), static_cast<int64_t>(kv_rows.size()), dim,
                   entry.data());
    cpu::RmsNorm(entry.data(), weights_->norm_weight.data(), 1, dim, kEps, entry.data());
    // engine/rope_table.cc: fp32 angle, fp64 cos / sin rounded to fp32, times the scaling.
    const size_t half = weights_->inv_freq.size();
    std::vector<float> cos(half);
    std::vector<float> sin(half);
    for (size_t i = 0; i < half; ++i) {
      const double angle = weights_->inv_freq[i] * static_cast<float>(entries_ * m);
      cos[i] = static_cast<float>(std::cos(angle)) * weights_->attention_scaling;
      sin[i] = static_cast<float>(std::sin(angle)) * weights_->attention_scaling;
    }
    cpu::ApplyInterleavedRope(entry.data(), 1, dim, 1, dim, c_.rope_dim, cos.data(), sin.data(),
                              /*inverse=*/false);
    ++entries_;
    if (c_.overlapping) {
      overlap_kv_.assign(static_cast<size_t>(m * dim), 0.0f);
      overlap_gate_.assign(overlap_kv_.size(), 0.0f);
      for (int64_t r = 0; r < m; ++r) {
        std::copy_n(kv + r * width, dim, overlap_kv_.data() + r * dim);
        std::copy_n(gate + r * width, dim, overlap_gate_.data() + r * dim);
      }
    }
    return entry;
  }

  Config c_;
  const Weights* weights_;
  int64_t position_ = 0;
  int64_t entries_ = 0;
  std::vector<float> buffer_kv_;
  std::vector<float> buffer_gate_;
  std::vector<float> overlap_kv_;
  std::vector<float> overlap_gate_;
};

bool SameBits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

// One segment of a call: the request in state slot `slot` gets n new rows.
struct SegmentCall {
  int32_t slot;
  int32_t n;
};

// The device pools of `slots` requests plus their host mirrors and CPU references. Call() runs one
// compressor_update and checks every pool byte against what the reference says it must hold.
class Harness {
 public:
  // paged: the entries go through a page table (kernels/cuda/paged_entries.cuh) of kPage-entry
  // pages shuffled over a pool with a null page 0 and spare pages; the checks map the pool back
  // to the slot layout and require every page no slot names to stay NaN.
  static constexpr int64_t kPage = 2;
  // source_stride > 0: the new kv / gate rows are that far apart on the device (the gap columns
  // NaN), as slices of the GPU engine's fused projection output (CompressorParams::source_stride).
  Harness(const Config& c, std::mt19937_64* rng, bool paged = false, int64_t source_stride = 0)
      : c_(c),
        rng_(rng),
        paged_(paged),
        stride_((c.entry_capacity + kPage - 1) / kPage),
        pool_pages_(c.slots * stride_ + 1 + 3),
        source_stride_(source_stride),
        ring_kv_(static_cast<size_t>(c.slots * 2 * c.rate * c.width()), kNaN),
        ring_gate_(ring_kv_),
        entries_(static_cast<size_t>(c.slots * c.entry_capacity * c.dim), testing::kBf16NaN),
        d_ring_kv_(ring_kv_.size()),
        d_ring_gate_(ring_kv_.size()),
        d_entries_(paged ? static_cast<size_t>(pool_pages_ * kPage * c.dim) : entries_.size()),
        d_table_(static_cast<size_t>(std::max<int64_t>(c.slots * stride_, 1))),
        d_kv_(static_cast<size_t>(c.max_rows() * (source_stride > 0 ? source_stride : c.width()))),
        d_gate_(d_kv_.size()),
        d_bias_(static_cast<size_t>(c.rate * c.width())),
        d_norm_(static_cast<size_t>(c.dim)),
        d_inv_freq_(static_cast<size_t>(std::max<int64_t>(c.rope_dim / 2, 1))) {
    std::normal_distribution<float> normal;
    weights_.position_bias.resize(d_bias_.size());
    for (float& v : weights_.position_bias) v = 0.5f * normal(*rng_);
    weights_.norm_weight.resize(d_norm_.size());
    for (float& v : weights_.norm_weight) v = 1.0f + 0.5f * normal(*rng_);
    // YaRN-shaped frequencies: theta^(-2i/d), the slow half divided by a scaling factor.
    weights_.inv_freq.resize(static_cast<size_t>(c.rope_dim / 2));
    for (size_t i = 0; i < weights_.inv_freq.size(); ++i) {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.rope_dim);
      weights_.inv_freq[i] =
          1.0f / std::pow(10000.0f, exponent) / (2 * i >= weights_.inv_freq.size() ? 16.0f : 1.0f);
    }
    weights_.attention_scaling = std::uniform_real_distribution<float>(1.0f, 1.3f)(*rng_);
    for (int64_t s = 0; s < c.slots; ++s) references_.emplace_back(c, &weights_);
    d_ring_kv_.Upload(ring_kv_);
    d_ring_gate_.Upload(ring_gate_);
    if (paged_) {
      std::vector<int32_t> order;
      for (int64_t i = 1; i < pool_pages_; ++i) order.push_back(static_cast<int32_t>(i));
      std::shuffle(order.begin(), order.end(), *rng_);
      table_.assign(order.begin(), order.begin() + c.slots * stride_);
      d_table_.Upload(table_.empty() ? std::vector<int32_t>{0} : table_);
      d_entries_.Upload(std::vector<uint16_t>(d_entries_.size(), testing::kBf16NaN));
    } else {
      d_entries_.Upload(entries_);
    }
    d_bias_.Upload(weights_.position_bias);
    d_norm_.Upload(weights_.norm_weight);
    d_inv_freq_.Upload(weights_.inv_freq);
  }

  bool ok() const {
    return d_ring_kv_.ok() && d_ring_gate_.ok() && d_entries_.ok() && d_kv_.ok() && d_gate_.ok() &&
           d_bias_.ok() && d_norm_.ok() && d_inv_freq_.ok();
  }

  // Fraction of gate values set to -inf in new rows, and whether channel 0 of every gate row is
  // -inf (a channel with no weight at all pools to 0).
  void SetNegativeInfinity(double fraction, bool channel_zero) {
    neg_inf_fraction_ = fraction;
    channel_zero_neg_inf_ = channel_zero;
  }

  // Runs one call (max_tokens 0: the largest n of the call) and checks the pools. Returns the
  // number of entries written (emitted windows below the capacity). With a graph, the first call
  // captures it and later calls replay it after refreshing the device inputs; every call must
  // then have the same segment count and max_tokens.
  int64_t Call(const std::vector<SegmentCall>& segments, int64_t max_tokens = 0,
               bool graph = false) {
    const int64_t width = c_.width();
    const int64_t m = c_.rate;
    const bool derive_max_tokens = max_tokens == 0;
    int64_t rows = 1;
    for (const SegmentCall& s : segments) {
      if (derive_max_tokens) max_tokens = std::max<int64_t>(max_tokens, s.n);
      rows += 1 + s.n;
    }
    if (rows > c_.max_rows()) {
      ADD_FAILURE() << "call needs " << rows << " rows";
      return -1;
    }
    // Rows: a NaN gap row before each segment's rows, NaN after the last.
    std::vector<float> kv(static_cast<size_t>(c_.max_rows() * width), kNaN);
    std::vector<float> gate(kv.size(), kNaN);
    std::vector<int32_t> p0;
    std::vector<int32_t> n;
    std::vector<int32_t> row_offset;
    std::vector<int32_t> slot;
    std::normal_distribution<float> normal;
    std::bernoulli_distribution neg_inf(neg_inf_fraction_);
    int64_t row = 0;
    for (const SegmentCall& s : segments) {
      row += 1;
      p0.push_back(static_cast<int32_t>(references_[s.slot].position()));
      n.push_back(s.n);
      row_offset.push_back(static_cast<int32_t>(row));
      slot.push_back(s.slot);
      for (int64_t i = row * width; i < (row + s.n) * width; ++i) {
        kv[i] = normal(*rng_);
        const bool no_weight = neg_inf(*rng_) || (channel_zero_neg_inf_ && i % c_.dim == 0);
        gate[i] = no_weight ? -std::numeric_limits<float>::infinity() : 1.5f * normal(*rng_);
      }
      row += s.n;
      // Ring rows of positions no emission of this call (or any later one) may read: NaN.
      const int64_t needed = std::max<int64_t>(0, (p0.back() / m - (c_.overlapping ? 1 : 0)) * m);
      for (int64_t q = std::max<int64_t>(0, p0.back() - 2 * m); q < needed; ++q) {
        const int64_t at = (s.slot * 2 * m + q % (2 * m)) * width;
        std::fill_n(ring_kv_.begin() + at, width, kNaN);
        std::fill_n(ring_gate_.begin() + at, width, kNaN);
      }
    }
    if (!graph || exec_ == nullptr) AllocateSegments(segments.size());
    d_kv_.Upload(Spread(kv));
    d_gate_.Upload(Spread(gate));
    d_p0_->Upload(p0);
    d_n_->Upload(n);
    d_row_offset_->Upload(row_offset);
    d_slot_->Upload(slot);
    d_ring_kv_.Upload(ring_kv_);
    d_ring_gate_.Upload(ring_gate_);

    const CompressorParams params = Params(static_cast<int64_t>(segments.size()), max_tokens);
    if (graph) {
      Replay(params);
    } else {
      EXPECT_EQ(compressor_update(params, nullptr), cudaSuccess);
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got_ring_kv = d_ring_kv_.Download();
    const std::vector<float> got_ring_gate = d_ring_gate_.Download();
    const std::vector<uint16_t> got_entries = SlotEntries(d_entries_.Download());
    EXPECT_TRUE(d_ring_kv_.GuardsIntact() && d_ring_gate_.GuardsIntact() &&
                d_entries_.GuardsIntact() && d_kv_.GuardsIntact() && d_gate_.GuardsIntact());

    // The references run only after the kernel did.
    std::vector<uint16_t> got;
    std::vector<float> want;
    std::vector<bool> emitted(entries_.size(), false);
    for (size_t b = 0; b < segments.size(); ++b) {
      const SegmentCall& s = segments[b];
      const float* rows_kv = kv.data() + row_offset[b] * width;
      const float* rows_gate = gate.data() + row_offset[b] * width;
      for (const auto& [w, entry] : references_[s.slot].Extend(rows_kv, rows_gate, s.n)) {
        if (w >= c_.entry_capacity) continue;
        const int64_t at = (s.slot * c_.entry_capacity + w) * c_.dim;
        std::fill_n(emitted.begin() + at, c_.dim, true);
        got.insert(got.end(), got_entries.begin() + at, got_entries.begin() + at + c_.dim);
        want.insert(want.end(), entry.begin(), entry.end());
      }
      for (int64_t k = std::max<int64_t>(0, s.n - 2 * m); k < s.n; ++k) {
        const int64_t at = (s.slot * 2 * m + (p0[b] + k) % (2 * m)) * width;
        std::copy_n(rows_kv + k * width, width, ring_kv_.begin() + at);
        std::copy_n(rows_gate + k * width, width, ring_gate_.begin() + at);
      }
    }
    testing::ExpectNearReference(got, want, Describe(c_) + " emitted entries");
    EXPECT_TRUE(SameBits(got_ring_kv.data(), ring_kv_.data(), ring_kv_.size() * sizeof(float)))
        << Describe(c_) << " ring kv";
    EXPECT_TRUE(
        SameBits(got_ring_gate.data(), ring_gate_.data(), ring_gate_.size() * sizeof(float)))
        << Describe(c_) << " ring gate";
    int64_t changed = 0;
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (!emitted[i]) changed += got_entries[i] != entries_[i] ? 1 : 0;
    }
    EXPECT_EQ(changed, 0) << Describe(c_) << " entries outside the emitted windows";
    entries_ = got_entries;
    return static_cast<int64_t>(got.size()) / c_.dim;
  }

  // The device pools hold exactly what the mirrors say (nothing written since the last check).
  void ExpectPoolsMatchMirrors() const {
    const std::vector<float> ring_kv = d_ring_kv_.Download();
    const std::vector<float> ring_gate = d_ring_gate_.Download();
    const std::vector<uint16_t> entries = SlotEntries(d_entries_.Download());
    EXPECT_TRUE(SameBits(ring_kv.data(), ring_kv_.data(), ring_kv_.size() * sizeof(float)));
    EXPECT_TRUE(SameBits(ring_gate.data(), ring_gate_.data(), ring_gate_.size() * sizeof(float)));
    EXPECT_EQ(entries, entries_);
  }

  CompressorParams Params(int64_t segments, int64_t max_tokens) {
    CompressorParams p;
    p.kv = d_kv_.get();
    p.gate = d_gate_.get();
    p.source_stride = source_stride_;
    p.dim = c_.dim;
    p.overlapping = c_.overlapping;
    p.rate = c_.rate;
    if (d_p0_ != nullptr) {
      p.first_position = d_p0_->get();
      p.n_tokens = d_n_->get();
      p.row_offset = d_row_offset_->get();
      p.slot = d_slot_->get();
    }
    p.segments = segments;
    p.max_tokens = max_tokens;
    p.ring_kv = d_ring_kv_.get();
    p.ring_gate = d_ring_gate_.get();
    p.entries = reinterpret_cast<__nv_bfloat16*>(d_entries_.get());
    p.entry_capacity = c_.entry_capacity;
    if (paged_) p.entry_pages = {d_table_.get(), stride_, kPage};
    p.position_bias = d_bias_.get();
    p.norm_weight = d_norm_.get();
    p.eps = kEps;
    p.inv_freq = d_inv_freq_.get();
    p.attention_scaling = weights_.attention_scaling;
    p.rope_dim = c_.rope_dim;
    return p;
  }

  ~Harness() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

 private:
  // Rows of `width` values each, source_stride_ apart (NaN between) when it is set.
  std::vector<float> Spread(const std::vector<float>& rows) const {
    const int64_t width = c_.width();
    if (source_stride_ == 0) return rows;
    std::vector<float> out(static_cast<size_t>(c_.max_rows() * source_stride_), kNaN);
    for (int64_t r = 0; r < c_.max_rows(); ++r) {
      std::copy_n(rows.begin() + r * width, width, out.begin() + r * source_stride_);
    }
    return out;
  }

  void AllocateSegments(size_t segments) {
    const size_t size = std::max<size_t>(segments, 1);
    d_p0_ = std::make_unique<GuardedBuffer<int32_t>>(size);
    d_n_ = std::make_unique<GuardedBuffer<int32_t>>(size);
    d_row_offset_ = std::make_unique<GuardedBuffer<int32_t>>(size);
    d_slot_ = std::make_unique<GuardedBuffer<int32_t>>(size);
  }

  // Captures compressor_update(params) once; every call launches the captured graph.
  void Replay(const CompressorParams& params) {
    // The uploads (pageable cudaMemcpy on the legacy stream) may still be in flight.
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (exec_ == nullptr) {
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
      ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      const cudaError_t launched = compressor_update(params, stream_);
      ASSERT_EQ(cudaStreamEndCapture(stream_, &graph_), cudaSuccess);
      ASSERT_EQ(launched, cudaSuccess);
      ASSERT_EQ(cudaGraphInstantiate(&exec_, graph_, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaGraphLaunch(exec_, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

  // The device entry pool as the slot layout [slots, entry_capacity, dim] (paged: through the
  // table; pages no slot names must still be all NaN).
  std::vector<uint16_t> SlotEntries(const std::vector<uint16_t>& device) const {
    if (!paged_) return device;
    std::vector<uint16_t> slots(entries_.size());
    std::vector<bool> named(static_cast<size_t>(pool_pages_), false);
    for (int64_t s = 0; s < c_.slots; ++s) {
      for (int64_t e = 0; e < c_.entry_capacity; ++e) {
        const int64_t page = table_[static_cast<size_t>(s * stride_ + e / kPage)];
        named[static_cast<size_t>(page)] = true;
        std::copy_n(device.begin() + (page * kPage + e % kPage) * c_.dim, c_.dim,
                    slots.begin() + (s * c_.entry_capacity + e) * c_.dim);
      }
    }
    for (int64_t page = 0; page < pool_pages_; ++page) {
      if (named[static_cast<size_t>(page)]) continue;
      for (int64_t i = page * kPage * c_.dim; i < (page + 1) * kPage * c_.dim; ++i) {
        EXPECT_EQ(device[static_cast<size_t>(i)], testing::kBf16NaN) << "unnamed page " << page;
      }
    }
    return slots;
  }

  Config c_;
  std::mt19937_64* rng_;
  const bool paged_;
  const int64_t stride_;
  const int64_t pool_pages_;
  const int64_t source_stride_;
  std::vector<int32_t> table_;
  Weights weights_;
  std::vector<ReferenceCompressor> references_;
  // Host mirrors of what the device pools must hold.
  std::vector<float> ring_kv_;
  std::vector<float> ring_gate_;
  std::vector<uint16_t> entries_;
  double neg_inf_fraction_ = 0.0;
  bool channel_zero_neg_inf_ = false;
  GuardedBuffer<float> d_ring_kv_;
  GuardedBuffer<float> d_ring_gate_;
  GuardedBuffer<uint16_t> d_entries_;
  GuardedBuffer<int32_t> d_table_;
  GuardedBuffer<float> d_kv_;
  GuardedBuffer<float> d_gate_;
  GuardedBuffer<float> d_bias_;
  GuardedBuffer<float> d_norm_;
  GuardedBuffer<float> d_inv_freq_;
  std::unique_ptr<GuardedBuffer<int32_t>> d_p0_;
  std::unique_ptr<GuardedBuffer<int32_t>> d_n_;
  std::unique_ptr<GuardedBuffer<int32_t>> d_row_offset_;
  std::unique_ptr<GuardedBuffer<int32_t>> d_slot_;
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Overlapping (CSA, indexer) and HCA; rate 4 and 32 (ring of 64 rows wraps many times); dims that
// are not multiples of 16 (25: an odd nope part) and rope_dim 8 / 16 / 64.
const std::vector<Config>& SmallConfigs() {
  static const std::vector<Config> configs = {
      {true, 4, 72, 16},   {false, 4, 24, 8}, {true, 32, 24, 8},
      {false, 32, 72, 64}, {true, 4, 25, 16}, {false, 4, 25, 0},
  };
  return configs;
}

class CudaCompressorTest : public ::testing::Test {
 protected:
  std::mt19937_64 rng_ = testing::FreshRng();
};

TEST_F(CudaCompressorTest, PrefillThenDecodeMatchesCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::vector<Config> configs = SmallConfigs();
  configs.push_back({true, 4, 512, 64});     // V4 CSA compressor
  configs.push_back({true, 4, 128, 64});     // V4 indexer compressor
  configs.push_back({false, 128, 512, 64});  // V4 HCA compressor
  for (const Config& c : configs) {
    SCOPED_TRACE(Describe(c));
    Harness h(c, &rng_);
    ASSERT_TRUE(h.ok());
    const auto m = static_cast<int32_t>(c.rate);
    // Five requests prefilled in one call, in scattered slots; n = 1, m - 1, m, m + 1, 5m + 3.
    const std::vector<SegmentCall> prefill = {
        {6, 1}, {1, m - 1}, {4, m}, {0, m + 1}, {3, 5 * m + 3}};
    EXPECT_EQ(h.Call(prefill), 0 + 0 + 1 + 1 + 5);
    // Then decode one token per request per call, past two more windows of each.
    int64_t decoded = 0;
    for (int step = 0; step < 2 * m + 1; ++step) {
      decoded += h.Call({{6, 1}, {1, 1}, {4, 1}, {0, 1}, {3, 1}});
    }
    // A request at position p completes the windows whose last position p' ((p' + 1) % m == 0)
    // lies in [p, p + 2m + 1).
    int64_t expected = 0;
    for (const int64_t p : {1, m - 1, m, m + 1, 5 * m + 3}) {
      expected += (p + 2 * m + 1) / m - p / m;
    }
    EXPECT_EQ(decoded, expected);
  }
}

// PrefillThenDecodeMatchesCpu's calls with the new rows read at a row stride wider than the
// width (slices of a fused projection output), the columns between them NaN.
TEST_F(CudaCompressorTest, StridedSourceRowsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::vector<Config> configs = SmallConfigs();
  configs.push_back({true, 4, 128, 64});  // V4 indexer compressor
  for (const Config& c : configs) {
    SCOPED_TRACE(Describe(c));
    Harness h(c, &rng_, /*paged=*/false, /*source_stride=*/c.width() + 37);
    ASSERT_TRUE(h.ok());
    const auto m = static_cast<int32_t>(c.rate);
    EXPECT_EQ(h.Call({{6, 1}, {1, m - 1}, {4, m}, {0, m + 1}, {3, 5 * m + 3}}), 0 + 0 + 1 + 1 + 5);
    int64_t decoded = 0;
    for (int step = 0; step < 2 * m + 1; ++step) {
      decoded += h.Call({{6, 1}, {1, 1}, {4, 1}, {0, 1}, {3, 1}});
    }
    EXPECT_GT(decoded, 0);
  }
}

// PrefillThenDecodeMatchesCpu's calls with the entries paged.
TEST_F(CudaCompressorTest, PagedEntriesMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  std::vector<Config> configs = SmallConfigs();
  configs.push_back({true, 4, 128, 64});  // V4 indexer compressor
  for (const Config& c : configs) {
    SCOPED_TRACE(Describe(c));
    Harness h(c, &rng_, /*paged=*/true);
    ASSERT_TRUE(h.ok());
    const auto m = static_cast<int32_t>(c.rate);
    EXPECT_EQ(h.Call({{6, 1}, {1, m - 1}, {4, m}, {0, m + 1}, {3, 5 * m + 3}}), 0 + 0 + 1 + 1 + 5);
    for (int step = 0; step < 2 * m + 1; ++step) h.Call({{6, 1}, {1, 1}, {4, 1}, {0, 1}, {3, 1}});
    h.ExpectPoolsMatchMirrors();
  }
}

TEST_F(CudaCompressorTest, ChunkedContinuationMatchesCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  for (const Config& c : SmallConfigs()) {
    SCOPED_TRACE(Describe(c));
    Harness h(c, &rng_);
    ASSERT_TRUE(h.ok());
    h.SetNegativeInfinity(0.02, /*channel_zero=*/true);
    const auto m = static_cast<int32_t>(c.rate);
    // Windows straddle calls: chunks shorter, equal and longer than m and 2m, and empty ones.
    int64_t written = 0;
    for (const int32_t n : {3, m + 2, 0, 1, 2 * m + 1, m - 1, 2 * m, 5, 3 * m + 1, 1}) {
      written += h.Call({{2, n}}, /*max_tokens=*/n + 3);
    }
    EXPECT_GT(written, 0);
  }
}

TEST_F(CudaCompressorTest, MixedSegmentsMatchCpu) {
  PDSERVE_SKIP_WITHOUT_GPU();
  for (const Config& c : SmallConfigs()) {
    SCOPED_TRACE(Describe(c));
    Harness h(c, &rng_);
    ASSERT_TRUE(h.ok());
    std::vector<int32_t> slots(static_cast<size_t>(c.slots));
    std::iota(slots.begin(), slots.end(), 0);
    std::uniform_int_distribution<int32_t> length(0, static_cast<int32_t>(3 * c.rate));
    int64_t written = 0;
    for (int call = 0; call < 10; ++call) {
      // Five of the eight requests, in random order, with random lengths (0 included).
      std::shuffle(slots.begin(), slots.end(), rng_);
      std::vector<SegmentCall> segments;
      for (int b = 0; b < 5; ++b) segments.push_back({slots[b], length(rng_)});
      segments[call % 5].n = 0;
      written += h.Call(segments, /*max_tokens=*/3 * c.rate + 1);
    }
    EXPECT_GT(written, 0);
  }
}

TEST_F(CudaCompressorTest, EntriesPastCapacityAreNotWritten) {
  PDSERVE_SKIP_WITHOUT_GPU();
  for (const bool overlapping : {true, false}) {
    Config c{overlapping, 4, 40, 16};
    c.entry_capacity = 3;
    SCOPED_TRACE(Describe(c));
    Harness h(c, &rng_);
    ASSERT_TRUE(h.ok());
    // Slot 5 completes windows 0..4 (only 0..2 fit), slot 2 windows 0..1. Decoding 8 tokens,
    // slot 5 completes windows 5 and 6 (not written; its ring still advances), slot 2 window 2 at
    // its third step and window 3 (not written).
    EXPECT_EQ(h.Call({{5, 23}, {2, 9}}), 3 + 2);
    for (int step = 0; step < 8; ++step) EXPECT_EQ(h.Call({{5, 1}, {2, 1}}), step == 2 ? 1 : 0);
  }
}

TEST_F(CudaCompressorTest, GraphReplayReadsCurrentSegments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  for (const Config& c : {Config{true, 4, 72, 16}, Config{false, 32, 24, 8}}) {
    SCOPED_TRACE(Describe(c));
    Harness h(c, &rng_);
    ASSERT_TRUE(h.ok());
    const auto bound = static_cast<int32_t>(2 * c.rate + 3);
    // One captured launch shape (3 segments, max_tokens fixed), different slots, positions and
    // lengths at every replay.
    int64_t written = h.Call({{1, 0}, {4, bound}, {7, 5}}, bound, /*graph=*/true);
    written += h.Call({{4, 1}, {1, bound}, {7, 0}}, bound, true);
    for (int step = 0; step < static_cast<int>(c.rate) + 1; ++step) {
      written += h.Call({{7, 1}, {1, 1}, {4, 1}}, bound, true);
    }
    written += h.Call({{0, bound - 1}, {4, 2}, {7, bound}}, bound, true);
    EXPECT_GT(written, 0);
  }
}

TEST_F(CudaCompressorTest, NoWorkWritesNothing) {
  PDSERVE_SKIP_WITHOUT_GPU();
  Harness h({true, 4, 24, 8}, &rng_);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h.Call({{0, 7}, {3, 2}}), 1);
  EXPECT_EQ(h.Call({{0, 0}, {3, 0}}, /*max_tokens=*/4), 0);
  // Zero segments or max_tokens == 0: nothing is launched, so null segment arrays are fine.
  for (const auto& [segments, max_tokens] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {2, 0}}) {
    CompressorParams p = h.Params(segments, max_tokens);
    p.first_position = nullptr;
    p.n_tokens = nullptr;
    p.row_offset = nullptr;
    p.slot = nullptr;
    EXPECT_EQ(compressor_update(p, nullptr), cudaSuccess);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  h.ExpectPoolsMatchMirrors();
}

TEST_F(CudaCompressorTest, RejectsBadArguments) {
  PDSERVE_SKIP_WITHOUT_GPU();
  Harness h({true, 4, 24, 8}, &rng_);
  ASSERT_TRUE(h.ok());
  h.Call({{0, 1}});
  const CompressorParams good = h.Params(1, 4);
  EXPECT_EQ(compressor_update(good, nullptr), cudaSuccess);
  auto rejected = [&](auto mutate) {
    CompressorParams p = good;
    mutate(p);
    return compressor_update(p, nullptr) == cudaErrorInvalidValue;
  };
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.rate = 0; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.rate = kMaxCompressorRate + 1; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.dim = 0; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.dim = kMaxCompressorDim + 1; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.rope_dim = 7; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.rope_dim = 26; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.segments = -1; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.segments = kMaxCompressorSegments + 1; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.max_tokens = -1; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.entry_capacity = -1; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.source_stride = 2 * p.dim - 1; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.kv = nullptr; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.slot = nullptr; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.ring_gate = nullptr; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.entries = nullptr; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.inv_freq = nullptr; }));
  EXPECT_TRUE(rejected([](CompressorParams& p) { p.norm_weight = nullptr; }));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
