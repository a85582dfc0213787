// The guards wired into EngineStepRunner (issue 9): paranoid mode catches a sequence whose pages
// were freed and reallocated to another request between two steps, and the canary catches a
// sequence whose state was corrupted in its pages, while passing an intact one.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/model.h"
#include "gtest/gtest.h"
#include "guards/page_ownership.h"
#include "runtime/step_runner.h"

namespace pdserve::runtime {
namespace {

constexpr char kModelDir[] = PDSERVE_BUNDLED_MODEL;

const engine::Model& BundledModel() {
  static const engine::Model* model = new engine::Model(*engine::Model::Load(kModelDir));
  return *model;
}

// One sequence driven by hand-built step plans over a pool with room for two sequences.
class OneSequence {
 public:
  OneSequence(bool paranoid, bool canary, int64_t max_tokens)
      : layout_(*LayoutForModel(BundledModel().config())), max_tokens_(max_tokens) {
    pool_ = *serving::PagePool::Create(layout_.PoolOptions(2, 2 * kTotal));
    RunnerOptions options;
    options.paranoid = paranoid;
    runner_ = std::make_unique<EngineStepRunner>(BundledModel(), layout_, pool_.get(), options);
    serving::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = static_cast<int32_t>(max_tokens);
    auto sampler = serving::RequestSampler::Create(params, "req-guards", std::vector<int32_t>{},
                                                   prompt_, BundledModel().config().vocab_size);
    EXPECT_TRUE(sampler.ok()) << sampler.status();
    auto context = std::make_shared<RequestContext>(std::move(*sampler));
    context->on_token = [this](const TokenEvent& event) {
      tokens_.push_back(event.sampled.token);
      return false;
    };
    context->on_error = [this](int32_t, const absl::Status& status) { errors_.push_back(status); };
    SequenceSetup setup{context, 0, prompt_, max_tokens};
    setup.canary = canary;
    EXPECT_TRUE(runner_->Add(kId, std::move(setup)).ok());
    EXPECT_TRUE(pool_->Allocate(kId, layout_.Demand(kTotal)).ok());
    // Another request holds the rest of the pool, so pages freed by kId are the only free ones.
    EXPECT_TRUE(pool_->Allocate(kFiller, layout_.Demand(kTotal)).ok());
  }

  // Prefill of the whole prompt, which samples the first token.
  void Prefill() {
    serving::StepPlan plan;
    plan.prefill.push_back({kId, 0, static_cast<int64_t>(prompt_.size()), true});
    ASSERT_TRUE(runner_->Run(plan).ok());
  }
  void Decode() {
    serving::StepPlan plan;
    plan.decode.push_back({kId, static_cast<int64_t>(prompt_.size() + tokens_.size()) - 1});
    ASSERT_TRUE(runner_->Run(plan).ok());
  }

  serving::PagePool& pool() { return *pool_; }
  const EngineStepRunner& runner() const { return *runner_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  const std::vector<absl::Status>& errors() const { return errors_; }

  static constexpr serving::RequestId kId = 7;
  static constexpr serving::RequestId kFiller = 99;
  static constexpr int64_t kTotal = 96;

 private:
  serving::StateLayout layout_;
  int64_t max_tokens_;
  // 40 tokens: past the first CSA windows, so the indexer and compressed entries are in play.
  std::vector<int32_t> prompt_ = {0,  311,  92, 47,  1203, 5,  88,  19,  640, 33, 12, 901, 7,  45,
                                  66, 2048, 3,  17,  250,  99, 31,  400, 8,   77, 14, 555, 21, 64,
                                  9,  128,  6,  300, 42,   11, 700, 23,  15,  81, 36, 1000};
  std::unique_ptr<serving::PagePool> pool_;
  std::unique_ptr<EngineStepRunner> runner_;
  std::vector<int32_t> tokens_;
  std::vector<absl::Status> errors_;
};

// Frees the sequence's pages and gives them to another request (the pool holds no other free
// pages), then gives the sequence the filler's pages: the pool is consistent, but the sequence's
// pinned pages now belong to request 1007. Returns that request's table.
serving::PageTable ReallocateUnderneath(serving::PagePool& pool,
                                        const serving::PageDemand& demand) {
  const serving::PageTable mine = *pool.Table(OneSequence::kId);
  EXPECT_TRUE(pool.Free(mine).ok());
  absl::StatusOr<serving::PageTable> other = pool.Allocate(OneSequence::kId + 1000, demand);
  EXPECT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->pages[0][0].page, mine.pages[0][0].page);  // the very same page
  EXPECT_TRUE(pool.Free(*pool.Table(OneSequence::kFiller)).ok());
  EXPECT_TRUE(pool.Allocate(OneSequence::kId, demand).ok());
  return *other;
}

TEST(RunnerParanoidTest, PagesReallocatedBetweenStepsFailTheSequence) {
  OneSequence seq(/*paranoid=*/true, /*canary=*/false, 8);
  seq.Prefill();
  seq.Decode();
  ASSERT_TRUE(seq.errors().empty());
  ASSERT_EQ(seq.tokens().size(), 2u);
  const serving::StateLayout layout = *LayoutForModel(BundledModel().config());
  ReallocateUnderneath(seq.pool(), layout.Demand(OneSequence::kTotal));
  seq.Decode();
  ASSERT_EQ(seq.errors().size(), 1u);
  EXPECT_TRUE(guards::IsPageIsolationError(seq.errors()[0])) << seq.errors()[0];
  EXPECT_NE(seq.errors()[0].message().find("before load"), std::string::npos);
  EXPECT_NE(seq.errors()[0].message().find("owned by request 1007"), std::string::npos)
      << seq.errors()[0];
  EXPECT_EQ(seq.tokens().size(), 2u);  // nothing was sampled from the foreign pages
  EXPECT_EQ(seq.runner().guard_counts().isolation_errors, 1);
}

TEST(RunnerParanoidTest, WithoutParanoidTheSameReallocationGoesUnnoticed) {
  // The reason paranoid mode exists: the plain runner maps the owner's current table, which is
  // consistent, and decodes from state that is not the sequence's.
  OneSequence seq(/*paranoid=*/false, /*canary=*/false, 8);
  seq.Prefill();
  seq.Decode();
  const serving::StateLayout layout = *LayoutForModel(BundledModel().config());
  ReallocateUnderneath(seq.pool(), layout.Demand(OneSequence::kTotal));
  seq.Decode();
  EXPECT_TRUE(seq.errors().empty());
  EXPECT_EQ(seq.tokens().size(), 3u);
  EXPECT_EQ(seq.runner().guard_counts().isolation_errors, 0);
}

TEST(RunnerCanaryTest, IntactSequencePasses) {
  OneSequence seq(/*paranoid=*/true, /*canary=*/true, 6);
  seq.Prefill();
  for (int i = 0; i < 5; ++i) seq.Decode();
  EXPECT_TRUE(seq.errors().empty());
  EXPECT_EQ(seq.tokens().size(), 6u);
  EXPECT_EQ(seq.runner().guard_counts().canary_checks, 1);  // at the last token only
  EXPECT_EQ(seq.runner().guard_counts().canary_mismatches, 0);
}

TEST(RunnerCanaryTest, CorruptedStateFailsTheLastToken) {
  OneSequence seq(/*paranoid=*/true, /*canary=*/true, 6);
  seq.Prefill();
  // Overwrite every window page of the sequence with another value: what a stray write from a
  // transfer or a kernel into this sequence's pages would do. Owners and epochs are untouched, so
  // paranoid mode cannot see it; the canary must.
  absl::StatusOr<serving::PageTable> table = seq.pool().Table(OneSequence::kId);
  ASSERT_TRUE(table.ok());
  for (const serving::PageHandle& page : table->pages[0]) {
    absl::StatusOr<std::span<std::byte>> bytes = seq.pool().Data(OneSequence::kId, page);
    ASSERT_TRUE(bytes.ok());
    std::vector<float> values(bytes->size() / sizeof(float), 0.5f);
    std::memcpy(bytes->data(), values.data(), bytes->size());
  }
  for (int i = 0; i < 5; ++i) seq.Decode();
  ASSERT_EQ(seq.errors().size(), 1u);
  EXPECT_NE(seq.errors()[0].message().find("canary mismatch"), std::string::npos)
      << seq.errors()[0];
  EXPECT_EQ(seq.tokens().size(), 5u);  // the last token was withheld
  EXPECT_EQ(seq.runner().guard_counts().canary_mismatches, 1);
}

}  // namespace
}  // namespace pdserve::runtime
