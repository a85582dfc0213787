// The token mask on the bundled model's real tokenizer (models/kjv-v4-tiny): it equals a brute
// force over every token, admits the end ids exactly when the document is complete, and keeps
// every walk through it closable within max_tokens; RequestSampler applies it on random logits.
#include "structured/grammar_constraint.h"

#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "serving/sampler.h"
#include "text/tokenizer.h"

namespace pdserve::structured {
namespace {

using json = nlohmann::json;

struct Bundled {
  std::unique_ptr<text::Tokenizer> tokenizer;
  std::shared_ptr<const TokenVocabulary> vocabulary;
};

const Bundled& Model() {
  static const Bundled* bundled = [] {
    auto* b = new Bundled;
    b->tokenizer = *text::Tokenizer::Load(PDSERVE_BUNDLED_MODEL);
    b->vocabulary = *TokenVocabulary::FromTokenizer(*b->tokenizer);
    return b;
  }();
  return *bundled;
}

// tests/structured/schemas.json: the schemas the router test samples, each {"name", "schema"}.
std::vector<std::string> Schemas() {
  std::ifstream in(PDSERVE_JSON_SCHEMAS);
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::string> out;
  for (const auto& entry : nlohmann::ordered_json::parse(text.str())) {
    out.push_back(entry["schema"].dump());
  }
  return out;
}

bool Bit(const std::vector<uint64_t>& bits, int32_t t) { return (bits[t / 64] >> (t % 64)) & 1; }

constexpr int32_t kEos = 1;  // the bundled model's eos_token_id

TEST(TokenVocabularyTest, BundledVocabularyHasEveryPrintableAsciiByteAsAToken) {
  // The budget rule counts one token per byte of the shortest completion.
  for (int byte = 0x20; byte < 0x7f; ++byte) {
    EXPECT_GE(Model().vocabulary->SingleByteToken(static_cast<uint8_t>(byte)), 0) << byte;
  }
  EXPECT_TRUE(Model().vocabulary->bytes(kEos).empty());  // special: only allowed as an end id
}

// Every token the automaton accepts from the state, by brute force.
std::vector<int32_t> BruteForce(const GrammarMatcher& m) {
  std::vector<int32_t> out;
  for (int32_t t = 0; t < Model().vocabulary->size(); ++t) {
    GrammarMatcher copy = m;
    const std::string& bytes = Model().vocabulary->bytes(t);
    if (!bytes.empty() && copy.Advance(bytes)) out.push_back(t);
  }
  return out;
}

TEST(GrammarConstraintTest, MaskEqualsBruteForceAlongADocumentAndEndsOnlyWhenComplete) {
  const std::string schema = Schemas()[17];  // "event": strings, enums, arrays, anyOf
  const std::string doc =
      R"({"title": "And \"God\" said", "day":3,"participants":[{"name":"Moses","role":"prophet"}],)"
      R"("location":{"lat":31.5,"lon":-35.25}})";
  auto constraint = *GrammarConstraint::ForJsonSchema(schema, Model().vocabulary);
  GrammarMatcher m = constraint->Start();
  const int64_t vocab = Model().vocabulary->size();
  for (size_t i = 0; i <= doc.size(); ++i) {
    std::vector<uint64_t> mask;
    ASSERT_TRUE(constraint->FillMask(m, 1 << 20, {&kEos, 1}, vocab, &mask).ok());
    std::vector<int32_t> allowed;
    for (int32_t t = 0; t < vocab; ++t) {
      if (Bit(mask, t) && t != kEos) allowed.push_back(t);
    }
    EXPECT_EQ(allowed, BruteForce(m)) << "after " << doc.substr(0, i);
    EXPECT_EQ(Bit(mask, kEos), i == doc.size()) << "after " << doc.substr(0, i);
    if (i < doc.size()) {
      ASSERT_TRUE(m.Advance(static_cast<uint8_t>(doc[i]))) << doc.substr(0, i);
    }
  }
}

// Walks of random allowed tokens under a token budget at least the schema's shortest document
// (in bytes): each ends in a complete document that parses, within the budget, for every schema
// of the router test.
TEST(GrammarConstraintTest, RandomWalksThroughTheMaskCloseWithinMaxTokens) {
  std::mt19937 rng(29);
  const int64_t vocab = Model().vocabulary->size();
  for (const std::string& schema : Schemas()) {
    auto constraint = *GrammarConstraint::ForJsonSchema(schema, Model().vocabulary);
    const int64_t shortest = constraint->Start().MinCompletionBytes();
    for (int64_t max_tokens : {shortest, shortest + 8, shortest + 64}) {
      for (int walk = 0; walk < 4; ++walk) {
        GrammarMatcher m = constraint->Start();
        std::string out;
        bool ended = false;
        for (int64_t step = 0; step < max_tokens && !ended; ++step) {
          std::vector<uint64_t> mask;
          ASSERT_TRUE(constraint->FillMask(m, max_tokens - step, {&kEos, 1}, vocab, &mask).ok());
          std::vector<int32_t> allowed;
          for (int32_t t = 0; t < vocab; ++t) {
            if (Bit(mask, t)) allowed.push_back(t);
          }
          const int32_t t = allowed[rng() % allowed.size()];
          if (t == kEos) {
            ended = true;
          } else {
            ASSERT_TRUE(constraint->Accept(m, t));
            out += Model().vocabulary->bytes(t);
          }
        }
        EXPECT_TRUE(m.Complete()) << schema << "\n" << out;
        EXPECT_FALSE(json::parse(out, nullptr, false).is_discarded()) << schema << "\n" << out;
      }
    }
  }
}

// A document the budget closes on its last token ended by the grammar, not by truncation:
// finish "stop" (an OpenAI client's parse() refuses "length"). A number may still grow: "length".
TEST(GrammarConstraintTest, ADocumentClosedOnTheLastAllowedTokenFinishesStop) {
  const int32_t eos[] = {kEos};
  const int64_t vocab = Model().vocabulary->size();
  const auto token = [](char c) { return Model().vocabulary->SingleByteToken(c); };
  serving::SamplingParams params;
  params.temperature = 1.0;
  params.max_tokens = 2;
  params.json_schema = R"({"type": "object"})";
  auto object = serving::RequestSampler::Create(params, "req", eos, std::vector<int32_t>{5}, vocab,
                                                Model().vocabulary);
  ASSERT_TRUE(object.ok()) << object.status();
  EXPECT_EQ(*object->Record(0, token('{')), std::nullopt);
  EXPECT_EQ(*object->Record(0, token('}')), serving::FinishReason::kStop);

  // Cut before the object closes: truncated.
  auto cut = serving::RequestSampler::Create(params, "req", eos, std::vector<int32_t>{5}, vocab,
                                             Model().vocabulary);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(*cut->Record(0, token('{')), std::nullopt);
  EXPECT_EQ(*cut->Record(0, token('"')), serving::FinishReason::kLength);

  params.max_tokens = 1;
  params.json_schema = R"({"type": "integer"})";
  auto number = serving::RequestSampler::Create(params, "req", eos, std::vector<int32_t>{5}, vocab,
                                                Model().vocabulary);
  ASSERT_TRUE(number.ok());
  EXPECT_EQ(*number->Record(0, token('7')), serving::FinishReason::kLength);
}

// The answer opens with the value, never with whitespace, even when the model favours it: every
// token that starts with a whitespace byte gets +20 on random logits, at temperature 1, for
// several seeds and both response_format kinds.
TEST(GrammarConstraintTest, TheFirstTokenOfAConstrainedAnswerIsNotWhitespace) {
  const int32_t eos[] = {kEos};
  const int64_t vocab = Model().vocabulary->size();
  const auto starts_with_space = [](const std::string& bytes) {
    return !bytes.empty() &&
           (bytes[0] == ' ' || bytes[0] == '\n' || bytes[0] == '\t' || bytes[0] == '\r');
  };
  int32_t spaced = 0;
  for (int32_t t = 0; t < vocab; ++t) spaced += starts_with_space(Model().vocabulary->bytes(t));
  ASSERT_GT(spaced, 100);  // the bundled vocabulary has many
  for (const std::string& schema : {std::string(R"({"type": "object"})"), Schemas()[0]}) {
    for (uint64_t seed = 1; seed <= 8; ++seed) {
      SCOPED_TRACE(schema + " seed " + std::to_string(seed));
      serving::SamplingParams params;
      params.temperature = 1.0;
      params.max_tokens = 32;
      params.seed = seed;
      params.json_schema = schema;
      auto sampler = serving::RequestSampler::Create(params, "req", eos, std::vector<int32_t>{5},
                                                     vocab, Model().vocabulary);
      ASSERT_TRUE(sampler.ok()) << sampler.status();
      std::mt19937 rng(static_cast<uint32_t>(seed));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<float> logits(static_cast<size_t>(vocab));
      for (int32_t t = 0; t < vocab; ++t) {
        logits[t] = normal(rng) + (starts_with_space(Model().vocabulary->bytes(t)) ? 20.0f : 0.0f);
      }
      absl::StatusOr<serving::SampleStep> first = sampler->Next(0, logits);
      ASSERT_TRUE(first.ok()) << first.status();
      const std::string bytes = Model().vocabulary->bytes(first->sampled.token);
      EXPECT_FALSE(starts_with_space(bytes)) << "first token " << json(bytes).dump();
      EXPECT_TRUE(bytes.starts_with("{")) << json(bytes).dump();
    }
  }
}

TEST(GrammarConstraintTest, RequestSamplerMasksRandomLogitsAndRecordRefusesOffGrammarTokens) {
  serving::SamplingParams params;
  params.temperature = 1.0;
  params.max_tokens = 64;
  params.n = 2;
  params.json_schema = Schemas()[0];  // person
  const int32_t eos[] = {kEos};
  const int64_t vocab = Model().vocabulary->size();
  auto sampler = serving::RequestSampler::Create(params, "req", eos, std::vector<int32_t>{5}, vocab,
                                                 Model().vocabulary);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::string text;
  for (int step = 0; step < params.max_tokens && !sampler->finished(0); ++step) {
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (float& z : logits) z = normal(rng);
    absl::StatusOr<serving::SampleStep> next = sampler->Next(0, logits);
    ASSERT_TRUE(next.ok()) << next.status();
    if (next->sampled.token != kEos) text += Model().vocabulary->bytes(next->sampled.token);
  }
  const json parsed = json::parse(text, nullptr, false);
  ASSERT_TRUE(parsed.is_object()) << text;
  EXPECT_TRUE(parsed["name"].is_string()) << text;
  EXPECT_TRUE(parsed["age"].is_number_integer()) << text;
  // Choice 1 has read nothing: a token that cannot start the object is refused.
  const int32_t letter = Model().vocabulary->SingleByteToken('a');
  EXPECT_EQ(sampler->Record(1, letter).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(sampler->Record(1, Model().vocabulary->SingleByteToken('{')).ok());
  // Without a vocabulary a json_schema request cannot run.
  EXPECT_EQ(serving::RequestSampler::Create(params, "req", eos, std::vector<int32_t>{5}, vocab)
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pdserve::structured
