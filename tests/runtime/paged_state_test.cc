// PagedState: the engine state stored in pool pages is an exact copy, and pages shipped as bytes to
// a fresh pool continue decoding with bit-identical logits.
#include "runtime/paged_state.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/model.h"
#include "gtest/gtest.h"
#include "tests/runtime/state_compare.h"

namespace pdserve::runtime {
namespace {

constexpr char kModelDir[] = PDSERVE_ENGINE_FIXTURES_DIR "/mixed_yarn_f32/model";

struct Fixture {
  engine::Model model;
  serving::StateLayout layout;
};

std::unique_ptr<Fixture> Load() {
  absl::StatusOr<engine::Model> model = engine::Model::Load(kModelDir);
  EXPECT_TRUE(model.ok()) << model.status();
  absl::StatusOr<serving::StateLayout> layout = LayoutForModel(model->config(), 4);
  EXPECT_TRUE(layout.ok()) << layout.status();
  return std::make_unique<Fixture>(Fixture{std::move(*model), *layout});
}

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < n; ++i) tokens.push_back((i * 37 + salt * 11 + 5) % 384);
  return tokens;
}

using testing::ExpectSameState;
using testing::SameBits;

// A pool holding one sequence of `total` tokens, and that sequence's pages.
struct OneSequence {
  std::unique_ptr<serving::PagePool> pool;
  serving::PageTable table;
  SequencePages pages;
};

OneSequence Allocate(const serving::StateLayout& layout, int64_t total) {
  OneSequence s;
  serving::PagePoolOptions options = layout.PoolOptions(1, total);
  options.poison_freed = true;  // every fresh page holds kPoisonWord: pools compare byte for byte
  s.pool = *serving::PagePool::Create(options);
  s.table = *s.pool->Allocate(7, layout.Demand(total));
  s.pages = *MapPages(*s.pool, s.table);
  return s;
}

TEST(PagedStateTest, LoadReturnsTheStoredStateAtEveryPosition) {
  auto f = Load();
  const int64_t total = 40;
  OneSequence seq = Allocate(f->layout, total);
  PagedState paged(f->model.config(), f->layout, total);
  engine::ModelState plain = f->model.NewState();
  const std::vector<int32_t> tokens = Tokens(37, 1);
  // Chunks of 1..6 tokens cross every window, compressor and entry-page boundary.
  int64_t at = 0;
  for (int64_t chunk = 1; at < static_cast<int64_t>(tokens.size()); chunk = chunk % 6 + 1) {
    const int64_t end = std::min<int64_t>(at + chunk, tokens.size());
    const int64_t from = plain.position;
    ASSERT_TRUE(
        f->model.Forward(&plain, std::vector<int32_t>(tokens.begin() + at, tokens.begin() + end))
            .ok());
    ASSERT_TRUE(paged.Store(plain, from, seq.pages).ok());
    engine::ModelState loaded = f->model.NewState();
    ASSERT_TRUE(paged.Load(plain.position, seq.pages, &loaded).ok());
    ExpectSameState(plain, loaded);
    at = end;
  }
}

// The prefill worker's path: a second chunk whose layers are stored from Forward's per-layer hook
// (before state->position advances) leaves the same pages as a Store after the chunk.
TEST(PagedStateTest, StoreLayerFromTheForwardHookEqualsStore) {
  auto f = Load();
  const int64_t total = 40;
  OneSequence hooked = Allocate(f->layout, total);
  PagedState paged(f->model.config(), f->layout, total);
  const std::vector<int32_t> tokens = Tokens(33, 4);
  const std::vector<int32_t> head(tokens.begin(), tokens.begin() + 16);
  const std::vector<int32_t> tail(tokens.begin() + 16, tokens.end());
  engine::ModelState state = f->model.NewState();
  ASSERT_TRUE(f->model.Forward(&state, head).ok());
  std::vector<int64_t> layers_seen;
  absl::Status stored;
  auto hook = [&](int64_t layer, const engine::LayerState& ls, int64_t position) {
    layers_seen.push_back(layer);
    EXPECT_EQ(position, 33);
    if (stored.ok()) stored = paged.StoreLayer(layer, ls, position, 0, hooked.pages);
  };
  ASSERT_TRUE(f->model.Forward(&state, tail, hook).ok());
  ASSERT_TRUE(stored.ok()) << stored;
  EXPECT_EQ(layers_seen.size(), f->model.config().layer_types.size());
  engine::ModelState loaded = f->model.NewState();
  ASSERT_TRUE(paged.Load(state.position, hooked.pages, &loaded).ok());
  ExpectSameState(state, loaded);
}

TEST(PagedStateTest, ShippedPagesContinueDecodingBitForBit) {
  auto f = Load();
  const int64_t total = 48;
  const std::vector<int32_t> prompt = Tokens(29, 2);
  OneSequence sender = Allocate(f->layout, total);
  PagedState paged(f->model.config(), f->layout, total);
  engine::ModelState plain = f->model.NewState();
  ASSERT_TRUE(
      f->model.Forward(&plain, std::vector<int32_t>(prompt.begin(), prompt.begin() + 13)).ok());
  ASSERT_TRUE(paged.Store(plain, 0, sender.pages).ok());
  ASSERT_TRUE(
      f->model.Forward(&plain, std::vector<int32_t>(prompt.begin() + 13, prompt.end())).ok());
  ASSERT_TRUE(paged.Store(plain, 13, sender.pages).ok());

  // Serialize every page, then rebuild them in another pool under another owner.
  std::vector<std::vector<std::vector<std::byte>>> wire;
  for (const auto& kind : sender.pages.pages) {
    wire.emplace_back();
    for (std::span<std::byte> page : kind) wire.back().emplace_back(page.begin(), page.end());
  }
  auto receiver_pool = *serving::PagePool::Create(f->layout.PoolOptions(3, 3 * total));
  ASSERT_TRUE(receiver_pool->Allocate(1, f->layout.Demand(total)).ok());  // shift page indices
  serving::PageTable table = *receiver_pool->Allocate(99, f->layout.Demand(total));
  SequencePages received = *MapPages(*receiver_pool, table);
  for (size_t k = 0; k < wire.size(); ++k) {
    for (size_t i = 0; i < wire[k].size(); ++i) {
      std::memcpy(received.pages[k][i].data(), wire[k][i].data(), wire[k][i].size());
    }
  }
  PagedState rebuilt_view(f->model.config(), f->layout, total);
  engine::ModelState rebuilt = f->model.NewState();
  ASSERT_TRUE(rebuilt_view.Load(plain.position, received, &rebuilt).ok());

  for (int32_t token : {3, 141, 59, 265, 35, 89, 7, 93, 238, 46, 26, 43}) {
    absl::StatusOr<engine::Tensor> a = f->model.Forward(&plain, {token});
    const int64_t from = rebuilt.position;
    absl::StatusOr<engine::Tensor> b = f->model.Forward(&rebuilt, {token});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(SameBits(*a, *b)) << "logits differ at position " << from;
    // The receiver keeps its state in its pages too.
    ASSERT_TRUE(rebuilt_view.Store(rebuilt, from, received).ok());
    rebuilt = f->model.NewState();
    ASSERT_TRUE(rebuilt_view.Load(from + 1, received, &rebuilt).ok());
  }
}

// bf16 bit patterns of `values` (round to nearest even, as the device stores them).
std::vector<uint16_t> Bf16Bits(const std::vector<float>& values) {
  std::vector<uint16_t> bits;
  for (float v : values) bits.push_back(serving::FloatToBf16(v));
  return bits;
}

// One layer's blocks as the device holds them: window and entries rounded to bf16 from the ring
// image, the rings' fp32 rows the image's own (which must outlive this).
struct DeviceLayer {
  explicit DeviceLayer(const engine::RingLayerImage& li)
      : window(Bf16Bits(li.window)),
        entries(Bf16Bits(li.compressor.entries)),
        keys(Bf16Bits(li.indexer.entries)),
        blocks{.window = window.data(),
               .compressor = {li.compressor.ring_kv.data(), li.compressor.ring_gate.data(),
                              entries.data()},
               .indexer = {li.indexer.ring_kv.data(), li.indexer.ring_gate.data(), keys.data()}} {}
  DeviceLayer(const DeviceLayer&) = delete;  // blocks points into this object
  DeviceLayer& operator=(const DeviceLayer&) = delete;
  std::vector<uint16_t> window, entries, keys;
  engine::RingLayerBlocks blocks;
};

// Every page of `a` equals `b`'s byte for byte.
void ExpectSamePages(const SequencePages& a, const SequencePages& b) {
  for (size_t k = 0; k < a.pages.size(); ++k) {
    for (size_t i = 0; i < a.pages[k].size(); ++i) {
      ASSERT_EQ(std::memcmp(a.pages[k][i].data(), b.pages[k][i].data(), a.pages[k][i].size()), 0)
          << "kind " << k << " page " << i;
    }
  }
}

// The CUDA prefill's direct store (StoreLayerRing, from the device's blocks) writes the same page
// bytes as converting the blocks to a CPU layer first and storing that, in a bf16 layout and in
// an fp32 one, at positions that wrap every ring and cross entry pages.
TEST(PagedStateTest, StoreLayerRingEqualsStoreLayerOfTheConvertedBlocks) {
  auto f = Load();
  const engine::ModelConfig& config = f->model.config();
  const int64_t total = 48;
  for (serving::ElementType element :
       {serving::ElementType::kBfloat16, serving::ElementType::kFloat32}) {
    SCOPED_TRACE(serving::ElementTypeName(element));
    const serving::StateLayout layout = *LayoutForModel(config, 4, element);
    for (int64_t position : {3, 37, 44}) {
      SCOPED_TRACE(position);
      engine::ModelState state = f->model.NewState();
      ASSERT_TRUE(f->model.Forward(&state, Tokens(static_cast<int>(position), 6)).ok());
      const engine::RingGeometry geometry = engine::RingGeometryFor(config, total, 4);
      const engine::RingImage image = *engine::RingImageFromState(geometry, state, 0.5f);
      OneSequence converted = Allocate(layout, total);
      OneSequence direct = Allocate(layout, total);
      PagedState paged(config, layout, total);
      for (size_t l = 0; l < image.layers.size(); ++l) {
        const DeviceLayer device(image.layers[l]);
        const engine::RingLayerBlocks& blocks = device.blocks;
        const auto layer = static_cast<int64_t>(l);
        const engine::LayerState ls =
            engine::LayerStateFromRingBlocks(geometry.layers[l], blocks, position);
        ASSERT_TRUE(paged.StoreLayer(layer, ls, position, 0, converted.pages).ok());
        ASSERT_TRUE(
            paged.StoreLayerRing(layer, geometry.layers[l], blocks, position, direct.pages).ok());
      }
      ExpectSamePages(converted.pages, direct.pages);
    }
  }
}

// Equal bit for bit (NaN payloads included).
bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The CUDA decode's direct import (LoadLayerRing into the device's layer layout, no CPU state in
// between) writes exactly the image the old path built (Load, then the ring image of that state,
// window and entries rounded to bf16): every block compared bit for bit, the rows it does not
// write keeping the fill both start from; from bf16 pages (a CUDA prefill's) and from fp32 ones
// (a CPU prefill's, rounded in the copy), at positions that wrap every ring and cross entry pages.
TEST(PagedStateTest, LoadLayerRingEqualsTheRingImageOfLoad) {
  auto f = Load();
  const engine::ModelConfig& config = f->model.config();
  const int64_t total = 48;
  const float fill = 0.5f;
  const uint16_t fill_bf16 = serving::FloatToBf16(fill);
  for (serving::ElementType element :
       {serving::ElementType::kBfloat16, serving::ElementType::kFloat32}) {
    SCOPED_TRACE(serving::ElementTypeName(element));
    const serving::StateLayout layout = *LayoutForModel(config, 4, element);
    for (int64_t position : {0, 3, 37, 44}) {
      SCOPED_TRACE(position);
      engine::ModelState state = f->model.NewState();
      if (position > 0) {
        ASSERT_TRUE(f->model.Forward(&state, Tokens(static_cast<int>(position), 9)).ok());
      }
      OneSequence seq = Allocate(layout, total);
      PagedState paged(config, layout, total);
      ASSERT_TRUE(paged.Store(state, 0, seq.pages).ok());
      engine::ModelState loaded = f->model.NewState();
      ASSERT_TRUE(paged.Load(position, seq.pages, &loaded).ok());
      const engine::RingGeometry geometry = engine::RingGeometryFor(config, total, 4);
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        SCOPED_TRACE(l);
        const engine::RingLayerGeometry& g = geometry.layers[l];
        const engine::RingLayerImage image =
            engine::LayerRingImage(g, loaded.layers[l], position, fill);
        std::vector<uint16_t> window(image.window.size(), fill_bf16);
        std::vector<float> kv(image.compressor.ring_kv.size(), fill);
        std::vector<float> gate(image.compressor.ring_gate.size(), fill);
        std::vector<uint16_t> entries(image.compressor.entries.size(), fill_bf16);
        std::vector<float> index_kv(image.indexer.ring_kv.size(), fill);
        std::vector<float> index_gate(image.indexer.ring_gate.size(), fill);
        std::vector<uint16_t> keys(image.indexer.entries.size(), fill_bf16);
        const engine::MutableRingLayerBlocks blocks{
            .window = window.data(),
            .compressor = {kv.data(), gate.data(), entries.data()},
            .indexer = {index_kv.data(), index_gate.data(), keys.data()}};
        ASSERT_TRUE(
            paged.LoadLayerRing(static_cast<int64_t>(l), g, position, seq.pages, blocks).ok());
        EXPECT_EQ(window, Bf16Bits(image.window));
        EXPECT_EQ(entries, Bf16Bits(image.compressor.entries));
        EXPECT_EQ(keys, Bf16Bits(image.indexer.entries));
        EXPECT_TRUE(SameFloats(kv, image.compressor.ring_kv));
        EXPECT_TRUE(SameFloats(gate, image.compressor.ring_gate));
        EXPECT_TRUE(SameFloats(index_kv, image.indexer.ring_kv));
        EXPECT_TRUE(SameFloats(index_gate, image.indexer.ring_gate));
      }
    }
  }
}

// The prefill's page store and the decode's import spread over several threads (a TaskPool, as
// the CUDA prefill engine and decode runner use) write the same bytes as one thread: every page
// of every kind, bf16 and fp32 layouts, at positions that wrap the rings and cross entry pages;
// and the import from those pages fills the same blocks.
TEST(PagedStateTest, StoreAndLoadLayerRingOnSeveralThreadsEqualOneThread) {
  auto f = Load();
  const engine::ModelConfig& config = f->model.config();
  const int64_t total = 48;
  TaskPool pool(4);
  for (serving::ElementType element :
       {serving::ElementType::kBfloat16, serving::ElementType::kFloat32}) {
    SCOPED_TRACE(serving::ElementTypeName(element));
    const serving::StateLayout layout = *LayoutForModel(config, 4, element);
    for (int64_t position : {1, 5, 37, 47}) {
      SCOPED_TRACE(position);
      engine::ModelState state = f->model.NewState();
      ASSERT_TRUE(f->model.Forward(&state, Tokens(static_cast<int>(position), 4)).ok());
      const engine::RingGeometry geometry = engine::RingGeometryFor(config, total, 4);
      const engine::RingImage image = *engine::RingImageFromState(geometry, state, 0.5f);
      OneSequence one = Allocate(layout, total);
      OneSequence several = Allocate(layout, total);
      PagedState paged(config, layout, total);
      for (size_t l = 0; l < image.layers.size(); ++l) {
        const DeviceLayer device(image.layers[l]);
        const engine::RingLayerBlocks& blocks = device.blocks;
        const auto layer = static_cast<int64_t>(l);
        ASSERT_TRUE(
            paged.StoreLayerRing(layer, geometry.layers[l], blocks, position, one.pages).ok());
        ASSERT_TRUE(
            paged.StoreLayerRing(layer, geometry.layers[l], blocks, position, several.pages, &pool)
                .ok());
      }
      ExpectSamePages(one.pages, several.pages);
      for (size_t l = 0; l < geometry.layers.size(); ++l) {
        SCOPED_TRACE(l);
        const engine::RingLayerGeometry& g = geometry.layers[l];
        const engine::RingLayerImage& li = image.layers[l];
        // Two block sets starting from the same fill, imported with and without the pool.
        std::vector<std::vector<uint16_t>> bf16(6);
        std::vector<std::vector<float>> fp32(8);
        for (int copy = 0; copy < 2; ++copy) {
          bf16[3 * copy] = std::vector<uint16_t>(li.window.size(), 0x7fc1);
          bf16[3 * copy + 1] = std::vector<uint16_t>(li.compressor.entries.size(), 0x7fc1);
          bf16[3 * copy + 2] = std::vector<uint16_t>(li.indexer.entries.size(), 0x7fc1);
          fp32[4 * copy] = std::vector<float>(li.compressor.ring_kv.size(), 0.25f);
          fp32[4 * copy + 1] = std::vector<float>(li.compressor.ring_gate.size(), 0.25f);
          fp32[4 * copy + 2] = std::vector<float>(li.indexer.ring_kv.size(), 0.25f);
          fp32[4 * copy + 3] = std::vector<float>(li.indexer.ring_gate.size(), 0.25f);
          const engine::MutableRingLayerBlocks blocks{
              .window = bf16[3 * copy].data(),
              .compressor = {fp32[4 * copy].data(), fp32[4 * copy + 1].data(),
                             bf16[3 * copy + 1].data()},
              .indexer = {fp32[4 * copy + 2].data(), fp32[4 * copy + 3].data(),
                          bf16[3 * copy + 2].data()}};
          ASSERT_TRUE(paged
                          .LoadLayerRing(static_cast<int64_t>(l), g, position, several.pages,
                                         blocks, copy == 0 ? nullptr : &pool)
                          .ok());
        }
        for (int b = 0; b < 3; ++b) EXPECT_EQ(bf16[b], bf16[3 + b]) << "block " << b;
        for (int b = 0; b < 4; ++b) EXPECT_TRUE(SameFloats(fp32[b], fp32[4 + b])) << "ring " << b;
        // And the import read what was stored: the window's newest row and the last entry.
        if (position > 0) {
          const int64_t row = (position - 1) % g.window * g.head_dim;
          EXPECT_EQ(bf16[0][static_cast<size_t>(row)],
                    Bf16Bits(li.window)[static_cast<size_t>(row)]);
        }
      }
    }
  }
}

// A missing entry page fails the threaded store (OutOfRange, as the one-thread store).
// A layer's blocks as bytes, by PagedState::PageRun::Block.
std::array<std::byte*, 7> BlockBytes(const engine::MutableRingLayerBlocks& b) {
  auto bytes = [](auto* p) { return reinterpret_cast<std::byte*>(p); };
  return {bytes(b.window),
          bytes(b.compressor.entries),
          bytes(b.indexer.entries),
          bytes(b.compressor.ring_kv),
          bytes(b.compressor.ring_gate),
          bytes(b.indexer.ring_kv),
          bytes(b.indexer.ring_gate)};
}

// One layer's blocks filled with one pattern (bf16 0x7fc1, fp32 0.25), writable.
struct FilledLayer {
  explicit FilledLayer(const engine::RingLayerImage& li)
      : window(li.window.size(), 0x7fc1),
        entries(li.compressor.entries.size(), 0x7fc1),
        keys(li.indexer.entries.size(), 0x7fc1),
        kv(li.compressor.ring_kv.size(), 0.25f),
        gate(li.compressor.ring_gate.size(), 0.25f),
        index_kv(li.indexer.ring_kv.size(), 0.25f),
        index_gate(li.indexer.ring_gate.size(), 0.25f) {}
  engine::MutableRingLayerBlocks Blocks() {
    return {.window = window.data(),
            .compressor = {kv.data(), gate.data(), entries.data()},
            .indexer = {index_kv.data(), index_gate.data(), keys.data()}};
  }
  bool operator==(const FilledLayer& o) const {
    return window == o.window && entries == o.entries && keys == o.keys && SameFloats(kv, o.kv) &&
           SameFloats(gate, o.gate) && SameFloats(index_kv, o.index_kv) &&
           SameFloats(index_gate, o.index_gate);
  }
  std::vector<uint16_t> window, entries, keys;
  std::vector<float> kv, gate, index_kv, index_gate;
};

// PlanPageRuns is the byte plan of StoreLayerRing and LoadLayerRing: copying its runs with memcpy
// (what the device copy does, run by run) writes the same page bytes as StoreLayerRing and reads
// back the same blocks as LoadLayerRing, at positions 0 and 1, before and past every ring wrap
// and across entry pages.
TEST(PagedStateTest, PageRunsCopyWhatStoreAndLoadLayerRingCopy) {
  auto f = Load();
  const engine::ModelConfig& config = f->model.config();
  const int64_t total = 48;
  const serving::StateLayout layout = *LayoutForModel(config, 4, serving::ElementType::kBfloat16);
  for (int64_t position : {0, 1, 3, 4, 5, 37, 44, 47}) {
    SCOPED_TRACE(position);
    engine::ModelState state = f->model.NewState();
    if (position > 0) {
      ASSERT_TRUE(f->model.Forward(&state, Tokens(static_cast<int>(position), 8)).ok());
    }
    const engine::RingGeometry geometry = engine::RingGeometryFor(config, total, 4);
    const engine::RingImage image = *engine::RingImageFromState(geometry, state, 0.5f);
    OneSequence stored = Allocate(layout, total);
    OneSequence copied = Allocate(layout, total);
    PagedState paged(config, layout, total);
    for (size_t l = 0; l < image.layers.size(); ++l) {
      SCOPED_TRACE(l);
      const auto layer = static_cast<int64_t>(l);
      const engine::RingLayerGeometry& g = geometry.layers[l];
      const DeviceLayer device(image.layers[l]);
      ASSERT_TRUE(paged.StoreLayerRing(layer, g, device.blocks, position, stored.pages).ok());
      auto runs = paged.PlanPageRuns(layer, g, position);
      ASSERT_TRUE(runs.ok()) << runs.status();
      const engine::RingLayerBlocks& b = device.blocks;
      const std::array<const void*, 7> from = {b.window,
                                               b.compressor.entries,
                                               b.indexer.entries,
                                               b.compressor.ring_kv,
                                               b.compressor.ring_gate,
                                               b.indexer.ring_kv,
                                               b.indexer.ring_gate};
      for (const PagedState::PageRun& run : *runs) {
        const int k = *layout.KindIndex(run.kind);
        std::memcpy(copied.pages.pages[k][run.page].data() + run.page_offset,
                    static_cast<const std::byte*>(from[run.block]) + run.block_offset,
                    static_cast<size_t>(run.bytes));
      }
      // The inverse: the runs read back into filled blocks, against LoadLayerRing.
      FilledLayer loaded(image.layers[l]);
      FilledLayer gathered(image.layers[l]);
      ASSERT_TRUE(paged.LoadLayerRing(layer, g, position, stored.pages, loaded.Blocks()).ok());
      const std::array<std::byte*, 7> to = BlockBytes(gathered.Blocks());
      for (const PagedState::PageRun& run : *runs) {
        const int k = *layout.KindIndex(run.kind);
        std::memcpy(to[run.block] + run.block_offset,
                    stored.pages.pages[k][run.page].data() + run.page_offset,
                    static_cast<size_t>(run.bytes));
      }
      EXPECT_TRUE(gathered == loaded);
    }
    ExpectSamePages(stored.pages, copied.pages);
  }
}

// No two runs of a layer write the same page byte or the same block byte, each stays inside its
// page, and each names a page of LayerPages(layer); LayerPages of all layers is every page of the
// sequence once.
TEST(PagedStateTest, PageRunsAreDisjointAndInsideTheLayersPages) {
  auto f = Load();
  const engine::ModelConfig& config = f->model.config();
  const int64_t total = 48;
  const serving::StateLayout layout = *LayoutForModel(config, 4, serving::ElementType::kBfloat16);
  PagedState paged(config, layout, total);
  const engine::RingGeometry geometry = engine::RingGeometryFor(config, total, 4);
  const serving::PageDemand demand = layout.Demand(total);
  std::vector<std::vector<int>> owners(demand.size());
  for (size_t k = 0; k < demand.size(); ++k) owners[k].assign(static_cast<size_t>(demand[k]), 0);
  for (size_t l = 0; l < geometry.layers.size(); ++l) {
    const auto layer = static_cast<int64_t>(l);
    const std::vector<PagedState::PageId> pages = paged.LayerPages(layer);
    for (const PagedState::PageId& id : pages) {
      ++owners[static_cast<size_t>(*layout.KindIndex(id.kind))][static_cast<size_t>(id.page)];
    }
    for (int64_t position : {0, 1, 5, 37, 47, 48}) {
      SCOPED_TRACE(position);
      auto runs = paged.PlanPageRuns(layer, geometry.layers[l], position);
      ASSERT_TRUE(runs.ok()) << runs.status();
      std::set<std::tuple<int, int64_t, int64_t>> page_bytes;
      std::set<std::pair<int, int64_t>> block_bytes;
      for (const PagedState::PageRun& run : *runs) {
        ASSERT_GT(run.bytes, 0);
        ASSERT_NE(std::find(pages.begin(), pages.end(), PagedState::PageId{run.kind, run.page}),
                  pages.end());
        ASSERT_LE(run.page_offset + run.bytes, layout.Kind(run.kind).page_bytes());
        for (int64_t i = 0; i < run.bytes; i += 2) {
          ASSERT_TRUE(page_bytes.insert({static_cast<int>(run.kind), run.page, run.page_offset + i})
                          .second);
          ASSERT_TRUE(block_bytes.insert({run.block, run.block_offset + i}).second);
        }
      }
    }
  }
  for (size_t k = 0; k < owners.size(); ++k) {
    for (size_t i = 0; i < owners[k].size(); ++i) EXPECT_EQ(owners[k][i], 1) << k << " " << i;
  }
  EXPECT_TRUE(paged.LayerPages(static_cast<int64_t>(geometry.layers.size())).empty());
}

TEST(PagedStateTest, PageRunsRefuseAnFp32LayoutAndALayerOutsideTheModel) {
  auto f = Load();
  const engine::ModelConfig& config = f->model.config();
  const engine::RingGeometry geometry = engine::RingGeometryFor(config, 8, 4);
  const PagedState fp32(config, f->layout, 8);
  EXPECT_TRUE(absl::IsFailedPrecondition(fp32.PlanPageRuns(0, geometry.layers[0], 1).status()));
  const serving::StateLayout layout = *LayoutForModel(config, 4, serving::ElementType::kBfloat16);
  const PagedState bf16(config, layout, 8);
  const auto layers = static_cast<int64_t>(geometry.layers.size());
  EXPECT_TRUE(absl::IsInvalidArgument(bf16.PlanPageRuns(layers, geometry.layers[0], 1).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(bf16.PlanPageRuns(0, geometry.layers[0], 9).status()));
}

TEST(PagedStateTest, StoreLayerRingOnSeveralThreadsRefusesAMissingPage) {
  auto f = Load();
  const engine::ModelConfig& config = f->model.config();
  const int64_t total = 48;
  const serving::StateLayout layout = *LayoutForModel(config, 4, serving::ElementType::kBfloat16);
  OneSequence seq = Allocate(layout, total);
  for (auto& kind : seq.pages.pages) {
    if (kind.size() > 1) kind.pop_back();  // the entry kinds lose their last page
  }
  PagedState paged(config, layout, total);
  engine::ModelState state = f->model.NewState();
  ASSERT_TRUE(f->model.Forward(&state, Tokens(44, 2)).ok());
  const engine::RingGeometry geometry = engine::RingGeometryFor(config, total, 4);
  const engine::RingImage image = *engine::RingImageFromState(geometry, state, 0.5f);
  TaskPool pool(4);
  bool refused = false;
  for (size_t l = 0; l < image.layers.size(); ++l) {
    const DeviceLayer device(image.layers[l]);
    const engine::RingLayerBlocks& blocks = device.blocks;
    const absl::Status status = paged.StoreLayerRing(static_cast<int64_t>(l), geometry.layers[l],
                                                     blocks, 44, seq.pages, &pool);
    if (!status.ok()) {
      EXPECT_TRUE(absl::IsOutOfRange(status)) << status;
      refused = true;
    }
  }
  EXPECT_TRUE(refused);
}

TEST(PagedStateTest, LoadLayerRingRefusesALayerOrPositionOutsideTheSequence) {
  auto f = Load();
  const int64_t total = 8;
  OneSequence seq = Allocate(f->layout, total);
  PagedState paged(f->model.config(), f->layout, total);
  const engine::RingGeometry geometry = engine::RingGeometryFor(f->model.config(), total, 4);
  const engine::MutableRingLayerBlocks none;
  const auto layers = static_cast<int64_t>(geometry.layers.size());
  EXPECT_TRUE(
      absl::IsInvalidArgument(paged.LoadLayerRing(layers, geometry.layers[0], 0, seq.pages, none)));
  EXPECT_TRUE(absl::IsInvalidArgument(
      paged.LoadLayerRing(0, geometry.layers[0], total + 1, seq.pages, none)));
}

TEST(PagedStateTest, StoreBeyondTheSequencesTokensFails) {
  auto f = Load();
  OneSequence seq = Allocate(f->layout, 8);
  PagedState paged(f->model.config(), f->layout, 8);
  engine::ModelState state = f->model.NewState();
  ASSERT_TRUE(f->model.Forward(&state, Tokens(9, 3)).ok());
  const absl::Status status = paged.Store(state, 0, seq.pages);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("outside [0, 8]"), std::string::npos) << status;
}

}  // namespace
}  // namespace pdserve::runtime
