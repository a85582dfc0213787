// The PD decode's direct import (GpuModel::ImportLayers filled by runtime::PagedState::
// LoadLayerRing, straight from state pages into pinned buffers, no CPU-layout state) makes a slot
// what the old path made it (PagedState::Load into a ModelState, then ImportState through a
// staging): the same exported state and the same next-token logits bit for bit, from bf16 pages
// (a CUDA prefill's) and fp32 pages (a CPU prefill's), at positions before and past the window;
// a fill that fails stops the import and leaves the slot reset. Same models as
// gpu_model_test.cc; skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/gpu/gpu_model.h"
#include "engine/gpu/state_staging.h"
#include "runtime/paged_state.h"
#include "serving/page_pool.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/state_compare.h"

namespace pdserve::engine::gpu {
namespace {

class GpuDirectImportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    LoadByName(GetParam(), &model_);
  }

  void Prefill(GpuModel& gpu, int64_t slot, int64_t n) { PrefillSlot(model_, gpu, slot, n); }

  TestModel model_;
};

TEST_P(GpuDirectImportTest, DirectImportEqualsLoadThenImportStateBitForBit) {
  auto gpu = MakeGpu(model_, 3, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t w = model_.config.sliding_window;
  const int64_t total = gpu->max_context();
  std::vector<int64_t> positions = {0, 1, w - 1, w + 1, 129, 300};
  std::erase_if(positions, [&](int64_t p) { return p < 0 || p >= total; });
  auto staging = gpu->NewStateStaging(std::min<int64_t>(2, model_.config.num_hidden_layers));
  ASSERT_TRUE(staging.ok()) << staging.status();
  const int32_t next = model_.prompts.front()[0];
  for (serving::ElementType element :
       {serving::ElementType::kBfloat16, serving::ElementType::kFloat32}) {
    SCOPED_TRACE(serving::ElementTypeName(element));
    auto layout = runtime::LayoutForModel(model_.config, 64, element);
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto pool = serving::PagePool::Create(layout->PoolOptions(1, total));
    ASSERT_TRUE(pool.ok()) << pool.status();
    auto table = (*pool)->Allocate(1, layout->Demand(total));
    ASSERT_TRUE(table.ok()) << table.status();
    auto pages = runtime::MapPages(**pool, *table);
    ASSERT_TRUE(pages.ok()) << pages.status();
    const runtime::PagedState paged(model_.config, *layout, total);
    for (int64_t p : positions) {
      SCOPED_TRACE(p);
      Prefill(*gpu, 0, p);
      auto exported = gpu->ExportState(0);
      ASSERT_TRUE(exported.ok()) << exported.status();
      ASSERT_TRUE(paged.Store(*exported, 0, *pages).ok());
      // The old path into slot 1.
      Prefill(*gpu, 1, 7);
      ModelState loaded = gpu->NewState();
      ASSERT_TRUE(paged.Load(p, *pages, &loaded).ok());
      ASSERT_TRUE(gpu->ImportState(1, loaded, staging->get()).ok());
      auto want_state = gpu->ExportState(1);
      ASSERT_TRUE(want_state.ok());
      auto want = gpu->Forward(1, {next});
      ASSERT_TRUE(want.ok()) << want.status();
      // The direct path into slot 2, which held other contents first.
      Prefill(*gpu, 2, 11);
      ASSERT_TRUE(gpu->ImportLayers(2, p, staging->get(),
                                    [&](int64_t layer, const RingLayerGeometry& g,
                                        const MutableRingLayerBlocks& blocks) {
                                      return paged.LoadLayerRing(layer, g, p, *pages, blocks);
                                    })
                      .ok());
      EXPECT_EQ(gpu->Position(2), p);
      auto got_state = gpu->ExportState(2);
      ASSERT_TRUE(got_state.ok());
      EXPECT_TRUE(SameState(*got_state, *want_state));
      auto got = gpu->Forward(2, {next});
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->data.size(), want->data.size());
      EXPECT_EQ(std::memcmp(got->ptr(), want->ptr(), want->data.size() * sizeof(float)), 0);
    }
  }
}

// A fill that fails mid-way (a page the sequence lacks, a state that must not be used) stops the
// import with its error; the slot is reset, not left half-written.
TEST_P(GpuDirectImportTest, AFailedFillResetsTheSlot) {
  auto gpu = MakeGpu(model_, 2, 64);
  ASSERT_NE(gpu, nullptr);
  auto staging = gpu->NewStateStaging(1);
  ASSERT_TRUE(staging.ok()) << staging.status();
  Prefill(*gpu, 1, 9);
  const int64_t layers = model_.config.num_hidden_layers;
  std::vector<int64_t> filled;
  const absl::Status status = gpu->ImportLayers(
      1, 9, staging->get(),
      [&](int64_t layer, const RingLayerGeometry&, const MutableRingLayerBlocks&) {
        filled.push_back(layer);
        return layer == layers - 1 ? absl::DataLossError("injected") : absl::OkStatus();
      });
  EXPECT_TRUE(absl::IsDataLoss(status)) << status;
  EXPECT_EQ(static_cast<int64_t>(filled.size()), layers);
  EXPECT_EQ(gpu->Position(1), 0);
  // The staging is free again: the next import goes through.
  EXPECT_TRUE(gpu->ImportLayers(1, 0, staging->get(),
                                [](int64_t, const RingLayerGeometry&,
                                   const MutableRingLayerBlocks&) { return absl::OkStatus(); })
                  .ok());
  EXPECT_TRUE(absl::IsInvalidArgument(
      gpu->ImportLayers(1, gpu->max_context() + 1, staging->get(),
                        [](int64_t, const RingLayerGeometry&, const MutableRingLayerBlocks&) {
                          return absl::OkStatus();
                        })));
}

INSTANTIATE_TEST_SUITE_P(Models, GpuDirectImportTest, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

}  // namespace
}  // namespace pdserve::engine::gpu
