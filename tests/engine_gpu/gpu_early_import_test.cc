// The PD decode's early import on the GPU: GpuModel's staged import (BeginStagedImport, a layer
// at a time in any order with steps of another slot in between, FinishStagedImport) and
// runtime::EarlyImporter over runtime::GpuSlotImporter make a slot what the direct import
// (ImportLayers filled by PagedState::LoadLayerRing, what the decode runner does today) makes
// it: the same exported state and the same next-token logits bit for bit, from bf16 and fp32
// pages, before and past the window. The slot reads as empty (position 0) until the import is
// finished; a cancelled import gives the slot's device pages back, also when its device calls
// fail. Same models as
// gpu_model_test.cc; skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/state_staging.h"
#include "runtime/cuda/gpu_slot_importer.h"
#include "runtime/early_import.h"
#include "runtime/paged_state.h"
#include "serving/page_pool.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/state_compare.h"

namespace pdserve::engine::gpu {
namespace {

// A prompt's state in one sequence's pages (owner 1), as the decode worker receives it.
struct TransferredPages {
  std::unique_ptr<serving::PagePool> pool;
  runtime::SequencePages pages;
};

class GpuEarlyImportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    LoadByName(GetParam(), &model_);
  }

  void Prefill(GpuModel& gpu, int64_t slot, int64_t n) { PrefillSlot(model_, gpu, slot, n); }

  // Slot 0's state after a prefill of p tokens, stored into fresh pages of `layout`.
  void StorePrompt(GpuModel& gpu, const serving::StateLayout& layout, int64_t p,
                   TransferredPages* out) {
    const int64_t total = gpu.max_context();
    auto pool = serving::PagePool::Create(layout.PoolOptions(1, total));
    ASSERT_TRUE(pool.ok()) << pool.status();
    auto table = (*pool)->Allocate(1, layout.Demand(total));
    ASSERT_TRUE(table.ok()) << table.status();
    auto pages = runtime::MapPages(**pool, *table);
    ASSERT_TRUE(pages.ok()) << pages.status();
    Prefill(gpu, 0, p);
    auto exported = gpu.ExportState(0);
    ASSERT_TRUE(exported.ok()) << exported.status();
    const runtime::PagedState paged(model_.config, layout, total);
    ASSERT_TRUE(paged.Store(*exported, 0, *pages).ok());
    out->pool = std::move(*pool);
    out->pages = std::move(*pages);
  }

  // The direct import of the pages into `slot`: its state and the next token's logits.
  void DirectImport(GpuModel& gpu, const serving::StateLayout& layout, const TransferredPages& from,
                    int64_t p, int64_t slot, ModelState* state, Tensor* logits) {
    auto staging = gpu.NewStateStaging(std::min<int64_t>(2, model_.config.num_hidden_layers));
    ASSERT_TRUE(staging.ok()) << staging.status();
    const runtime::PagedState paged(model_.config, layout, gpu.max_context());
    Prefill(gpu, slot, 7);
    ASSERT_TRUE(gpu.ImportLayers(slot, p, staging->get(),
                                 [&](int64_t layer, const RingLayerGeometry& g,
                                     const MutableRingLayerBlocks& blocks) {
                                   return paged.LoadLayerRing(layer, g, p, from.pages, blocks);
                                 })
                    .ok());
    auto exported = gpu.ExportState(slot);
    ASSERT_TRUE(exported.ok()) << exported.status();
    *state = std::move(*exported);
    auto next = gpu.Forward(slot, {model_.prompts.front()[0]});
    ASSERT_TRUE(next.ok()) << next.status();
    *logits = std::move(*next);
  }

  void ExpectSlotEquals(GpuModel& gpu, int64_t slot, int64_t p, const ModelState& want_state,
                        const Tensor& want) {
    EXPECT_EQ(gpu.Position(slot), p);
    auto got_state = gpu.ExportState(slot);
    ASSERT_TRUE(got_state.ok()) << got_state.status();
    EXPECT_TRUE(SameState(*got_state, want_state));
    auto got = gpu.Forward(slot, {model_.prompts.front()[0]});
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->data.size(), want.data.size());
    EXPECT_EQ(std::memcmp(got->ptr(), want.ptr(), want.data.size() * sizeof(float)), 0);
  }

  std::vector<int64_t> Positions(const GpuModel& gpu) const {
    const int64_t w = model_.config.sliding_window;
    std::vector<int64_t> positions = {0, 1, w - 1, w + 1, 129, 300};
    std::erase_if(positions, [&](int64_t p) { return p < 0 || p >= gpu.max_context(); });
    return positions;
  }

  TestModel model_;
};

TEST_P(GpuEarlyImportTest, StagedImportInAnyLayerOrderEqualsTheDirectImportBitForBit) {
  auto gpu = MakeGpu(model_, 3, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t layers = model_.config.num_hidden_layers;
  auto staging = gpu->NewStateStaging(std::min<int64_t>(2, layers));
  ASSERT_TRUE(staging.ok()) << staging.status();
  for (serving::ElementType element :
       {serving::ElementType::kBfloat16, serving::ElementType::kFloat32}) {
    SCOPED_TRACE(serving::ElementTypeName(element));
    auto layout = runtime::LayoutForModel(model_.config, 64, element);
    ASSERT_TRUE(layout.ok()) << layout.status();
    const runtime::PagedState paged(model_.config, *layout, gpu->max_context());
    for (int64_t p : Positions(*gpu)) {
      SCOPED_TRACE(p);
      TransferredPages pages;
      StorePrompt(*gpu, *layout, p, &pages);
      ModelState want_state;
      Tensor want;
      DirectImport(*gpu, *layout, pages, p, 1, &want_state, &want);
      // The staged path into slot 2, which held other contents first; the last layer first,
      // then the others from the front, with a step of slot 0 between layers.
      Prefill(*gpu, 2, 11);
      ASSERT_TRUE(gpu->BeginStagedImport(2, p).ok());
      EXPECT_EQ(gpu->Position(2), 0);
      std::vector<int64_t> order = {layers - 1};
      for (int64_t l = 0; l + 1 < layers; ++l) order.push_back(l);
      for (int64_t layer : order) {
        ASSERT_TRUE((*staging)
                        ->FillImportLayer(layer, p,
                                          [&](int64_t l, const RingLayerGeometry& g,
                                              const MutableRingLayerBlocks& blocks) {
                                            return paged.LoadLayerRing(l, g, p, pages.pages,
                                                                       blocks);
                                          })
                        .ok());
        ASSERT_TRUE(gpu->EnqueueStagedLayer(2, layer, staging->get()).ok());
        if (gpu->Position(0) < gpu->max_context()) {
          ASSERT_TRUE(gpu->Forward(0, {model_.prompts.front()[0]}).ok());
        }
        EXPECT_EQ(gpu->Position(2), 0);  // not readable before it is finished
      }
      absl::StatusOr<bool> copied = false;
      while (copied.ok() && !*copied) copied = gpu->StagedImportCopied(2);
      ASSERT_TRUE(copied.ok()) << copied.status();
      ASSERT_TRUE(gpu->FinishStagedImport(2).ok());
      ExpectSlotEquals(*gpu, 2, p, want_state, want);
    }
  }
}

TEST_P(GpuEarlyImportTest, EarlyImporterOverTheGpuEqualsTheDirectImportAndCancelFreesPages) {
  auto gpu = MakeGpu(model_, 3, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t layers = model_.config.num_hidden_layers;
  auto layout = runtime::LayoutForModel(model_.config, 64, serving::ElementType::kBfloat16);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const int64_t p = std::min<int64_t>(300, gpu->max_context() - 1);
  TransferredPages pages;
  StorePrompt(*gpu, *layout, p, &pages);
  ModelState want_state;
  Tensor want;
  DirectImport(*gpu, *layout, pages, p, 1, &want_state, &want);
  runtime::ModelLock lock;
  std::atomic<int64_t> returned{-1};  // the slot return_slot got (from the importer's thread)
  auto slots = runtime::GpuSlotImporter::Create(
      {.gpu = gpu.get(),
       .layout = &*layout,
       .pool = pages.pool.get(),
       .lock = &lock,
       .take_slot = [](serving::RequestId) -> absl::StatusOr<int64_t> { return 2; },
       .return_slot = [&](serving::RequestId, int64_t slot) { returned.store(slot); }});
  ASSERT_TRUE(slots.ok()) << slots.status();
  std::vector<int64_t> free_before;
  for (const StatePageKind& kind : gpu->StatePages()) free_before.push_back(kind.pages_free);
  {
    // Cancelled after one layer: the slot is empty again, its device pages free, and it is
    // returned.
    runtime::EarlyImporter importer(slots->get(), layers);
    ASSERT_TRUE(importer.Begin(1, p, gpu->max_context()).ok());
    importer.LayerArrived(1, layers - 1);
    importer.Cancel(1);
    // Released at once, or right after the layer's import call if it was running.
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (returned.load() < 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    EXPECT_EQ(returned.load(), 2);
    EXPECT_EQ(gpu->Position(2), 0);
    std::vector<int64_t> free_after;
    for (const StatePageKind& kind : gpu->StatePages()) free_after.push_back(kind.pages_free);
    EXPECT_EQ(free_after, free_before);
  }
  runtime::EarlyImporter importer(slots->get(), layers);
  ASSERT_TRUE(importer.Begin(1, p, gpu->max_context()).ok());
  for (int64_t layer = layers - 1; layer >= 0; --layer) importer.LayerArrived(1, layer);
  importer.Verified(1);
  absl::StatusOr<bool> ready = false;
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (ready.ok() && !*ready && absl::Now() < until) ready = importer.Ready(1);
  ASSERT_TRUE(ready.ok()) << ready.status();
  ASSERT_TRUE(*ready);
  ASSERT_TRUE(importer.Take(1).ok());
  lock.LockForStep();
  const absl::Status finished = (*slots)->Finish(1);
  lock.Unlock();
  ASSERT_TRUE(finished.ok()) << finished;
  ExpectSlotEquals(*gpu, 2, p, want_state, want);
}

TEST_P(GpuEarlyImportTest, StagedImportRefusesCallsOutOfTurn) {
  auto gpu = MakeGpu(model_, 2, 64);
  ASSERT_NE(gpu, nullptr);
  auto staging = gpu->NewStateStaging(1);
  ASSERT_TRUE(staging.ok()) << staging.status();
  const int64_t layers = model_.config.num_hidden_layers;
  auto nothing = [](int64_t, const RingLayerGeometry&, const MutableRingLayerBlocks&) {
    return absl::OkStatus();
  };
  EXPECT_TRUE(absl::IsFailedPrecondition(gpu->EnqueueStagedLayer(1, 0, staging->get())));
  EXPECT_TRUE(absl::IsFailedPrecondition(gpu->FinishStagedImport(1)));
  EXPECT_TRUE(absl::IsInvalidArgument(gpu->BeginStagedImport(1, gpu->max_context() + 1)));
  ASSERT_TRUE(gpu->BeginStagedImport(1, 5).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(gpu->BeginStagedImport(1, 5)));
  // A layer not filled, then filled at another position, is refused.
  EXPECT_TRUE(absl::IsFailedPrecondition(gpu->EnqueueStagedLayer(1, 0, staging->get())));
  ASSERT_TRUE((*staging)->FillImportLayer(0, 4, nothing).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(gpu->EnqueueStagedLayer(1, 0, staging->get())));
  // Its buffer still holds that layer: the next fill is refused until it is discarded.
  EXPECT_TRUE(absl::IsFailedPrecondition((*staging)->FillImportLayer(0, 5, nothing)));
  ASSERT_TRUE((*staging)->Discard().ok());
  ASSERT_TRUE((*staging)->FillImportLayer(0, 5, nothing).ok());
  ASSERT_TRUE(gpu->EnqueueStagedLayer(1, 0, staging->get()).ok());
  if (layers > 1) {
    EXPECT_TRUE(absl::IsFailedPrecondition(gpu->FinishStagedImport(1)));
    const absl::StatusOr<bool> copied = gpu->StagedImportCopied(1);
    ASSERT_TRUE(copied.ok());
    EXPECT_FALSE(*copied);
  }
  ASSERT_TRUE(gpu->CancelStagedImport(1).ok());
  EXPECT_EQ(gpu->Position(1), 0);
  EXPECT_TRUE(absl::IsFailedPrecondition(gpu->CancelStagedImport(1)));
}

// A cancel whose device calls fail (cudaSetDevice, a test fault) still gives the slot's device
// pages back, and the slot imports again afterwards: with one failure (the cancel's own
// selection) and with two (ResetSlot's too, whose row upload the next call then makes).
TEST_P(GpuEarlyImportTest, ACancelWhoseDeviceCallsFailStillFreesTheSlotsPages) {
  auto gpu = MakeGpu(model_, 2, 64);
  ASSERT_NE(gpu, nullptr);
  auto pages_free = [&] {
    std::vector<int64_t> free;
    for (const StatePageKind& kind : gpu->StatePages()) free.push_back(kind.pages_free);
    return free;
  };
  const std::vector<int64_t> free_before = pages_free();
  const int64_t p = std::min<int64_t>(300, gpu->max_context() - 1);
  for (int64_t faults : {1, 2}) {
    SCOPED_TRACE(faults);
    ASSERT_TRUE(gpu->BeginStagedImport(1, p).ok());
    // The slot holds pages for p tokens (a model with paged state: compressed layers).
    if (!free_before.empty()) {
      EXPECT_NE(pages_free(), free_before);
    }
    gpu->FailDeviceSelectionForTest(faults);
    const absl::Status cancelled = gpu->CancelStagedImport(1);
    gpu->FailDeviceSelectionForTest(0);  // a fault left over (no paged state: one call fewer)
    EXPECT_TRUE(absl::IsInternal(cancelled)) << cancelled;
    EXPECT_EQ(gpu->Position(1), 0);
    EXPECT_EQ(pages_free(), free_before);
    EXPECT_TRUE(absl::IsFailedPrecondition(gpu->CancelStagedImport(1)));
  }
  // The device works again: the slot imports and cancels as usual.
  ASSERT_TRUE(gpu->BeginStagedImport(1, p).ok());
  ASSERT_TRUE(gpu->CancelStagedImport(1).ok());
  EXPECT_EQ(pages_free(), free_before);
  ASSERT_TRUE(gpu->Forward(0, {model_.prompts.front()[0]}).ok());
}

INSTANTIATE_TEST_SUITE_P(Models, GpuEarlyImportTest, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

}  // namespace
}  // namespace pdserve::engine::gpu
