// GpuModel::ExportLayerAsync + StateStaging (engine/gpu/state_staging.h): a slot exported layer by
// layer through pinned buffers equals GpuModel::ExportState bit for bit, whatever the number of
// buffers, at positions before and past the window and across compressor windows; the copies see
// the slot as it was when they were enqueued; and the refusals. ImportState through a staging
// equals the plain ImportState. Same models as gpu_model_test.cc;
// skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/gpu/gpu_model.h"
#include "engine/gpu/state_staging.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/state_compare.h"

namespace pdserve::engine::gpu {
namespace {

class GpuStateStagingTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    LoadByName(GetParam(), &model_);
  }

  // Prefills `slot` with the first `n` tokens of the longest prompt (repeated to length), in
  // chunks of 13.
  void Prefill(GpuModel& gpu, int64_t slot, int64_t n) { PrefillSlot(model_, gpu, slot, n); }

  // Every layer of `slot` through `staging` as the prefill engine pipelines it: `buffers`
  // layers enqueued ahead, each taken layer's buffer refilled with the layer `buffers` on.
  std::vector<LayerState> ExportPipelined(GpuModel& gpu, int64_t slot, StateStaging& staging) {
    const int64_t layers = model_.config.num_hidden_layers;
    const int64_t ahead = staging.buffers();
    std::vector<LayerState> out;
    for (int64_t l = 0; l < std::min(ahead, layers); ++l) {
      EXPECT_TRUE(gpu.ExportLayerAsync(slot, l, &staging).ok());
    }
    for (int64_t l = 0; l < layers; ++l) {
      EXPECT_TRUE(staging.Holds(l));
      auto layer = staging.TakeLayer(l);
      EXPECT_TRUE(layer.ok()) << layer.status();
      if (!layer.ok()) return out;
      EXPECT_FALSE(staging.Holds(l));
      if (l + ahead < layers) {
        EXPECT_TRUE(gpu.ExportLayerAsync(slot, l + ahead, &staging).ok());
      }
      out.push_back(std::move(*layer));
    }
    return out;
  }

  TestModel model_;
};

// Positions 0, 1, 5, and around the model's window and compressor windows up to 300, in two
// slots: every layer through 1, 2 and all-layer buffers equals ExportState's layer bit for bit.
TEST_P(GpuStateStagingTest, LayerExportEqualsExportStateBitForBit) {
  auto gpu = MakeGpu(model_, 2, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t layers = model_.config.num_hidden_layers;
  const int64_t w = model_.config.sliding_window;
  std::vector<int64_t> positions = {0, 1, 5, w - 1, w, w + 1, 2 * w + 3, 129, 300};
  std::erase_if(positions, [&](int64_t p) { return p < 0 || p > gpu->max_context(); });
  std::vector<std::unique_ptr<StateStaging>> stagings;
  for (int64_t buffers : {int64_t{1}, std::min<int64_t>(2, layers), layers}) {
    auto staging = gpu->NewStateStaging(buffers);
    ASSERT_TRUE(staging.ok()) << staging.status();
    EXPECT_EQ((*staging)->buffers(), buffers);
    EXPECT_EQ((*staging)->pinned_bytes(), static_cast<size_t>(buffers) * gpu->StagingLayerBytes());
    stagings.push_back(std::move(*staging));
  }
  int64_t compared = 0;
  for (int64_t p : positions) {
    Prefill(*gpu, p % 2, p);
    auto want = gpu->ExportState(p % 2);
    ASSERT_TRUE(want.ok()) << want.status();
    for (auto& staging : stagings) {
      const size_t copied_before = staging->copied_bytes();
      const std::vector<LayerState> got = ExportPipelined(*gpu, p % 2, *staging);
      ASSERT_EQ(static_cast<int64_t>(got.size()), layers);
      for (int64_t l = 0; l < layers; ++l) {
        EXPECT_EQ(
            FirstDifference(got[static_cast<size_t>(l)], want->layers[static_cast<size_t>(l)]), "")
            << "position " << p << ", layer " << l << ", " << staging->buffers() << " buffers";
        ++compared;
      }
      // At least every layer's window ring came over (bf16 [W, hd]).
      EXPECT_GE(staging->copied_bytes() - copied_before,
                static_cast<size_t>(layers * w * model_.config.head_dim * 2));
    }
  }
  EXPECT_EQ(compared, static_cast<int64_t>(positions.size()) * 3 * layers);
}

// The copies are ordered before later work on the model's stream: a token run on the slot after
// the export was enqueued (and before any layer is taken) does not reach the taken layers.
TEST_P(GpuStateStagingTest, CopiesSeeTheSlotAsEnqueued) {
  auto gpu = MakeGpu(model_, 1, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t layers = model_.config.num_hidden_layers;
  // Past the bundled model's window (64); the fixture models have fewer positions.
  const int64_t n = std::min<int64_t>(70, gpu->max_context() - 1);
  Prefill(*gpu, 0, n);
  auto want = gpu->ExportState(0);
  ASSERT_TRUE(want.ok()) << want.status();
  auto staging = gpu->NewStateStaging(layers);
  ASSERT_TRUE(staging.ok()) << staging.status();
  for (int64_t l = 0; l < layers; ++l)
    ASSERT_TRUE(gpu->ExportLayerAsync(0, l, staging->get()).ok());
  ASSERT_TRUE(gpu->Forward(0, {model_.prompts.back()[0]}).ok());
  for (int64_t l = 0; l < layers; ++l) {
    auto layer = (*staging)->TakeLayer(l);
    ASSERT_TRUE(layer.ok()) << layer.status();
    EXPECT_EQ(FirstDifference(*layer, want->layers[static_cast<size_t>(l)]), "") << "layer " << l;
  }
  auto later = gpu->ExportState(0);
  ASSERT_TRUE(later.ok());
  EXPECT_EQ(later->position, n + 1);
  EXPECT_FALSE(SameState(*want, *later));
}

TEST_P(GpuStateStagingTest, RefusalsAndDiscard) {
  auto gpu = MakeGpu(model_, 2, 64);
  auto other = MakeGpu(model_, 1, 64);
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(other, nullptr);
  const int64_t layers = model_.config.num_hidden_layers;
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->NewStateStaging(0).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->NewStateStaging(layers + 1).status()));
  auto staging = gpu->NewStateStaging(1);
  ASSERT_TRUE(staging.ok()) << staging.status();
  auto foreign = other->NewStateStaging(1);
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  StateStaging& s = **staging;
  Prefill(*gpu, 0, 9);
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportLayerAsync(2, 0, &s)));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportLayerAsync(-1, 0, &s)));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportLayerAsync(0, layers, &s)));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportLayerAsync(0, -1, &s)));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportLayerAsync(0, 0, foreign->get())));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ExportLayerAsync(0, 0, nullptr)));
  EXPECT_TRUE(absl::IsFailedPrecondition(s.TakeLayer(0).status()));  // nothing enqueued
  ASSERT_TRUE(gpu->ExportLayerAsync(0, 0, &s).ok());
  if (layers > 1) {
    // One buffer: layer 1 needs the buffer layer 0 still holds.
    EXPECT_TRUE(absl::IsFailedPrecondition(gpu->ExportLayerAsync(0, 1, &s)));
    EXPECT_TRUE(absl::IsFailedPrecondition(s.TakeLayer(1).status()));
  }
  EXPECT_TRUE(s.Holds(0));
  ASSERT_TRUE(s.Discard().ok());
  EXPECT_FALSE(s.Holds(0));
  EXPECT_TRUE(absl::IsFailedPrecondition(s.TakeLayer(0).status()));
  // After a discard the buffer serves any layer again.
  const int64_t last = layers - 1;
  ASSERT_TRUE(gpu->ExportLayerAsync(0, last, &s).ok());
  auto layer = s.TakeLayer(last);
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto want = gpu->ExportState(0);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(FirstDifference(*layer, want->layers[static_cast<size_t>(last)]), "");
}

// ImportState through a staging (1, 2 and all-layer buffers, one staging reused for every
// import) makes the slot what the plain ImportState makes it: the same exported state bit for
// bit and the same next-token logits bit for bit (a row left stale instead of NaN, or a block
// of the wrong layer, would show there), at positions before and past the window.
TEST_P(GpuStateStagingTest, StagedImportEqualsImportStateBitForBit) {
  auto gpu = MakeGpu(model_, 3, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t layers = model_.config.num_hidden_layers;
  const int64_t w = model_.config.sliding_window;
  std::vector<int64_t> positions = {0, 1, w - 1, w + 1, 129, 300};
  std::erase_if(positions, [&](int64_t p) { return p < 0 || p >= gpu->max_context(); });
  std::vector<std::unique_ptr<StateStaging>> stagings;
  for (int64_t buffers : {int64_t{1}, std::min<int64_t>(2, layers), layers}) {
    auto staging = gpu->NewStateStaging(buffers);
    ASSERT_TRUE(staging.ok()) << staging.status();
    stagings.push_back(std::move(*staging));
  }
  const int32_t next = model_.prompts.front()[0];
  for (int64_t p : positions) {
    Prefill(*gpu, 0, p);
    auto state = gpu->ExportState(0);
    ASSERT_TRUE(state.ok()) << state.status();
    Prefill(*gpu, 1, 7);  // other contents first: the import must replace every block
    ASSERT_TRUE(gpu->ImportState(1, *state).ok());
    auto want_state = gpu->ExportState(1);
    ASSERT_TRUE(want_state.ok());
    auto want = gpu->Forward(1, {next});
    ASSERT_TRUE(want.ok()) << want.status();
    for (auto& staging : stagings) {
      Prefill(*gpu, 2, 11);
      const size_t copied_before = staging->copied_bytes();
      ASSERT_TRUE(gpu->ImportState(2, *state, staging.get()).ok());
      EXPECT_EQ(gpu->Position(2), p);
      EXPECT_GE(staging->copied_bytes() - copied_before,
                static_cast<size_t>(layers * w * model_.config.head_dim * 2));
      auto got_state = gpu->ExportState(2);
      ASSERT_TRUE(got_state.ok());
      EXPECT_TRUE(SameState(*got_state, *want_state))
          << "position " << p << ", " << staging->buffers() << " buffers";
      auto got = gpu->Forward(2, {next});
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->data.size(), want->data.size());
      EXPECT_EQ(std::memcmp(got->ptr(), want->ptr(), want->data.size() * sizeof(float)), 0)
          << "position " << p << ", " << staging->buffers() << " buffers";
    }
  }
}

// A staged import refuses a foreign staging, a staging still holding an exported layer and a
// state of the wrong shape, each leaving the slot as it was.
TEST_P(GpuStateStagingTest, StagedImportRefusals) {
  auto gpu = MakeGpu(model_, 2, 64);
  auto other = MakeGpu(model_, 1, 64);
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(other, nullptr);
  auto staging = gpu->NewStateStaging(1);
  auto foreign = other->NewStateStaging(1);
  ASSERT_TRUE(staging.ok() && foreign.ok());
  Prefill(*gpu, 0, 9);
  auto state = gpu->ExportState(0);
  ASSERT_TRUE(state.ok());
  Prefill(*gpu, 1, 5);
  auto before = gpu->ExportState(1);
  ASSERT_TRUE(before.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(1, *state, foreign->get())));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(1, *state, nullptr)));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(2, *state, staging->get())));
  engine::ModelState wrong = *state;
  wrong.layers.pop_back();
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->ImportState(1, wrong, staging->get())));
  ASSERT_TRUE(gpu->ExportLayerAsync(0, 0, staging->get()).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(gpu->ImportState(1, *state, staging->get())));
  auto after = gpu->ExportState(1);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(gpu->Position(1), 5);
  EXPECT_TRUE(SameState(*before, *after));
  // Once the exported layer is taken the staging imports again.
  ASSERT_TRUE((*staging)->TakeLayer(0).ok());
  ASSERT_TRUE(gpu->ImportState(1, *state, staging->get()).ok());
  EXPECT_EQ(gpu->Position(1), 9);
}

INSTANTIATE_TEST_SUITE_P(Models, GpuStateStagingTest, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

}  // namespace
}  // namespace pdserve::engine::gpu
