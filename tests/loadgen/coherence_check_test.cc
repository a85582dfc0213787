// `pdserve check`'s judgement end to end against fake services: a degenerate one (one tag
// repeated), a varied one, an empty one; and the per-sample measures on hand-made samples.
#include "loadgen/coherence_check.h"

#include <gtest/gtest.h>

#include <limits>

#include "frontend/http_server.h"
#include "tests/loadgen/fake_service.h"

namespace pdserve::loadgen {
namespace {

std::vector<PromptItem> TwoPrompts() {
  PromptItem chat;
  chat.id = "chat";
  chat.messages = nlohmann::json::array(
      {{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "Hi"}}});
  chat.max_tokens = 40;
  PromptItem plain;
  plain.id = "plain";
  plain.prompt = "Write a page";
  plain.max_tokens = 40;
  return {chat, plain};
}

class CheckTest : public ::testing::Test {
 protected:
  absl::StatusOr<CheckReport> RunAgainstService(bool logprobs) {
    frontend::HttpServerOptions opts;
    opts.port = 0;
    auto server = frontend::HttpServer::Start(opts, &service_);
    if (!server.ok()) return server.status();
    CheckOptions o;
    o.url = *ParseEndpointUrl("http://127.0.0.1:" + std::to_string((*server)->port()));
    o.model = "fake";
    o.samples = 3;
    o.logprobs = logprobs;
    o.request_timeout_s = 20;
    auto report = RunCheck(TwoPrompts(), o);
    (*server)->Stop();
    return report;
  }
  FakeTokenService service_;
};

TEST_F(CheckTest, RepeatedTagFails) {
  service_.token_text = [](int) { return std::string("<div>"); };
  auto report = RunAgainstService(/*logprobs=*/true);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->pass);
  ASSERT_EQ(report->prompts.size(), 2u);
  const SampleCheck& s = report->prompts[0].samples[0];
  EXPECT_EQ(s.tokenization, "logprobs");
  EXPECT_EQ(s.max_repeat.ngram, 1);
  EXPECT_EQ(s.max_repeat.repeats, 40);
  EXPECT_FALSE(s.pass);
  ASSERT_TRUE(report->prompts[0].greedy.has_value());
  EXPECT_FALSE(report->prompts[0].greedy->pass);
}

TEST_F(CheckTest, VariedTextPasses) {
  service_.token_text = [](int t) { return " w" + std::to_string(t); };
  auto report = RunAgainstService(/*logprobs=*/true);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->pass) << ToTable(*report);
  const SampleCheck& s = report->prompts[1].samples[2];
  EXPECT_TRUE(s.pass);
  EXPECT_EQ(s.tokens, 40);
  EXPECT_DOUBLE_EQ(s.distinct2, 1.0);
  EXPECT_EQ(s.max_repeat.repeats, 0);
}

TEST_F(CheckTest, CompletionsRefuseChatPrompts) {
  CheckOptions o;
  o.url = *ParseEndpointUrl("http://127.0.0.1:1");  // never contacted
  o.api = Api::kCompletions;
  const absl::StatusOr<CheckReport> report = RunCheck(TwoPrompts(), o);
  EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(report.status().message(),
            "--api completions sends raw text (/v1/completions applies no chat template), and 1 "
            "of 2 prompts are chat messages (chat): use --api chat, or a prompt file of "
            "\"prompt\" lines");
}

// A NaN temperature went out as JSON null, so the server's default sampled and the check passed
// as if it had run at the temperature asked for.
TEST_F(CheckTest, NonFiniteTemperatureIsRefused) {
  CheckOptions o;
  o.url = *ParseEndpointUrl("http://127.0.0.1:1");  // never contacted
  for (double t :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), -1.0}) {
    o.temperature = t;
    const absl::StatusOr<CheckReport> report = RunCheck(TwoPrompts(), o);
    EXPECT_EQ(report.status().code(), absl::StatusCode::kInvalidArgument) << t;
  }
}

TEST_F(CheckTest, EmptyContentFails) {
  service_.token_text = [](int) { return std::string(); };
  auto report = RunAgainstService(/*logprobs=*/false);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->pass);
  const SampleCheck& s = report->prompts[0].samples[0];
  EXPECT_TRUE(s.empty);
  EXPECT_EQ(s.content_bytes, 0);
  EXPECT_EQ(s.reasons.front(), "empty content");
}

RequestSample WithText(std::string text) {
  RequestSample s;
  s.text = std::move(text);
  return s;
}

TEST(AnalyzeSampleTest, WordTokenizationSplitsPunctuationSoTagLoopsShow) {
  std::string html;
  for (int i = 0; i < 12; ++i) html += "<br>";
  const SampleCheck c = AnalyzeSample(WithText("Intro. " + html), {}, std::nullopt);
  EXPECT_EQ(c.tokenization, "words");
  EXPECT_EQ(c.tokens, 2 + 12 * 3);
  EXPECT_EQ(c.max_repeat.ngram, 3);
  EXPECT_EQ(c.max_repeat.repeats, 12);
  EXPECT_FALSE(c.pass);
}

TEST(AnalyzeSampleTest, WhitespaceOnlyAndDistinct2) {
  const SampleCheck blank = AnalyzeSample(WithText(" \n\t "), {}, std::nullopt);
  EXPECT_TRUE(blank.whitespace_only);
  EXPECT_FALSE(blank.pass);
  // Bigrams of a b a b c: (a,b) (b,a) (a,b) (b,c): 3 distinct of 4.
  const SampleCheck mixed = AnalyzeSample(WithText("a b a b c"), {}, std::nullopt);
  EXPECT_DOUBLE_EQ(mixed.distinct2, 0.75);
  EXPECT_TRUE(mixed.pass);
  CheckThresholds strict;
  strict.min_distinct2 = 0.8;
  EXPECT_FALSE(AnalyzeSample(WithText("a b a b c"), strict, std::nullopt).pass);
  EXPECT_FALSE(AnalyzeSample(WithText("a b c"), {}, std::string("zebra")).pass);
}

TEST(AnalyzeSampleTest, OneCopyIsNoRepeat) {
  // w0 recurs once, 32 words later: period 32, one copy and a token.
  std::string text;
  for (int i = 0; i < 32; ++i) text += "w" + std::to_string(i) + " ";
  const SampleCheck c = AnalyzeSample(WithText(text + "w0"), {}, std::nullopt);
  EXPECT_EQ(c.tokens, 33);
  EXPECT_EQ(c.max_repeat.ngram, 0);
  EXPECT_EQ(c.max_repeat.repeats, 0);
  EXPECT_TRUE(c.pass);
  const SampleCheck twice = AnalyzeSample(WithText("a b a b"), {}, std::nullopt);
  EXPECT_EQ(twice.max_repeat.ngram, 2);
  EXPECT_EQ(twice.max_repeat.repeats, 2);
}

RequestSample Refused() {
  RequestSample s;
  s.error_kind = "http_400";
  s.error_detail = R"({"error":{"code":"context_length_exceeded","message":"too long"}})";
  return s;
}

TEST(JudgePromptsTest, PromptWithEveryRequestFailedShowsNothingMeasured) {
  std::vector<PromptItem> prompts(2);
  prompts[0].id = "refused";
  prompts[1].id = "mixed";
  std::string loop;
  for (int i = 0; i < 10; ++i) loop += "x y z ";
  auto report = JudgePrompts(
      prompts, {{Refused(), Refused()}, {Refused(), WithText("a b a b c"), WithText(loop)}},
      {Refused(), std::nullopt}, {});
  ASSERT_TRUE(report.ok()) << report.status();
  const std::string table = ToTable(*report);
  // Columns: prompt result ok/K min-bytes worst-repeat min-dist2 greedy tokens.
  EXPECT_NE(
      table.find("\nrefused                  FAIL        0/2          -              -         -"
                 "    fail -     \n"),
      std::string::npos)
      << table;
  // Over the two measured samples only: 9 bytes ("a b a b c"), the loop's repeat and distinct-2.
  EXPECT_NE(
      table.find("\nmixed                    FAIL        1/3          9     3-gram x10     0.103"
                 "       - words \n"),
      std::string::npos)
      << table;
  const nlohmann::json j = ToJson(*report);
  const nlohmann::json& refused = j["prompts"][0]["samples"][0];
  EXPECT_EQ(refused["request_error"], "http_400");
  EXPECT_TRUE(refused["distinct2"].is_null());
  EXPECT_TRUE(refused["max_repeat"].is_null());
  EXPECT_TRUE(refused["tokens"].is_null());
  EXPECT_EQ(j["prompts"][1]["samples"][1]["distinct2"], 0.75);
}

TEST(JudgePromptsTest, PromptsOverTheContextAreNamedInOneLine) {
  std::vector<PromptItem> prompts(3);
  prompts[0].id = "long";
  prompts[1].id = "fits";
  prompts[2].id = "long-greedy";
  RequestSample other = Refused();
  other.error_detail = R"({"error":{"code":"invalid_value","message":"bad"}})";
  auto report = JudgePrompts(prompts, {{Refused()}, {WithText("a b c"), other}, {WithText("a b")}},
                             {std::nullopt, std::nullopt, Refused()}, {});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->prompts[0].samples[0].request_error_code, "context_length_exceeded");
  EXPECT_EQ(report->prompts[0].samples[0].request_error_message, "too long");
  EXPECT_EQ(ContextLengthSummary(*report),
            "2 of 3 prompts do not fit the model's context (HTTP 400 context_length_exceeded: "
            "long, long-greedy); the server says: \"too long\"");
  report->prompts.erase(report->prompts.begin());
  report->prompts.pop_back();
  EXPECT_EQ(ContextLengthSummary(*report), "");
}

TEST(JudgePromptsTest, FailingFractionAndOverrides) {
  std::vector<PromptItem> prompts(1);
  prompts[0].id = "p";
  std::vector<std::vector<RequestSample>> samples = {
      {WithText("fine words here"), WithText(""), WithText("more fine words"), WithText("ok")}};
  auto strict = JudgePrompts(prompts, samples, {std::nullopt}, {});
  ASSERT_TRUE(strict.ok());
  EXPECT_FALSE(strict->pass);
  prompts[0].extra = {{"thresholds", {{"max_failing_fraction", 0.25}}}};
  auto lenient = JudgePrompts(prompts, samples, {std::nullopt}, {});
  ASSERT_TRUE(lenient.ok());
  EXPECT_TRUE(lenient->pass);
  prompts[0].extra = {{"thresholds", {{"no_such_key", 1}}}};
  EXPECT_EQ(JudgePrompts(prompts, samples, {std::nullopt}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShippedPromptSetsTest, LoadAndCarryValidThresholds) {
  for (const char* name : {"prompts.jsonl", "kjv-prompts.jsonl"}) {
    auto prompts = LoadPromptFile(std::string(PDSERVE_DEPLOY_DIR) + "/check/" + name);
    ASSERT_TRUE(prompts.ok()) << prompts.status();
    EXPECT_GE(prompts->size(), 5u);
    std::vector<std::vector<RequestSample>> samples(prompts->size(), {WithText("a b c d")});
    std::vector<std::optional<RequestSample>> greedy(prompts->size());
    EXPECT_TRUE(JudgePrompts(*prompts, samples, greedy, {}).ok()) << name;
  }
}

}  // namespace
}  // namespace pdserve::loadgen
