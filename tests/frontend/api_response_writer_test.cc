// FullResponse writes the non-streamed body straight into a string; it must give the same bytes
// as the JSON tree it replaced (FullResponseTree), on responses of every shape: both endpoints,
// logprobs on / off / empty, raw bytes fields, partial and invalid UTF-8, escapes, n > 1, tool
// calls, reasoning, degeneration, unfinished choices.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "frontend/api_response.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {
namespace {

// Token texts that exercise the serializer: ASCII, escapes and control bytes, multi-byte UTF-8,
// a lone continuation byte and a cut 3-byte sequence (replaced by U+FFFD), empty.
const std::vector<std::string> kTexts = {"the",
                                         " God",
                                         "\"quoted\\",
                                         "tab\tnew\nline\r",
                                         std::string("nul\0x", 5),
                                         "\x01\x1f",
                                         "caf\xc3\xa9",
                                         "\xe4\xb8\xad\xe6\x96\x87",
                                         "\xf0\x9f\x98\x80",
                                         "\x80",
                                         "\xe4\xb8",
                                         "",
                                         "\xef\xbd\x9c",
                                         "</think>",
                                         "<\xef\xbd\x9c"
                                         "Assistant\xef\xbd\x9c>",
                                         "\x7f"};

const std::vector<float> kLogprobs = {
    0.0f,        -0.0f, -1e-8f, -0.693147f, -12.5f, -1e30f, -std::numeric_limits<float>::infinity(),
    -3.40282e38f};

class Generator {
 public:
  explicit Generator(uint32_t seed) : rng_(seed) {}
  int Int(int n) { return static_cast<int>(rng_() % static_cast<uint32_t>(n)); }
  const std::string& Text() {
    return kTexts[static_cast<size_t>(Int(static_cast<int>(kTexts.size())))];
  }
  float Logprob() {
    if (Int(2) == 0) return kLogprobs[static_cast<size_t>(Int(static_cast<int>(kLogprobs.size())))];
    return -static_cast<float>(rng_() % 100000) / 997.0f;
  }

  TokenLogprob Token(int top) {
    TokenLogprob lp{Text(), Logprob(), {}};
    if (Int(4) == 0) lp.bytes = Text();
    for (int i = 0; i < top; ++i) {
      // Repeated texts: completions' dicts keep the first (best).
      lp.top.emplace_back(Int(5) == 0 && !lp.top.empty() ? lp.top.front().first : Text(),
                          Logprob());
    }
    if (Int(2) == 0) {
      for (int i = 0; i < top; ++i) lp.top_bytes.push_back(Int(3) == 0 ? Text() : "");
      if (Int(2) == 0 && !lp.top_bytes.empty()) lp.top_bytes.pop_back();
    }
    return lp;
  }

  ChoiceDelta Choice(int index, bool chat, int top) {
    ChoiceDelta d;
    d.index = index;
    const int tokens = Int(4) == 0 ? 0 : Int(40);
    for (int t = 0; t < tokens; ++t) d.logprobs.push_back(Token(top));
    for (const auto& lp : d.logprobs) d.text += lp.token;
    if (Int(3) > 0) {
      const char* reasons[] = {"stop", "length", "degenerate", "tool_calls"};
      d.finish_reason = reasons[Int(4)];
    }
    if (Int(5) == 0) d.degeneration_kind = Int(2) == 0 ? "repeat" : "whitespace";
    if (chat) {
      if (Int(3) == 0) d.reasoning = absl::StrCat("thinking ", Text());
      if (Int(3) == 0) {
        if (Int(2) == 0) d.text.clear();  // only tool calls: content null
        for (int k = 0; k < 1 + Int(2); ++k) {
          d.tool_calls.push_back({k, absl::StrCat("call_", k, "abc"), absl::StrCat("f", Text()),
                                  absl::StrCat(R"({"x": ")", Text(), "\"}")});
        }
      }
    }
    return d;
  }

 private:
  std::mt19937 rng_;
};

TEST(ApiResponseWriterTest, WriterMatchesTheTreeOnVariedResponses) {
  for (uint32_t seed = 0; seed < 400; ++seed) {
    Generator g(seed);
    ApiRequest req;
    req.endpoint = g.Int(2) == 0 ? Endpoint::kCompletions : Endpoint::kChatCompletions;
    const bool chat = req.endpoint == Endpoint::kChatCompletions;
    req.logprobs = g.Int(4) > 0;
    req.top_logprobs = g.Int(21);
    req.n = 1 + g.Int(5);
    if (chat && g.Int(2) == 0) req.thinking = g.Int(2) == 0;
    const ResponseMeta meta{absl::StrCat(chat ? "chatcmpl-" : "cmpl-", seed), 1733300000 + seed,
                            g.Int(4) == 0 ? std::string("m\xc3\xa9\"x\x80") : "kjv-v4-tiny"};
    std::vector<ChoiceDelta> choices;
    for (int i = 0; i < req.n; ++i) {
      choices.push_back(g.Choice(i, chat, req.logprobs ? req.top_logprobs : 0));
    }
    const Usage usage{g.Int(1000), g.Int(5000), g.Int(100)};
    const std::string tree = FullResponseTree(req, meta, choices, usage);
    ASSERT_EQ(FullResponse(req, meta, choices, usage), tree) << "seed " << seed;
    EXPECT_TRUE(nlohmann::json::accept(tree)) << "seed " << seed;
  }
}

// Empty cases: no choices, and a choice with nothing in it, logprobs on and off.
TEST(ApiResponseWriterTest, WriterMatchesTheTreeOnEmptyResponses) {
  for (Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    for (bool logprobs : {false, true}) {
      ApiRequest req;
      req.endpoint = endpoint;
      req.logprobs = logprobs;
      const ResponseMeta meta{"id", 0, ""};
      EXPECT_EQ(FullResponse(req, meta, {}, {}), FullResponseTree(req, meta, {}, {}));
      const std::vector<ChoiceDelta> one(1);
      EXPECT_EQ(FullResponse(req, meta, one, {}), FullResponseTree(req, meta, one, {}));
    }
  }
}

// The written text is what a client reads: one known response, spelled out.
TEST(ApiResponseWriterTest, ChatLogprobsAreSpelledOut) {
  ApiRequest req;
  req.endpoint = Endpoint::kChatCompletions;
  req.logprobs = true;
  ChoiceDelta d;
  d.text = "\xc3\xa9";
  d.finish_reason = "stop";
  d.logprobs.push_back({"\xef\xbf\xbd", -0.5f, {{"\xef\xbf\xbd", -0.5f}}, "\xc3", {"\xc3"}});
  EXPECT_EQ(FullResponse(req, {"chatcmpl-1", 7, "m"}, {d}, {1, 1, 0}),
            R"({"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"m",)"
            R"("choices":[{"index":0,"message":{"role":"assistant","content":"é"},)"
            R"("logprobs":{"content":[{"token":"�","logprob":-0.5,"bytes":[195],)"
            R"("top_logprobs":[{"token":"�","logprob":-0.5,"bytes":[195]}]}]},)"
            R"("finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,)"
            R"("total_tokens":2,"completion_tokens_details":{"reasoning_tokens":0}}})");
}

}  // namespace
}  // namespace pdserve::frontend
