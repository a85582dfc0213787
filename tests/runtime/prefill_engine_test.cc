// runtime::CpuPrefillEngine on the bundled model: chunks cut at absolute multiples of the block,
// every layer handed over once, in order, in the final block; the pages equal the state of
// Model::Forward over the same chunks stored whole; callback errors stop the prefill. Also
// worker::LoadWorkerModel without the CPU engine (what a backend cuda worker loads).
#include "runtime/prefill_engine.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/model.h"
#include "runtime/paged_state.h"
#include "serving/page_pool.h"
#include "worker/worker_model.h"

namespace pdserve::runtime {
namespace {

constexpr char kModelDir[] = PDSERVE_BUNDLED_MODEL;

class CpuPrefillEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = engine::Model::Load(kModelDir);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<engine::Model>(std::move(*model));
    layout_ = std::make_unique<serving::StateLayout>(*runtime::LayoutForModel(config()));
    pool_ = *serving::PagePool::Create(layout_->PoolOptions(2, 2048));
  }
  const engine::ModelConfig& config() const { return model_->config(); }
  std::vector<int32_t> Prompt(int64_t length) const {
    std::vector<int32_t> prompt;
    for (int64_t i = 0; i < length; ++i)
      prompt.push_back(static_cast<int32_t>((i * 37 + 11) % 500));
    return prompt;
  }

  std::unique_ptr<engine::Model> model_;
  std::unique_ptr<serving::StateLayout> layout_;
  std::unique_ptr<serving::PagePool> pool_;
};

TEST_F(CpuPrefillEngineTest, PagesHoldTheChunkedForwardsState) {
  auto engine = CpuPrefillEngine(*model_, 64);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<int32_t> prompt = Prompt(150);
  const int64_t total = 160;
  auto table = *pool_->Allocate(1, layout_->Demand(total));
  auto pages = *runtime::MapPages(*pool_, table);
  const runtime::PagedState paged(config(), *layout_, total);
  std::vector<int64_t> layers;
  std::vector<int64_t> chunks;
  auto logits = (*engine)->Run(
      prompt, paged, pages,
      [&](int64_t layer) {
        EXPECT_EQ(chunks.size(), 2u) << "a layer was handed over outside the final block";
        layers.push_back(layer);
        return absl::OkStatus();
      },
      [&](int64_t tokens) {
        chunks.push_back(tokens);
        return absl::OkStatus();
      });
  ASSERT_TRUE(logits.ok()) << logits.status();
  EXPECT_EQ(chunks, (std::vector<int64_t>{64, 64, 22}));
  ASSERT_EQ(static_cast<int64_t>(layers.size()), config().num_hidden_layers);
  for (size_t l = 0; l < layers.size(); ++l) EXPECT_EQ(layers[l], static_cast<int64_t>(l));

  // The same chunks by hand (each chunk's last logits row only, as the engine asks), the whole
  // state stored at once into a second sequence's pages.
  engine::ModelState state = model_->NewState();
  engine::Tensor direct;
  for (int64_t from = 0; from < 150;) {
    const int64_t to = PrefillBlockEnd(from, 150, 64);
    direct =
        *model_->Forward(&state, std::vector<int32_t>(prompt.begin() + from, prompt.begin() + to),
                         nullptr, engine::ChunkLogits::kLastRow);
    from = to;
  }
  const int64_t vocab = config().vocab_size;
  ASSERT_EQ(direct.dim(0), 1);
  EXPECT_EQ(*logits, std::vector<float>(direct.ptr(), direct.ptr() + vocab));
  auto table2 = *pool_->Allocate(2, layout_->Demand(total));
  auto pages2 = *runtime::MapPages(*pool_, table2);
  ASSERT_TRUE(paged.Store(state, 0, pages2).ok());
  engine::ModelState a = model_->NewState();
  engine::ModelState b = model_->NewState();
  ASSERT_TRUE(paged.Load(150, pages, &a).ok());
  ASSERT_TRUE(paged.Load(150, pages2, &b).ok());
  auto next_a = model_->Forward(&a, {7});
  auto next_b = model_->Forward(&b, {7});
  ASSERT_TRUE(next_a.ok() && next_b.ok());
  EXPECT_EQ(next_a->data, next_b->data);
}

// Progress inside chunks: every layer of every chunk is reported, in order, on the running
// thread, before the chunk's ChunkDone (the router's busy check and the watchdog count it).
TEST_F(CpuPrefillEngineTest, EveryLayerOfEveryChunkIsReportedAsItIsComputed) {
  auto engine = CpuPrefillEngine(*model_, 64);
  ASSERT_TRUE(engine.ok());
  std::vector<int64_t> forwarded;
  std::vector<size_t> forwarded_at_chunk_end;
  (*engine)->set_layer_forwarded([&](int64_t layer) { forwarded.push_back(layer); });
  const std::vector<int32_t> prompt = Prompt(150);
  auto table = *pool_->Allocate(1, layout_->Demand(160));
  auto pages = *runtime::MapPages(*pool_, table);
  const runtime::PagedState paged(config(), *layout_, 160);
  auto logits = (*engine)->Run(
      prompt, paged, pages, [](int64_t) { return absl::OkStatus(); },
      [&](int64_t) {
        forwarded_at_chunk_end.push_back(forwarded.size());
        return absl::OkStatus();
      });
  ASSERT_TRUE(logits.ok()) << logits.status();
  const auto layers = static_cast<size_t>(config().num_hidden_layers);
  ASSERT_EQ(forwarded.size(), 3 * layers);  // chunks of 64, 64, 22 tokens
  for (size_t i = 0; i < forwarded.size(); ++i) {
    EXPECT_EQ(forwarded[i], static_cast<int64_t>(i % layers)) << i;
  }
  EXPECT_EQ(forwarded_at_chunk_end, (std::vector<size_t>{layers, 2 * layers, 3 * layers}));
}

TEST_F(CpuPrefillEngineTest, ACallbackErrorStopsThePrefill) {
  EXPECT_TRUE(absl::IsInvalidArgument(CpuPrefillEngine(*model_, 0).status()));
  auto engine = CpuPrefillEngine(*model_, 64);
  ASSERT_TRUE(engine.ok());
  const std::vector<int32_t> prompt = Prompt(100);
  auto table = *pool_->Allocate(1, layout_->Demand(110));
  auto pages = *runtime::MapPages(*pool_, table);
  const runtime::PagedState paged(config(), *layout_, 110);
  auto ok = [](int64_t) { return absl::OkStatus(); };
  int64_t chunks = 0;
  auto stopped = (*engine)->Run(prompt, paged, pages, ok, [&](int64_t) {
    ++chunks;
    return absl::CancelledError("aborted");
  });
  EXPECT_TRUE(absl::IsCancelled(stopped.status())) << stopped.status();
  EXPECT_EQ(chunks, 1);
  int64_t handed = 0;
  auto layer_failed = (*engine)->Run(
      prompt, paged, pages,
      [&](int64_t) {
        ++handed;
        return absl::UnavailableError("peer gone");
      },
      ok);
  EXPECT_TRUE(absl::IsUnavailable(layer_failed.status())) << layer_failed.status();
  EXPECT_EQ(handed, 1);
  EXPECT_TRUE(absl::IsInvalidArgument((*engine)->Run({}, paged, pages, ok, ok).status()));
  EXPECT_EQ((*engine)->max_context(), config().max_position_embeddings);
}

TEST(LoadWorkerModelTest, WithoutTheCpuEngineLoadsTheConfigOnly) {
  auto full = worker::LoadWorkerModel(kModelDir);
  ASSERT_TRUE(full.ok()) << full.status();
  auto light = worker::LoadWorkerModel(kModelDir, {}, /*cpu_engine=*/false);
  ASSERT_TRUE(light.ok()) << light.status();
  EXPECT_NE(full->model, nullptr);
  EXPECT_EQ(light->model, nullptr);
  EXPECT_EQ(light->config.vocab_size, full->config.vocab_size);
  EXPECT_EQ(light->config.num_hidden_layers, full->config.num_hidden_layers);
  EXPECT_EQ(light->eos_ids, full->eos_ids);
  EXPECT_EQ(light->layers, full->layers);
  EXPECT_EQ(light->layout->Demand(100), full->layout->Demand(100));
}

}  // namespace
}  // namespace pdserve::runtime
