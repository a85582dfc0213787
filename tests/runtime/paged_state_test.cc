// PagedState: the engine state stored in pool pages is an exact copy, and pages shipped as bytes to
// a fresh pool continue decoding with bit-identical logits.
#include "runtime/paged_state.h"

#include <cstring>
#include <memory>
#include <vector>

#include "engine/model.h"
#include "gtest/gtest.h"

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

bool SameBits(const engine::Tensor& a, const engine::Tensor& b) {
  return a.shape == b.shape &&
         std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) == 0;
}

void ExpectSameState(const engine::ModelState& a, const engine::ModelState& b) {
  ASSERT_EQ(a.position, b.position);
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t l = 0; l < a.layers.size(); ++l) {
    SCOPED_TRACE(l);
    const engine::LayerState& x = a.layers[l];
    const engine::LayerState& y = b.layers[l];
    EXPECT_TRUE(SameBits(x.window_kv, y.window_kv));
    for (auto [p, q] : {std::pair{&x.compressor, &y.compressor}, {&x.indexer, &y.indexer}}) {
      EXPECT_TRUE(SameBits(p->buffer_kv, q->buffer_kv));
      EXPECT_TRUE(SameBits(p->buffer_gate, q->buffer_gate));
      EXPECT_TRUE(SameBits(p->overlap_kv, q->overlap_kv));
      EXPECT_TRUE(SameBits(p->overlap_gate, q->overlap_gate));
      EXPECT_TRUE(SameBits(p->entries, q->entries));
    }
  }
}

// A pool holding one sequence of `total` tokens, and that sequence's pages.
struct OneSequence {
  std::unique_ptr<serving::PagePool> pool;
  serving::PageTable table;
  SequencePages pages;
};

OneSequence Allocate(const serving::StateLayout& layout, int64_t total) {
  OneSequence s;
  s.pool = *serving::PagePool::Create(layout.PoolOptions(1, total));
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
