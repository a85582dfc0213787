#include "serving/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "serving/philox.h"

namespace pdserve::serving {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

SamplingParams Greedy() {
  SamplingParams params;
  params.temperature = 0.0;
  return params;
}

// A vocabulary of `vocab` logits spread over about [-4, 4] with repeated values (ties).
std::vector<float> SpreadLogits(int vocab) {
  std::vector<float> logits(vocab);
  for (int t = 0; t < vocab; ++t) logits[t] = static_cast<float>((t * 37 % 101) / 12.5 - 4.0);
  return logits;
}

TEST(ProcessLogitsTest, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams params;
  params.repetition_penalty = 2.0;
  const std::vector<int32_t> prompt = {0, 1};
  TokenHistory history(prompt);
  history.Append(2);
  auto z = ProcessLogits(std::vector<float>{2.0f, -1.0f, 0.5f, 3.0f}, params, {}, history);
  ASSERT_TRUE(z.ok()) << z.status();
  // Tokens 0, 1 (prompt) and 2 (generated) are penalized once each; token 3 is untouched.
  EXPECT_THAT(*z, ElementsAre(1.0, -2.0, 0.25, 3.0));
}

TEST(ProcessLogitsTest, PresenceAndFrequencyPenaltiesCountGeneratedTokensOnly) {
  SamplingParams params;
  params.presence_penalty = 0.25;
  params.frequency_penalty = 0.5;
  const std::vector<int32_t> prompt = {3};
  TokenHistory history(prompt);
  for (int32_t token : {0, 0, 1}) history.Append(token);
  auto z = ProcessLogits(std::vector<float>{1.0f, 1.0f, 1.0f, 1.0f}, params, {}, history);
  ASSERT_TRUE(z.ok()) << z.status();
  // Token 0: 1 - 2 * 0.5 - 0.25; token 1: 1 - 0.5 - 0.25; token 3 appears only in the prompt.
  EXPECT_THAT(*z, ElementsAre(-0.25, 0.25, 1.0, 1.0));
}

TEST(ProcessLogitsTest, NegativePenaltiesEncourageRepetition) {
  SamplingParams params;
  params.presence_penalty = -1.0;
  params.frequency_penalty = -0.5;
  TokenHistory history(std::span<const int32_t>{});
  for (int32_t token : {1, 1, 1}) history.Append(token);
  auto z = ProcessLogits(std::vector<float>{0.0f, 0.0f}, params, {}, history);
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_THAT(*z, ElementsAre(0.0, 2.5));
}

TEST(ProcessLogitsTest, LogitBiasAddsBeforeRepetitionPenalty) {
  SamplingParams params;
  params.logit_bias = {{0, 1.0}, {2, -100.0}};
  params.repetition_penalty = 4.0;
  const std::vector<int32_t> prompt = {0};
  const TokenHistory history(prompt);
  auto z = ProcessLogits(std::vector<float>{1.0f, 0.5f, 0.5f}, params, {}, history);
  ASSERT_TRUE(z.ok()) << z.status();
  // Token 0: (1 + 1) / 4.
  EXPECT_THAT(*z, ElementsAre(0.5, 0.5, -99.5));
}

TEST(ProcessLogitsTest, MinTokensMasksEndTokensUntilReached) {
  SamplingParams params;
  params.min_tokens = 2;
  const std::vector<int32_t> end_ids = {1, 2};
  TokenHistory history(std::span<const int32_t>{});
  history.Append(0);
  auto masked = ProcessLogits(std::vector<float>{0.0f, 1.0f, 2.0f}, params, end_ids, history);
  ASSERT_TRUE(masked.ok()) << masked.status();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THAT(*masked, ElementsAre(0.0, -inf, -inf));
  history.Append(0);
  auto open = ProcessLogits(std::vector<float>{0.0f, 1.0f, 2.0f}, params, end_ids, history);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_THAT(*open, ElementsAre(0.0, 1.0, 2.0));
}

TEST(ProcessLogitsTest, NaNLogitIsInvalidArgumentNamingTheToken) {
  const TokenHistory history(std::span<const int32_t>{});
  auto z =
      ProcessLogits(std::vector<float>{0.0f, std::nanf(""), 1.0f}, SamplingParams{}, {}, history);
  EXPECT_EQ(z.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(z.status().message(), HasSubstr("at token 1 of 3"));
}

TEST(SampleTokenTest, GreedyPicksArgmaxAndLowestIdOnTies) {
  const TokenHistory history(std::span<const int32_t>{});
  auto sampled = SampleToken(std::vector<float>{1.0f, 3.0f, 3.0f, 2.0f}, Greedy(), {}, history, {});
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  EXPECT_EQ(sampled->token, 1);
}

TEST(SampleTokenTest, TemperatureBelowEpsilonIsGreedy) {
  SamplingParams params;
  params.temperature = 1e-300;  // z / T would overflow to inf
  const TokenHistory history(std::span<const int32_t>{});
  for (uint32_t position = 0; position < 20; ++position) {
    auto sampled =
        SampleToken(std::vector<float>{1.0f, 3.0f, 2.9f}, params, {}, history, {1, 0, position});
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    EXPECT_EQ(sampled->token, 1);
  }
}

TEST(SampleTokenTest, GreedyFollowsLogitBias) {
  SamplingParams params = Greedy();
  params.logit_bias = {{3, 1.5}};
  const TokenHistory history(std::span<const int32_t>{});
  auto sampled = SampleToken(std::vector<float>{1.0f, 3.0f, 2.0f, 2.0f}, params, {}, history, {});
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  EXPECT_EQ(sampled->token, 3);
}

TEST(SampleTokenTest, LogprobsComeFromTheRawLogits) {
  SamplingParams params = Greedy();
  params.logit_bias = {{2, 10.0}};
  params.logprobs = 2;
  const TokenHistory history(std::span<const int32_t>{});
  const std::vector<float> logits = {std::log(0.5f), std::log(0.25f), std::log(0.25f)};
  auto sampled = SampleToken(logits, params, {}, history, {});
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  // The bias picks token 2, but its reported logprob is the model's: ln 0.25.
  EXPECT_EQ(sampled->token, 2);
  EXPECT_NEAR(sampled->logprob, std::log(0.25), 1e-6);
  ASSERT_EQ(sampled->top_logprobs.size(), 2u);
  EXPECT_EQ(sampled->top_logprobs[0].token, 0);
  EXPECT_NEAR(sampled->top_logprobs[0].logprob, std::log(0.5), 1e-6);
  EXPECT_EQ(sampled->top_logprobs[1].token, 1);  // tie with token 2: lower id first
  EXPECT_NEAR(sampled->top_logprobs[1].logprob, std::log(0.25), 1e-6);
}

TEST(SampleTokenTest, EveryTokenMaskedIsFailedPrecondition) {
  SamplingParams params;
  params.min_tokens = 1;
  const std::vector<int32_t> end_ids = {0, 1};
  const TokenHistory history(std::span<const int32_t>{});
  auto sampled = SampleToken(std::vector<float>{0.0f, 0.0f}, params, end_ids, history, {});
  EXPECT_EQ(sampled.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SampleTokenTest, SameKeyGivesSameTokenRegardlessOfCallOrder) {
  SamplingParams params;
  params.temperature = 1.0;
  params.top_p = 0.9;
  const std::vector<float> logits = SpreadLogits(1000);
  const TokenHistory history(std::span<const int32_t>{});
  std::vector<SampleKey> keys;
  for (uint32_t choice = 0; choice < 4; ++choice) {
    for (uint32_t position = 0; position < 50; ++position) keys.push_back({99, choice, position});
  }
  std::vector<int32_t> forward;
  for (const SampleKey& key : keys)
    forward.push_back(SampleToken(logits, params, {}, history, key)->token);
  std::vector<int32_t> backward(keys.size());
  for (size_t i = keys.size(); i-- > 0;) {
    backward[i] = SampleToken(logits, params, {}, history, keys[i])->token;
  }
  EXPECT_EQ(forward, backward);
  // The stream is not constant: the keys draw many different tokens.
  EXPECT_GT(std::set<int32_t>(forward.begin(), forward.end()).size(), 20u);
}

// The same filters and draw over a fully sorted candidate list: checks that sorting lazily never
// changes the token.
int32_t ReferenceDraw(const std::vector<float>& logits, const SamplingParams& params, double u) {
  std::vector<double> z(logits.begin(), logits.end());
  for (double& value : z) value /= params.temperature;
  std::vector<int32_t> order(z.size());
  for (size_t t = 0; t < z.size(); ++t) order[t] = static_cast<int32_t>(t);
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  const double max_z = z[order[0]];
  auto w = [&](int32_t t) { return std::exp(z[t] - max_z); };
  double total = 0.0;
  for (size_t t = 0; t < z.size(); ++t) total += w(static_cast<int32_t>(t));
  auto keep = [&](size_t n) {
    if (n >= order.size()) return;
    order.resize(n);
    total = 0.0;
    for (int32_t t : order) total += w(t);
  };
  if (params.top_k > 0) keep(static_cast<size_t>(params.top_k));
  double cumulative = 0.0;
  for (size_t i = 0; params.top_p < 1.0 && i < order.size(); ++i) {
    cumulative += w(order[i]);
    if (cumulative >= params.top_p * total) {
      keep(i + 1);
      break;
    }
  }
  size_t above = 1;
  while (above < order.size() && w(order[above]) >= params.min_p) ++above;
  keep(above);
  cumulative = 0.0;
  for (int32_t t : order) {
    cumulative += w(t);
    if (cumulative > u * total) return t;
  }
  return order.back();
}

TEST(SampleTokenTest, LazySortingMatchesAFullSort) {
  const std::vector<float> logits = SpreadLogits(5000);
  const TokenHistory history(std::span<const int32_t>{});
  for (const auto& [top_k, top_p, min_p] : std::vector<std::tuple<int, double, double>>{
           {0, 1.0, 0.0}, {0, 0.5, 0.0}, {700, 0.95, 0.0}, {0, 1.0, 0.05}, {50, 0.99, 0.01}}) {
    SamplingParams params;
    params.temperature = 0.8;
    params.top_k = top_k;
    params.top_p = top_p;
    params.min_p = min_p;
    for (uint32_t position = 0; position < 200; ++position) {
      const SampleKey key = {5, 0, position};
      auto sampled = SampleToken(logits, params, {}, history, key);
      ASSERT_TRUE(sampled.ok()) << sampled.status();
      const double u = PhiloxUniform({position, 0, 0, 0}, {5, 0});
      ASSERT_EQ(sampled->token, ReferenceDraw(logits, params, u))
          << "top_k " << top_k << " top_p " << top_p << " min_p " << min_p << " pos " << position;
    }
  }
}

TEST(RequestSamplerTest, ChoicesWithOneSeedAreDistinct) {
  SamplingParams params;
  params.temperature = 1.0;
  params.seed = 7;
  params.n = 4;
  params.max_tokens = 8;
  const std::vector<int32_t> prompt = {1, 2, 3};
  auto sampler = RequestSampler::Create(params, "req", {}, prompt, 1000);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const std::vector<float> logits = SpreadLogits(1000);
  std::set<std::vector<int32_t>> sequences;
  for (int32_t choice = 0; choice < params.n; ++choice) {
    for (int i = 0; i < params.max_tokens; ++i) ASSERT_TRUE(sampler->Next(choice, logits).ok());
    const auto generated = sampler->history(choice).generated();
    sequences.emplace(generated.begin(), generated.end());
  }
  EXPECT_EQ(sequences.size(), 4u);
}

TEST(RequestSamplerTest, SameSeedReproducesAcrossRequestsAndNoSeedDependsOnId) {
  SamplingParams params;
  params.temperature = 1.0;
  params.max_tokens = 16;
  const std::vector<int32_t> prompt = {5};
  const std::vector<float> logits = SpreadLogits(1000);
  auto run = [&](const SamplingParams& p, const char* id) {
    auto sampler = RequestSampler::Create(p, id, {}, prompt, 1000);
    EXPECT_TRUE(sampler.ok()) << sampler.status();
    std::vector<int32_t> tokens;
    for (int i = 0; i < p.max_tokens; ++i)
      tokens.push_back(sampler->Next(0, logits)->sampled.token);
    return tokens;
  };
  EXPECT_NE(run(params, "a"), run(params, "b"));
  EXPECT_EQ(run(params, "a"), run(params, "a"));
  params.seed = 3;
  EXPECT_EQ(run(params, "a"), run(params, "b"));
}

TEST(RequestSamplerTest, RecordedFirstTokenContinuesTheSameStream) {
  SamplingParams params;
  params.temperature = 1.0;
  params.n = 2;
  params.max_tokens = 6;
  const std::vector<int32_t> prompt = {4, 5, 6};
  const std::vector<float> logits = SpreadLogits(1000);
  // Colocated: one sampler draws every token. PD: the prefill worker draws the first token and the
  // decode worker records it, then draws the rest.
  auto colocated = RequestSampler::Create(params, "req-9", {}, prompt, 1000);
  auto prefill = RequestSampler::Create(params, "req-9", {}, prompt, 1000);
  auto decode = RequestSampler::Create(params, "req-9", {}, prompt, 1000);
  ASSERT_TRUE(colocated.ok() && prefill.ok() && decode.ok());
  for (int32_t choice = 0; choice < params.n; ++choice) {
    std::vector<int32_t> expected;
    for (int i = 0; i < params.max_tokens; ++i) {
      expected.push_back(colocated->Next(choice, logits)->sampled.token);
    }
    const int32_t first = prefill->Next(choice, logits)->sampled.token;
    ASSERT_TRUE(decode->Record(choice, first).ok());
    std::vector<int32_t> actual = {first};
    for (int i = 1; i < params.max_tokens; ++i) {
      actual.push_back(decode->Next(choice, logits)->sampled.token);
    }
    EXPECT_EQ(actual, expected) << "choice " << choice;
  }
  EXPECT_EQ(decode->Record(0, 1).status().code(), absl::StatusCode::kFailedPrecondition);
}

// min_tokens with end ids covering the vocabulary could never sample a token: the request
// preparer and the decode worker's Reserve refuse it up front with this check (a sampler made
// anyway fails its first step with FailedPrecondition 'every token is masked', which the PD
// fault tests use to fail a prefill after it connected).
TEST(RequestSamplerTest, MinTokensWithEveryTokenAnEndIdIsRefused) {
  SamplingParams params = Greedy();
  params.min_tokens = 1;
  params.max_tokens = 5;
  params.stop_token_ids = {0, 1, 2};
  const std::vector<int32_t> eos = {3};
  const std::vector<int32_t> prompt = {0};
  const absl::Status refused = CheckMinTokensReachable(params, eos, 4);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("every token is masked"), std::string::npos) << refused;
  auto sampler = RequestSampler::Create(params, "r", eos, prompt, 4);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 1.5f};
  EXPECT_EQ(sampler->Next(0, logits).status().code(), absl::StatusCode::kFailedPrecondition);
  // One token left (the eos is not an end id with ignore_eos, or not every id is listed), or
  // no min_tokens: fine.
  params.ignore_eos = true;
  EXPECT_TRUE(CheckMinTokensReachable(params, eos, 4).ok());
  EXPECT_TRUE(RequestSampler::Create(params, "r", eos, prompt, 4).ok());
  params.ignore_eos = false;
  params.stop_token_ids = {0, 1, 1};
  EXPECT_TRUE(CheckMinTokensReachable(params, eos, 4).ok());
  params.stop_token_ids = {0, 1, 2};
  params.min_tokens = 0;
  EXPECT_TRUE(CheckMinTokensReachable(params, eos, 4).ok());
}

TEST(RequestSamplerTest, StopTokenFinishesWithStopAfterMinTokens) {
  SamplingParams params = Greedy();
  params.stop_token_ids = {2};
  params.min_tokens = 1;
  params.max_tokens = 5;
  const std::vector<int32_t> eos = {3};
  const std::vector<int32_t> prompt = {0};
  auto sampler = RequestSampler::Create(params, "r", eos, prompt, 4);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, 1.5f};
  auto first = sampler->Next(0, logits);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->sampled.token, 1);  // 2 and 3 are masked by min_tokens
  EXPECT_FALSE(first->finish.has_value());
  auto second = sampler->Next(0, logits);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->sampled.token, 2);
  EXPECT_EQ(second->finish, FinishReason::kStop);
  EXPECT_EQ(sampler->Next(0, logits).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(RequestSamplerTest, IgnoreEosSamplesEosAsATokenAndStopIdsStillStop) {
  SamplingParams params = Greedy();
  params.ignore_eos = true;
  params.stop_token_ids = {2};
  params.min_tokens = 1;
  params.max_tokens = 5;
  const std::vector<int32_t> eos = {3};
  const std::vector<int32_t> prompt = {0};
  auto sampler = RequestSampler::Create(params, "r", eos, prompt, 4);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  // EOS (3) is the most likely token: taken (not masked by min_tokens) and it does not end.
  const std::vector<float> eos_first = {0.0f, 1.0f, 2.0f, 3.0f};
  auto first = sampler->Next(0, eos_first);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->sampled.token, 3);
  EXPECT_FALSE(first->finish.has_value());
  auto second = sampler->Next(0, eos_first);
  EXPECT_EQ(second->sampled.token, 3);
  EXPECT_FALSE(second->finish.has_value());
  // The stop id still ends the choice.
  auto third = sampler->Next(0, std::vector<float>{0.0f, 1.0f, 4.0f, 3.0f});
  EXPECT_EQ(third->sampled.token, 2);
  EXPECT_EQ(third->finish, FinishReason::kStop);
}

TEST(RequestSamplerTest, MaxTokensFinishesWithLength) {
  SamplingParams params = Greedy();
  params.max_tokens = 2;
  const std::vector<int32_t> prompt = {0};
  auto sampler = RequestSampler::Create(params, "r", {}, prompt, 2);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  const std::vector<float> logits = {0.0f, 1.0f};
  EXPECT_FALSE(sampler->Next(0, logits)->finish.has_value());
  EXPECT_EQ(sampler->Next(0, logits)->finish, FinishReason::kLength);
}

TEST(RequestSamplerTest, RejectsPromptTokenOutsideVocabulary) {
  const std::vector<int32_t> prompt = {0, 9};
  auto sampler = RequestSampler::Create(SamplingParams{}, "r", {}, prompt, 5);
  EXPECT_EQ(sampler.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sampler.status().message(), "prompt token id 9 is outside the vocabulary [0, 5)");
}

}  // namespace
}  // namespace pdserve::serving
