// The incremental state reproduces the one-shot forward: chunked prefill and token-by-token decode
// give the same logits as a single Forward over the whole sequence, on a random tiny model whose
// sequence is long enough for the sliding window to slide, the HCA and CSA compressors to close
// several windows and the indexer's top-k to drop entries.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "engine/model.h"
#include "engine/random_weights.h"
#include "engine/score.h"
#include "tests/engine/logit_compare.h"
#include "tests/engine/tiny_config.h"

namespace pdserve::engine {
namespace {

constexpr int64_t kLength = 41;

std::vector<int32_t> RandomTokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  for (auto& t : tokens) t = id(rng);
  return tokens;
}

class IncrementalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const ModelConfig config = testing::TinyConfig();
    auto model = Model::FromWeights(config, RandomWeights(config, 7));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<Model>(*std::move(model));
    tokens_ = RandomTokens(kLength, config.vocab_size, 11);
    ModelState state = model_->NewState();
    auto logits = model_->Forward(&state, tokens_);
    ASSERT_TRUE(logits.ok()) << logits.status();
    one_shot_ = *std::move(logits);
  }

  // Runs the sequence in chunks of the given sizes (the last one repeating).
  Tensor RunChunked(const std::vector<int64_t>& sizes) {
    auto logits = ScoreInChunks(*model_, tokens_, sizes);
    EXPECT_TRUE(logits.ok()) << logits.status();
    return logits.ok() ? *std::move(logits) : Tensor();
  }

  void ExpectMatchesOneShot(const Tensor& got) {
    ASSERT_EQ(got.shape, one_shot_.shape);
    const auto d =
        testing::CompareLogits(got.ptr(), one_shot_.ptr(), kLength, model_->config().vocab_size);
    EXPECT_LE(d.worst_relative, 1e-5) << "worst position " << d.worst_position;
    EXPECT_EQ(d.argmax_mismatches, 0);
  }

  std::unique_ptr<Model> model_;
  std::vector<int32_t> tokens_;
  Tensor one_shot_;
};

TEST_F(IncrementalTest, TokenByTokenDecodeEqualsOneShot) { ExpectMatchesOneShot(RunChunked({1})); }

TEST_F(IncrementalTest, ChunkedPrefillEqualsOneShot) {
  ExpectMatchesOneShot(RunChunked({3}));
  ExpectMatchesOneShot(RunChunked({5, 2, 7, 1, 6, 3, 9}));
  ExpectMatchesOneShot(RunChunked({4, 8}));
}

TEST_F(IncrementalTest, PrefillThenDecodeEqualsOneShot) {
  ExpectMatchesOneShot(
      RunChunked({17, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}));
}

TEST_F(IncrementalTest, CopiedStateResumesExactly) {
  // The state is plain data: a copy taken after prefill (as a prefill worker ships it to a decode
  // worker) continues the sequence like the original.
  ModelState prefilled = model_->NewState();
  const std::vector<int32_t> prompt(tokens_.begin(), tokens_.begin() + 18);
  ASSERT_TRUE(model_->Forward(&prefilled, prompt).ok());
  ModelState shipped = prefilled;
  prefilled = model_->NewState();  // the original is gone
  const int64_t vocab = model_->config().vocab_size;
  for (int64_t t = 18; t < kLength; ++t) {
    auto logits = model_->Forward(&shipped, {tokens_[t]});
    ASSERT_TRUE(logits.ok());
    const auto d = testing::CompareLogits(logits->ptr(), one_shot_.ptr() + t * vocab, 1, vocab);
    EXPECT_LE(d.worst_relative, 1e-5) << "position " << t;
  }
}

// ChunkLogits::kLastRow: one row, the chunk's last token's, equal to that row of the one-shot
// forward (within the 1e-5 of the chunked runs: a one-row head is a matrix-vector product, the
// all-rows head a matrix product, so the sums may round differently), and the state advanced
// exactly as with every row (the next chunk's logits are the one-shot's).
TEST_F(IncrementalTest, LastRowLogitsAreTheOneShotsLastRow) {
  const int64_t vocab = model_->config().vocab_size;
  ModelState state = model_->NewState();
  int64_t at = 0;
  for (const int64_t size : {int64_t{1}, int64_t{3}, int64_t{17}, kLength - 21}) {
    const std::vector<int32_t> chunk(tokens_.begin() + at, tokens_.begin() + at + size);
    auto logits = model_->Forward(&state, chunk, nullptr, ChunkLogits::kLastRow);
    ASSERT_TRUE(logits.ok()) << logits.status();
    ASSERT_EQ(logits->shape, (std::vector<int64_t>{1, vocab})) << "chunk of " << size;
    at += size;
    const auto d =
        testing::CompareLogits(logits->ptr(), one_shot_.ptr() + (at - 1) * vocab, 1, vocab);
    EXPECT_LE(d.worst_relative, 1e-5) << "position " << at - 1;
    EXPECT_EQ(d.argmax_mismatches, 0) << "position " << at - 1;
  }
  EXPECT_EQ(at, kLength);
  EXPECT_EQ(state.position, kLength);
}

TEST_F(IncrementalTest, StateHasDocumentedShapes) {
  ModelState state = model_->NewState();
  ASSERT_TRUE(model_->Forward(&state, tokens_).ok());
  const ModelConfig& c = model_->config();
  const int64_t p = kLength;
  for (const LayerState& layer : state.layers) {
    EXPECT_EQ(layer.window_kv.shape, (std::vector<int64_t>{c.sliding_window - 1, c.head_dim}));
  }
  // Layer 1 is CSA (m = 4), layer 2 HCA (m = 8).
  const LayerState& csa = state.layers[1];
  EXPECT_EQ(csa.compressor.entries.shape, (std::vector<int64_t>{p / 4, c.head_dim}));
  EXPECT_EQ(csa.compressor.buffer_kv.shape, (std::vector<int64_t>{p % 4, 2 * c.head_dim}));
  EXPECT_EQ(csa.compressor.overlap_kv.shape, (std::vector<int64_t>{4, c.head_dim}));
  EXPECT_EQ(csa.indexer.entries.shape, (std::vector<int64_t>{p / 4, c.index_head_dim}));
  const LayerState& hca = state.layers[2];
  EXPECT_EQ(hca.compressor.entries.shape, (std::vector<int64_t>{p / 8, c.head_dim}));
  EXPECT_EQ(hca.compressor.buffer_kv.shape, (std::vector<int64_t>{p % 8, c.head_dim}));
  EXPECT_EQ(hca.compressor.overlap_kv.dim(0), 0);
}

TEST_F(IncrementalTest, RejectsBadTokensWithoutTouchingState) {
  ModelState state = model_->NewState();
  EXPECT_FALSE(model_->Forward(&state, {}).ok());
  EXPECT_FALSE(model_->Forward(&state, {1, 64}).ok());
  EXPECT_FALSE(model_->Forward(&state, {-1}).ok());
  EXPECT_EQ(state.position, 0);
  EXPECT_EQ(state.layers[0].window_kv.dim(0), 0);
}

TEST_F(IncrementalTest, ScoreInChunksRejectsBadChunking) {
  EXPECT_FALSE(ScoreInChunks(*model_, tokens_, {}).ok());
  EXPECT_FALSE(ScoreInChunks(*model_, tokens_, {3, 0}).ok());
  EXPECT_FALSE(ScoreInChunks(*model_, {}, {1}).ok());
}

TEST_F(IncrementalTest, DifferentWeightsChangeLogits) {
  // Guards the equality tests above against a forward pass that ignores its inputs.
  const ModelConfig config = testing::TinyConfig();
  auto other = Model::FromWeights(config, RandomWeights(config, 8));
  ASSERT_TRUE(other.ok());
  ModelState state = other->NewState();
  auto logits = other->Forward(&state, tokens_);
  ASSERT_TRUE(logits.ok());
  const auto d = testing::CompareLogits(logits->ptr(), one_shot_.ptr(), kLength, config.vocab_size);
  EXPECT_GT(d.worst_relative, 1e-2);
}

}  // namespace
}  // namespace pdserve::engine
