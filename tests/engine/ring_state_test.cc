// engine/ring_state.h: the CUDA engine's slot layout of a request's state against the CPU
// engine's ModelState, on the tiny config (window 6, CSA rate 4 with the indexer, HCA rate 8).
#include "engine/ring_state.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/random_weights.h"
#include "tests/engine/tiny_config.h"

namespace pdserve::engine {
namespace {

constexpr int64_t kPage = 4;

bool SameTensor(const Tensor& a, const Tensor& b) {
  return a.shape == b.shape &&
         std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0;
}

void ExpectSameState(const ModelState& a, const ModelState& b, int64_t at) {
  ASSERT_EQ(a.position, b.position);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const LayerState& x = a.layers[l];
    const LayerState& y = b.layers[l];
    EXPECT_TRUE(SameTensor(x.window_kv, y.window_kv)) << "position " << at << " layer " << l;
    for (auto [c, d] : {std::pair{&x.compressor, &y.compressor}, {&x.indexer, &y.indexer}}) {
      EXPECT_TRUE(SameTensor(c->buffer_kv, d->buffer_kv)) << at << " layer " << l;
      EXPECT_TRUE(SameTensor(c->buffer_gate, d->buffer_gate)) << at << " layer " << l;
      EXPECT_TRUE(SameTensor(c->overlap_kv, d->overlap_kv)) << at << " layer " << l;
      EXPECT_TRUE(SameTensor(c->overlap_gate, d->overlap_gate)) << at << " layer " << l;
      EXPECT_TRUE(SameTensor(c->entries, d->entries)) << at << " layer " << l;
    }
  }
}

class RingStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = Model::FromWeights(config_, RandomWeights(config_, 11));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<Model>(std::move(*model));
    std::mt19937_64 rng(5);
    tokens_.resize(45);
    for (auto& t : tokens_) t = static_cast<int32_t>(rng() % config_.vocab_size);
  }
  // The CPU state after the first `n` tokens.
  ModelState StateAfter(int64_t n) {
    ModelState state = model_->NewState();
    if (n > 0) {
      EXPECT_TRUE(
          model_->Forward(&state, std::vector<int32_t>(tokens_.begin(), tokens_.begin() + n)).ok());
    }
    state.position = n;
    return state;
  }
  // Calls f(state) with the CPU state after 0, 1, ..., tokens_.size() tokens (one token a call).
  template <typename F>
  void AtEveryPosition(F f) {
    ModelState state = model_->NewState();
    for (int64_t p = 0; p <= static_cast<int64_t>(tokens_.size()); ++p) {
      if (p > 0) {
        ASSERT_TRUE(model_->Forward(&state, {tokens_[static_cast<size_t>(p - 1)]}).ok());
      }
      state.position = p;
      f(state);
    }
  }
  ModelConfig config_ = testing::TinyConfig();
  RingGeometry geometry_ = RingGeometryFor(config_, 64, kPage);
  std::unique_ptr<Model> model_;
  std::vector<int32_t> tokens_;
};

TEST_F(RingStateTest, GeometryFollowsTheLayerTypes) {
  ASSERT_EQ(geometry_.layers.size(), 4u);
  EXPECT_FALSE(geometry_.layers[0].compressor.present());
  EXPECT_EQ(geometry_.layers[1].compressor.rate, 4);
  EXPECT_TRUE(geometry_.layers[1].compressor.overlapping);
  EXPECT_EQ(geometry_.layers[1].indexer.dim, config_.index_head_dim);
  EXPECT_EQ(geometry_.layers[1].compressor.entry_capacity, 16);  // 64 / 4, whole pages of 4
  EXPECT_EQ(geometry_.layers[2].compressor.rate, 8);
  EXPECT_FALSE(geometry_.layers[2].compressor.overlapping);
  EXPECT_FALSE(geometry_.layers[2].indexer.present());
  EXPECT_EQ(geometry_.layers[2].compressor.entry_capacity, 8);
  EXPECT_EQ(RingEntryCapacity(10, 8, 64), 64);
  EXPECT_EQ(RingEntryCapacity(4096, 4, 64), 1024);
  EXPECT_EQ(RingEntryCapacity(4097, 4, 64), 1024);
}

// At every position 0..45 (before and past the window, across many CSA and HCA windows) the CPU
// state goes to the ring layout and back unchanged, bit for bit; the rows it leaves unread hold
// NaN, so none of them reaches the rebuilt state.
TEST_F(RingStateTest, CpuStateRoundTripsAtEveryPosition) {
  AtEveryPosition([&](const ModelState& state) {
    auto image = RingImageFromState(geometry_, state, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(image.ok()) << image.status();
    EXPECT_EQ(image->position, state.position);
    auto back = StateFromRingImage(geometry_, *image);
    ASSERT_TRUE(back.ok()) << back.status();
    ExpectSameState(state, *back, state.position);
  });
}

// LayerRingImage is RingImageFromState's layer, value for value (the fill 7 marks unread
// rows); without entries its entry blocks are empty and every other block is the same.
TEST_F(RingStateTest, LayerImageIsTheImagesLayer) {
  AtEveryPosition([&](const ModelState& state) {
    auto image = RingImageFromState(geometry_, state, 7.0f);
    ASSERT_TRUE(image.ok()) << image.status();
    for (size_t l = 0; l < geometry_.layers.size(); ++l) {
      const RingLayerImage& want = image->layers[l];
      for (bool entries : {true, false}) {
        const RingLayerImage got =
            LayerRingImage(geometry_.layers[l], state.layers[l], state.position, 7.0f, entries);
        EXPECT_EQ(got.window, want.window) << state.position << " layer " << l;
        for (auto [c, d] : {std::pair{&got.compressor, &want.compressor},
                            std::pair{&got.indexer, &want.indexer}}) {
          EXPECT_EQ(c->ring_kv, d->ring_kv) << state.position << " layer " << l;
          EXPECT_EQ(c->ring_gate, d->ring_gate) << state.position << " layer " << l;
          if (entries) {
            EXPECT_EQ(c->entries, d->entries) << state.position << " layer " << l;
          } else {
            EXPECT_TRUE(c->entries.empty()) << state.position << " layer " << l;
          }
        }
      }
    }
  });
}

// The image of position 0 is the CPU engine's NewState (what GpuModel::NewState returns).
TEST_F(RingStateTest, EmptyImageIsTheCpuNewState) {
  auto empty = StateFromRingImage(geometry_, NewRingImage(geometry_));
  ASSERT_TRUE(empty.ok()) << empty.status();
  ExpectSameState(model_->NewState(), *empty, 0);
}

// Rows land where the CUDA engine's kernels read them.
TEST_F(RingStateTest, RowsSitAtTheirRingPositions) {
  const int64_t p = 30;  // window rows 25..29; CSA: 7 entries, buffer 28..29, overlap 24..27
  const ModelState state = StateAfter(p);
  auto image = RingImageFromState(geometry_, state);
  ASSERT_TRUE(image.ok()) << image.status();
  const int64_t hd = config_.head_dim;
  const LayerState& csa = state.layers[1];
  const RingLayerImage& ring = image->layers[1];
  ASSERT_EQ(csa.window_kv.dim(0), 5);
  for (int64_t r = 0; r < 5; ++r) {
    const int64_t q = 25 + r;
    EXPECT_EQ(std::memcmp(csa.window_kv.ptr() + r * hd, ring.window.data() + q % 6 * hd, hd * 4),
              0);
  }
  for (float v : std::vector<float>(ring.window.begin() + 24 % 6 * hd,
                                    ring.window.begin() + (24 % 6 + 1) * hd)) {
    EXPECT_EQ(v, 0.0f);  // position 24 is no longer read
  }
  const int64_t width = 2 * hd;
  EXPECT_EQ(std::memcmp(csa.compressor.buffer_kv.ptr() + width,
                        ring.compressor.ring_kv.data() + 29 % 8 * width, width * 4),
            0);
  EXPECT_EQ(std::memcmp(csa.compressor.overlap_gate.ptr() + 3 * hd,
                        ring.compressor.ring_gate.data() + 27 % 8 * width, hd * 4),
            0);
  EXPECT_EQ(std::memcmp(csa.indexer.entries.ptr() + 6 * config_.index_head_dim,
                        ring.indexer.entries.data() + 6 * config_.index_head_dim,
                        config_.index_head_dim * 4),
            0);
}

// A CPU state rebuilt from its image continues the sequence with the same logits bit for bit.
TEST_F(RingStateTest, RebuiltStateContinuesExactly) {
  ModelState state = StateAfter(27);
  auto image = RingImageFromState(geometry_, state);
  ASSERT_TRUE(image.ok());
  auto rebuilt = StateFromRingImage(geometry_, *image);
  ASSERT_TRUE(rebuilt.ok());
  const std::vector<int32_t> next(tokens_.begin() + 27, tokens_.end());
  auto a = model_->Forward(&state, next);
  auto b = model_->Forward(&*rebuilt, next);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(SameTensor(*a, *b));
}

// The upper 16 bits of each value: how the device's bf16 blocks of a value look in host memory.
std::vector<uint16_t> Bf16Bits(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &values[i], sizeof(bits));
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// The bf16 bits widened back, in place: the image the device's blocks stand for.
void WidenInPlace(std::vector<float>* values) {
  const std::vector<uint16_t> bits = Bf16Bits(*values);
  for (size_t i = 0; i < bits.size(); ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(&(*values)[i], &wide, sizeof(wide));
  }
}

// At every position 0..45 each layer rebuilt from bf16 blocks (as GpuModel::ExportLayerAsync
// copies them: window and entries as bf16 bits, rings fp32; the unread rows NaN) equals, bit for
// bit, that layer of StateFromRingImage over the same values widened to float.
TEST_F(RingStateTest, LayerFromBf16BlocksEqualsTheImagesLayer) {
  AtEveryPosition([&](const ModelState& state) {
    const int64_t p = state.position;
    auto image = RingImageFromState(geometry_, state, std::numeric_limits<float>::quiet_NaN());
    ASSERT_TRUE(image.ok()) << image.status();
    for (RingLayerImage& layer : image->layers) {
      WidenInPlace(&layer.window);
      WidenInPlace(&layer.compressor.entries);
      WidenInPlace(&layer.indexer.entries);
    }
    auto want = StateFromRingImage(geometry_, *image);
    ASSERT_TRUE(want.ok()) << want.status();
    for (size_t l = 0; l < geometry_.layers.size(); ++l) {
      const RingLayerImage& in = image->layers[l];
      const std::vector<uint16_t> window = Bf16Bits(in.window);
      const std::vector<uint16_t> entries = Bf16Bits(in.compressor.entries);
      const std::vector<uint16_t> keys = Bf16Bits(in.indexer.entries);
      RingLayerBlocks blocks;
      blocks.window = window.data();
      blocks.compressor = {in.compressor.ring_kv.data(), in.compressor.ring_gate.data(),
                           entries.data()};
      blocks.indexer = {in.indexer.ring_kv.data(), in.indexer.ring_gate.data(), keys.data()};
      ModelState got{p, {}};
      got.layers.assign(l, LayerState{});
      got.layers.push_back(LayerStateFromRingBlocks(geometry_.layers[l], blocks, p));
      ModelState one{p, {}};
      one.layers.assign(l, LayerState{});
      one.layers.push_back(want->layers[l]);
      ExpectSameState(one, got, p);
    }
  });
}

TEST_F(RingStateTest, MismatchedStatesAreInvalidArgument) {
  const ModelState good = StateAfter(13);
  ASSERT_TRUE(ValidateRingState(geometry_, good).ok());
  auto expect_invalid = [&](ModelState s, const std::string& what) {
    const absl::Status status = ValidateRingState(geometry_, s);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << what << ": " << status;
    EXPECT_FALSE(RingImageFromState(geometry_, s).ok()) << what;
  };
  ModelState s = good;
  s.layers.pop_back();
  expect_invalid(s, "layer count");
  s = good;
  s.position = 14;
  expect_invalid(s, "position without the rows");
  s = good;
  s.layers[0].window_kv = Tensor({5, config_.head_dim + 1});
  expect_invalid(s, "window columns");
  s = good;
  s.layers[1].compressor.overlap_kv = Tensor({0, config_.head_dim});
  expect_invalid(s, "overlap rows");
  s = good;
  s.layers[2].indexer.entries = Tensor({1, config_.index_head_dim});
  expect_invalid(s, "indexer rows on an HCA layer");
  s = good;
  s.layers[0].compressor.buffer_kv = Tensor({1, 2});
  expect_invalid(s, "compressor rows on a sliding layer");
  const RingGeometry short_context = RingGeometryFor(config_, 12, kPage);
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateRingState(short_context, good)));
}

TEST_F(RingStateTest, MismatchedImagesAreInvalidArgument) {
  auto image = RingImageFromState(geometry_, StateAfter(9));
  ASSERT_TRUE(image.ok());
  RingImage bad = *image;
  bad.layers[1].indexer.entries.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(StateFromRingImage(geometry_, bad).status()));
  bad = *image;
  bad.position = 65;
  EXPECT_TRUE(absl::IsInvalidArgument(StateFromRingImage(geometry_, bad).status()));
  bad = *image;
  bad.layers.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(StateFromRingImage(geometry_, bad).status()));
}

}  // namespace
}  // namespace pdserve::engine
