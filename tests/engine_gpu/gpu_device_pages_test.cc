// runtime::DeviceStatePages (issue 27's same-host device-to-device data movement) against the host
// path it replaces, on the engine test models after a real forward:
//   - P's side: every device page equals, byte for byte, the host page that ExportLayerAsync +
//     PagedState::StoreLayerRing writes (the prefill's staged store), and every GPU checksum
//     equals kv::PayloadChecksum (libxxhash) of that host page;
//   - D's side: device pages -> a slot that held another request equals the host path's import
//     from the same bytes (PagedState::LoadLayerRing into a staging, GpuModel::ImportLayers):
//     the same exported state bit for bit and the same next decode step's logits;
// at position 0, 1, around the CSA rate and the window, and long past them (ring wraps, many
// entry pages), with state pages of 64 entries (the device's page size) and of 24 (entry runs
// split across device pages). Skips without a CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "engine/gpu/gpu_model.h"
#include "engine/gpu/state_staging.h"
#include "kvtransfer/page_header.h"
#include "runtime/cuda/device_state_pages.h"
#include "runtime/paged_state.h"
#include "serving/page_pool.h"
#include "tests/engine_gpu/gpu_test_models.h"
#include "tests/engine_gpu/state_compare.h"

namespace pdserve::engine::gpu {
namespace {

using runtime::DeviceSequencePages;
using runtime::DeviceStatePages;
using runtime::PagedState;

// One sequence's pages twice: host pages in a pool (the host path's) and device pages at 256-byte
// aligned offsets of one allocation (an arena's), both zeroed.
struct TwinPages {
  std::unique_ptr<serving::PagePool> pool;
  runtime::SequencePages host;
  void* arena = nullptr;
  size_t arena_bytes = 0;
  DeviceSequencePages device;
  ~TwinPages() { cudaFree(arena); }

  std::vector<std::byte> ArenaBytes() const {
    std::vector<std::byte> out(arena_bytes);
    EXPECT_EQ(cudaMemcpy(out.data(), arena, arena_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

  void Allocate(const serving::StateLayout& layout, int64_t total) {
    pool = *serving::PagePool::Create(layout.PoolOptions(1, total));
    const serving::PageTable table = *pool->Allocate(3, layout.Demand(total));
    host = *runtime::MapPages(*pool, table);
    size_t bytes = 0;
    for (const auto& kind : host.pages) {
      for (const auto& page : kind) bytes += (page.size() + 255) / 256 * 256;
    }
    arena_bytes = bytes;
    ASSERT_EQ(cudaMalloc(&arena, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(arena, 0, bytes), cudaSuccess);
    size_t at = 0;
    device.pages.resize(host.pages.size());
    for (size_t k = 0; k < host.pages.size(); ++k) {
      for (const auto& page : host.pages[k]) {
        std::memset(page.data(), 0, page.size());
        device.pages[k].push_back(static_cast<std::byte*>(arena) + at);
        at += (page.size() + 255) / 256 * 256;
      }
    }
  }
};

class GpuDevicePagesTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HasGpu()) GTEST_SKIP() << "no CUDA device";
    LoadByName(GetParam(), &model_);
  }

  // Positions 0, 1, around the CSA rate and the window, and long past them, below `total`.
  std::vector<int64_t> Positions(int64_t total) const {
    const int64_t m = std::max<int64_t>(model_.config.compress_rate_csa, 1);
    const int64_t w = model_.config.sliding_window;
    std::vector<int64_t> p = {0, 1, m - 1, m, m + 1, w - 1, w, w + 1, 129, 300, total - 1};
    std::erase_if(p, [&](int64_t x) { return x < 0 || x >= total; });
    std::sort(p.begin(), p.end());
    p.erase(std::unique(p.begin(), p.end()), p.end());
    return p;
  }

  // The host path's store of slot `slot` at its position into `pages.host`, layer by layer.
  void HostStore(GpuModel& gpu, StateStaging& staging, const PagedState& paged, int64_t slot,
                 const TwinPages& pages) {
    const int64_t layers = model_.config.num_hidden_layers;
    for (int64_t l = 0; l < layers; ++l) {
      ASSERT_TRUE(gpu.ExportLayerAsync(slot, l, &staging).ok());
      auto taken = staging.TakeLayerBlocks(l);
      ASSERT_TRUE(taken.ok()) << taken.status();
      ASSERT_TRUE(
          paged.StoreLayerRing(l, *taken->geometry, taken->blocks, taken->position, pages.host)
              .ok());
    }
  }

  // P's side: DeviceStatePages::StoreLayer of every layer of slot 0 at `p` (or, `all_layers`,
  // one StoreLayers) into the device pages equals, page by page, the host pages HostStore wrote,
  // and each GPU checksum is kv::PayloadChecksum of the host page.
  void ExpectDevicePagesEqualHostPages(GpuModel& gpu, DeviceStatePages& device,
                                       const TwinPages& pages, int64_t p, bool all_layers) {
    const serving::StateLayout& layout = device.layout();
    const int64_t layers = model_.config.num_hidden_layers;
    std::vector<std::vector<PagedState::PageId>> ids;
    std::vector<size_t> first_checksum;
    size_t checksums = 0;
    for (int64_t l = 0; l < layers; ++l) {
      ids.push_back(device.LayerPages(l));
      first_checksum.push_back(checksums);
      checksums += ids.back().size();
    }
    uint64_t* gpu_checksums = nullptr;
    ASSERT_EQ(cudaMalloc(&gpu_checksums, checksums * sizeof(uint64_t)), cudaSuccess);
    if (all_layers) {
      std::vector<PagedState::PageId> every;
      for (const auto& layer : ids) every.insert(every.end(), layer.begin(), layer.end());
      const absl::Status stored = device.StoreLayers(0, p, pages.device, {every, gpu_checksums});
      ASSERT_TRUE(stored.ok()) << stored;
    }
    for (int64_t l = 0; l < layers && !all_layers; ++l) {
      const auto i = static_cast<size_t>(l);
      const absl::Status stored =
          device.StoreLayer(0, l, p, pages.device, {ids[i], gpu_checksums + first_checksum[i]});
      ASSERT_TRUE(stored.ok()) << stored;
    }
    ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(gpu.cuda_stream())), cudaSuccess);
    std::vector<uint64_t> got(checksums);
    ASSERT_EQ(
        cudaMemcpy(got.data(), gpu_checksums, checksums * sizeof(uint64_t), cudaMemcpyDeviceToHost),
        cudaSuccess);
    cudaFree(gpu_checksums);
    for (int64_t l = 0; l < layers; ++l) {
      for (size_t i = 0; i < ids[static_cast<size_t>(l)].size(); ++i) {
        const PagedState::PageId id = ids[static_cast<size_t>(l)][i];
        const int k = *layout.KindIndex(id.kind);
        const std::span<std::byte> want = pages.host.pages[k][id.page];
        std::vector<std::byte> bytes(want.size());
        ASSERT_EQ(cudaMemcpy(bytes.data(), pages.device.pages[k][id.page], bytes.size(),
                             cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(std::memcmp(bytes.data(), want.data(), bytes.size()), 0)
            << "layer " << l << " " << serving::StateKindName(id.kind) << " page " << id.page;
        ASSERT_EQ(got[first_checksum[static_cast<size_t>(l)] + i], kv::PayloadChecksum(want))
            << "layer " << l << " " << serving::StateKindName(id.kind) << " page " << id.page;
      }
    }
  }

  // D's side: the host path's import of `pages.host` into slot 1 and DeviceStatePages::ImportSlot
  // (`batched`: ImportSlotBatched) of `pages.device` into slot 2 (both held other requests
  // first) give the same exported state and the same next decode step's logits, bit for bit.
  void ExpectImportsEqual(GpuModel& gpu, StateStaging& staging, DeviceStatePages& device,
                          const TwinPages& pages, int64_t p, int32_t next, bool batched) {
    const PagedState& paged = device.paged();
    PrefillSlot(model_, gpu, 1, 7);
    ASSERT_TRUE(gpu.ImportLayers(1, p, &staging,
                                 [&](int64_t layer, const RingLayerGeometry& g,
                                     const MutableRingLayerBlocks& blocks) {
                                   return paged.LoadLayerRing(layer, g, p, pages.host, blocks);
                                 })
                    .ok());
    PrefillSlot(model_, gpu, 2, 11);
    const absl::Status imported = batched ? device.ImportSlotBatched(2, p, pages.device)
                                          : device.ImportSlot(2, p, pages.device);
    ASSERT_TRUE(imported.ok()) << imported;
    EXPECT_EQ(gpu.Position(2), p);
    auto want_state = gpu.ExportState(1);
    auto got_state = gpu.ExportState(2);
    ASSERT_TRUE(want_state.ok() && got_state.ok());
    EXPECT_TRUE(SameState(*got_state, *want_state));
    auto want = gpu.DecodeStep({1}, {next}, /*use_graph=*/false);
    auto decoded = gpu.DecodeStep({2}, {next}, /*use_graph=*/false);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ASSERT_EQ(decoded->data.size(), want->data.size());
    EXPECT_EQ(std::memcmp(decoded->ptr(), want->ptr(), want->data.size() * sizeof(float)), 0);
    for (float x : decoded->data) ASSERT_TRUE(std::isfinite(x));
  }

  TestModel model_;
};

TEST_P(GpuDevicePagesTest, DevicePagesEqualTheHostPathBothWays) {
  auto gpu = MakeGpu(model_, 3, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t total = gpu->max_context();
  const int64_t layers = model_.config.num_hidden_layers;
  auto staging = gpu->NewStateStaging(std::min<int64_t>(2, layers));
  ASSERT_TRUE(staging.ok()) << staging.status();
  const int32_t next = model_.prompts.front()[0];
  // State pages of the device's entry page size and of one that splits entry runs.
  std::vector<serving::StateLayout> layouts;
  std::vector<std::unique_ptr<DeviceStatePages>> devices;
  for (int64_t entries_per_page : {64, 24}) {
    auto layout =
        runtime::LayoutForModel(model_.config, entries_per_page, serving::ElementType::kBfloat16);
    ASSERT_TRUE(layout.ok()) << layout.status();
    layouts.push_back(*layout);
  }
  for (const serving::StateLayout& layout : layouts) {
    auto device = DeviceStatePages::Create(gpu.get(), layout, total);
    ASSERT_TRUE(device.ok()) << device.status();
    devices.push_back(std::move(*device));
  }
  for (int64_t p : Positions(total)) {
    SCOPED_TRACE(p);
    PrefillSlot(model_, *gpu, 0, p);
    for (size_t v = 0; v < layouts.size(); ++v) {
      SCOPED_TRACE(layouts[v].dims().entries_per_page);
      DeviceStatePages* const device = devices[v].get();
      for (bool all_layers : {false, true}) {
        SCOPED_TRACE(all_layers ? "StoreLayers, ImportSlotBatched" : "StoreLayer, ImportSlot");
        TwinPages pages;
        pages.Allocate(layouts[v], total);
        HostStore(*gpu, **staging, device->paged(), 0, pages);
        ExpectDevicePagesEqualHostPages(*gpu, *device, pages, p, all_layers);
        ExpectImportsEqual(*gpu, **staging, *device, pages, p, next, all_layers);
      }
    }
  }
}

// The workers' way (runtime::KeepDevicePageBuffers): a DeviceStatePages made per request over one
// kept, mapped DevicePageDescriptors ring (the kernels read the descriptors from pinned memory)
// stores and imports the same bytes, checksums and slots as the host path, and once each size
// has been seen a new request's object allocates nothing (no growth of the ring's buffers).
TEST_P(GpuDevicePagesTest, KeptMappedDescriptorsServeRequestAfterRequest) {
  auto gpu = MakeGpu(model_, 3, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t total = gpu->max_context();
  const int64_t layers = model_.config.num_hidden_layers;
  auto staging = gpu->NewStateStaging(std::min<int64_t>(2, layers));
  ASSERT_TRUE(staging.ok()) << staging.status();
  auto layout = runtime::LayoutForModel(model_.config, 64, serving::ElementType::kBfloat16);
  ASSERT_TRUE(layout.ok());
  // One batch per launch of a request (StoreLayers 1, ImportSlotBatched 2, StoreLayer and
  // LoadLayer one a layer each), so every request uses each batch for the same launch.
  auto ring = runtime::DevicePageDescriptors::Create(static_cast<size_t>(3 + 2 * layers),
                                                     /*mapped=*/true);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_TRUE(absl::IsInvalidArgument(runtime::DevicePageDescriptors::Create(0, true).status()));
  const int64_t p = std::min<int64_t>(300, total - 1);
  const int32_t next = model_.prompts.front()[0];
  PrefillSlot(model_, *gpu, 0, p);
  uint64_t growths = 0;
  for (int request = 0; request < 3; ++request) {
    SCOPED_TRACE(request);
    for (bool all_layers : {true, false}) {
      auto device = DeviceStatePages::Create(gpu.get(), *layout, total, *ring);
      ASSERT_TRUE(device.ok()) << device.status();
      TwinPages pages;
      pages.Allocate(*layout, total);
      HostStore(*gpu, **staging, (*device)->paged(), 0, pages);
      ExpectDevicePagesEqualHostPages(*gpu, **device, pages, p, all_layers);
      ExpectImportsEqual(*gpu, **staging, **device, pages, p, next, all_layers);
    }
    // The first request grew the buffers; the same sizes again allocate nothing.
    if (request == 0) growths = (*ring)->growths();
    EXPECT_GT(growths, 0u);
    EXPECT_EQ((*ring)->growths(), growths);
  }
}

// D's early import in batches (GpuSlotImporter::ImportLayers): LoadLayers of some layers, a
// LoadLayer, LoadLayers of the rest, in any order, leave the slot ImportSlot leaves from the same
// device pages, bit for bit (and the next step's logits); a layer outside the model or enqueued
// twice is refused.
TEST_P(GpuDevicePagesTest, LoadLayersInBatchesEqualsImportSlot) {
  auto gpu = MakeGpu(model_, 3, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t total = gpu->max_context();
  const int64_t layers = model_.config.num_hidden_layers;
  auto layout = runtime::LayoutForModel(model_.config, 24, serving::ElementType::kBfloat16);
  ASSERT_TRUE(layout.ok());
  auto device = DeviceStatePages::Create(gpu.get(), *layout, total);
  ASSERT_TRUE(device.ok()) << device.status();
  const int32_t next = model_.prompts.front()[0];
  for (int64_t p : Positions(total)) {
    SCOPED_TRACE(p);
    PrefillSlot(model_, *gpu, 0, p);
    TwinPages pages;
    pages.Allocate(*layout, total);
    ASSERT_TRUE((*device)->StoreLayers(0, p, pages.device).ok());
    PrefillSlot(model_, *gpu, 1, 7);
    ASSERT_TRUE((*device)->ImportSlot(1, p, pages.device).ok());
    PrefillSlot(model_, *gpu, 2, 11);
    ASSERT_TRUE(gpu->BeginStagedImport(2, p).ok());
    std::vector<int64_t> odd;
    std::vector<int64_t> even;
    for (int64_t l = layers - 1; l >= 0; --l) (l % 2 == 1 ? odd : even).push_back(l);
    absl::Status loaded = (*device)->LoadLayers(2, odd, pages.device);
    ASSERT_TRUE(loaded.ok()) << loaded;
    EXPECT_TRUE(absl::IsInvalidArgument((*device)->LoadLayers(2, {{layers}}, pages.device)));
    if (!odd.empty()) {
      EXPECT_TRUE(
          absl::IsFailedPrecondition((*device)->LoadLayers(2, {{odd.front()}}, pages.device)));
    }
    ASSERT_TRUE((*device)->LoadLayer(2, even.front(), pages.device).ok());
    loaded = (*device)->LoadLayers(2, std::span(even).subspan(1), pages.device);
    ASSERT_TRUE(loaded.ok()) << loaded;
    ASSERT_TRUE(gpu->FinishStagedImport(2).ok());
    auto want_state = gpu->ExportState(1);
    auto got_state = gpu->ExportState(2);
    ASSERT_TRUE(want_state.ok() && got_state.ok());
    EXPECT_TRUE(SameState(*got_state, *want_state));
    auto want = gpu->DecodeStep({1}, {next}, /*use_graph=*/false);
    auto decoded = gpu->DecodeStep({2}, {next}, /*use_graph=*/false);
    ASSERT_TRUE(want.ok() && decoded.ok());
    ASSERT_EQ(decoded->data.size(), want->data.size());
    EXPECT_EQ(std::memcmp(decoded->ptr(), want->ptr(), want->data.size() * sizeof(float)), 0);
  }
}

// P's overlap: the gathers enqueued on the copy stream right after each layer's attention of the
// prompt's last chunk (GpuModel::BeginForwardStoring) write the same pages and checksums as
// StoreLayer after the whole forward, and the chunk's logits are a plain Forward's.
TEST_P(GpuDevicePagesTest, StoringDuringTheLastChunkEqualsStoringAfterIt) {
  auto gpu = MakeGpu(model_, 2, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t total = gpu->max_context();
  const int64_t layers = model_.config.num_hidden_layers;
  auto layout = runtime::LayoutForModel(model_.config, 64, serving::ElementType::kBfloat16);
  ASSERT_TRUE(layout.ok());
  auto device = DeviceStatePages::Create(gpu.get(), *layout, total);
  ASSERT_TRUE(device.ok()) << device.status();
  std::vector<std::vector<PagedState::PageId>> ids;
  size_t count = 0;
  for (int64_t l = 0; l < layers; ++l) {
    ids.push_back((*device)->LayerPages(l));
    count += ids.back().size();
  }
  uint64_t* checksums = nullptr;  // [2, count]: during, after
  ASSERT_EQ(cudaMalloc(&checksums, 2 * count * sizeof(uint64_t)), cudaSuccess);
  const std::vector<int32_t>& text = model_.prompts.back();
  for (int64_t wanted : {int64_t{1}, int64_t{13}, int64_t{129}, int64_t{300}}) {
    // The fixture models' contexts are 64 to 512 tokens: the last position is as far as it goes.
    const int64_t p = std::min<int64_t>(wanted, gpu->max_context() - 1);
    SCOPED_TRACE(p);
    const int64_t first = std::max<int64_t>(p - 13, 0);
    std::vector<int32_t> last;
    for (int64_t i = first; i < p; ++i) last.push_back(text[static_cast<size_t>(i) % text.size()]);
    TwinPages during;
    TwinPages after;
    during.Allocate(*layout, total);
    after.Allocate(*layout, total);
    PrefillSlot(model_, *gpu, 1, first);
    auto want = gpu->Forward(1, last);
    ASSERT_TRUE(want.ok()) << want.status();
    PrefillSlot(model_, *gpu, 0, first);
    std::vector<size_t> at(1, 0);
    for (const auto& layer_ids : ids) at.push_back(at.back() + layer_ids.size());
    ASSERT_TRUE(gpu->BeginForwardStoring(0, last,
                                         [&](int64_t layer, int64_t position, void* stream) {
                                           const auto l = static_cast<size_t>(layer);
                                           return (*device)->StoreLayer(
                                               0, layer, position, during.device,
                                               {ids[l], checksums + at[l]}, stream);
                                         })
                    .ok());
    auto got = gpu->FinishForward();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->data.size(), want->data.size());
    EXPECT_EQ(std::memcmp(got->ptr(), want->ptr(), want->data.size() * sizeof(float)), 0);
    for (int64_t l = 0; l < layers; ++l) {
      const auto i = static_cast<size_t>(l);
      ASSERT_TRUE(
          (*device)->StoreLayer(0, l, p, after.device, {ids[i], checksums + count + at[i]}).ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(during.ArenaBytes() == after.ArenaBytes());
    std::vector<uint64_t> sums(2 * count);
    ASSERT_EQ(
        cudaMemcpy(sums.data(), checksums, sums.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost),
        cudaSuccess);
    EXPECT_TRUE(std::equal(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(count),
                           sums.begin() + static_cast<std::ptrdiff_t>(count)));
  }
  cudaFree(checksums);
}

// The refusals: an fp32 layout, a sequence longer than the model's context, a page the sequence
// lacks (OutOfRange, nothing launched), a LoadLayer outside a staged import.
TEST_P(GpuDevicePagesTest, RefusesWhatItCannotCopy) {
  auto gpu = MakeGpu(model_, 2, 64);
  ASSERT_NE(gpu, nullptr);
  const int64_t total = gpu->max_context();
  auto fp32 = runtime::LayoutForModel(model_.config, 64, serving::ElementType::kFloat32);
  ASSERT_TRUE(fp32.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(DeviceStatePages::Create(gpu.get(), *fp32, total).status()));
  auto layout = runtime::LayoutForModel(model_.config, 64, serving::ElementType::kBfloat16);
  ASSERT_TRUE(layout.ok());
  EXPECT_TRUE(
      absl::IsInvalidArgument(DeviceStatePages::Create(gpu.get(), *layout, total + 1).status()));
  auto device = DeviceStatePages::Create(gpu.get(), *layout, total);
  ASSERT_TRUE(device.ok()) << device.status();
  TwinPages pages;
  pages.Allocate(*layout, total);
  PrefillSlot(model_, *gpu, 0, 40);
  DeviceSequencePages short_pages = pages.device;
  short_pages.pages[0].clear();  // no window pages
  EXPECT_TRUE(absl::IsOutOfRange((*device)->StoreLayer(0, 0, 40, short_pages)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*device)->StoreLayer(0, model_.config.num_hidden_layers, 40, pages.device)));
  EXPECT_TRUE(absl::IsFailedPrecondition((*device)->LoadLayer(1, 0, pages.device)));
  // A failed import leaves the slot reset.
  EXPECT_TRUE(absl::IsOutOfRange((*device)->ImportSlot(1, 40, short_pages)));
  EXPECT_EQ(gpu->Position(1), 0);
  EXPECT_TRUE((*device)->ImportSlot(1, 40, pages.device).ok());
  EXPECT_EQ(gpu->Position(1), 40);
}

INSTANTIATE_TEST_SUITE_P(Models, GpuDevicePagesTest, ::testing::ValuesIn(ModelNames()),
                         ModelTestName);

}  // namespace
}  // namespace pdserve::engine::gpu
