// ChatOutputParser against DeepSeek's own parse_message_from_completion_text: the completions
// of tests/fixtures/text/deepseek_v4_chat_golden.json (tools/text_chat_golden.py) fed whole, cut
// at every byte, and as the fixture tokenizer's token stream through the detokenizer.
#include "text/chat_output_parser.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/text/test_util.h"
#include "text/incremental_detokenizer.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";

json GoldenCompletions() {
  auto text = ReadFile(PDSERVE_TEXT_FIXTURES "/deepseek_v4_chat_golden.json");
  EXPECT_TRUE(text.ok());
  return json::parse(*text)["completions"];
}

// A completion as the detokenizer releases it: EOS is a skipped special token.
std::string WithoutEos(std::string text) {
  if (text.ends_with(kEos)) text.resize(text.size() - kEos.size());
  return text;
}

// Everything the parser released, joined.
struct Joined {
  std::string reasoning, content;
  std::vector<ParsedToolCall> calls;
  void Take(ChatOutputPiece piece) {
    reasoning += piece.reasoning;
    content += piece.content;
    for (auto& c : piece.tool_calls) calls.push_back(std::move(c));
  }
};

Joined ParsePieces(const std::vector<std::string>& pieces, ChatOutputOptions options) {
  ChatOutputParser parser(std::move(options));
  Joined out;
  for (const std::string& p : pieces) out.Take(parser.Add(p));
  out.Take(parser.Finish());
  return out;
}

void ExpectMatches(const Joined& got, const json& want, const std::string& how) {
  EXPECT_EQ(got.reasoning, want["reasoning_content"].get<std::string>()) << how;
  EXPECT_EQ(got.content, want["content"].get<std::string>()) << how;
  ASSERT_EQ(got.calls.size(), want["tool_calls"].size()) << how;
  for (size_t i = 0; i < got.calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].name, want["tool_calls"][i]["name"].get<std::string>()) << how;
    EXPECT_EQ(got.calls[i].arguments, want["tool_calls"][i]["arguments"].get<std::string>()) << how;
  }
}

ChatOutputOptions Options(const json& c) {
  return {.thinking = c["thinking"].get<bool>(), .tools = true};
}

TEST(ChatOutputParserTest, MatchesDeepSeekParserWhole) {
  const json cases = GoldenCompletions();
  ASSERT_GE(cases.size(), 8u);
  for (const json& c : cases) {
    ExpectMatches(ParsePieces({WithoutEos(c["completion"])}, Options(c)), c, c.dump());
  }
}

TEST(ChatOutputParserTest, MatchesDeepSeekParserCutAtEveryByte) {
  for (const json& c : GoldenCompletions()) {
    const std::string text = WithoutEos(c["completion"]);
    for (size_t cut = 0; cut <= text.size(); ++cut) {
      ExpectMatches(ParsePieces({text.substr(0, cut), text.substr(cut)}, Options(c)), c,
                    "cut at " + std::to_string(cut));
    }
    std::vector<std::string> bytes;
    for (char ch : text) bytes.push_back(std::string(1, ch));
    ExpectMatches(ParsePieces(bytes, Options(c)), c, "byte by byte");
  }
}

TEST(ChatOutputParserTest, MatchesDeepSeekParserOnTheTokenStream) {
  const Tokenizer& tok = FixtureTokenizer();
  for (const json& c : GoldenCompletions()) {
    auto ids = tok.Encode(c["completion"].get<std::string>(),
                          {.add_special_tokens = false, .allow_special = true});
    ASSERT_TRUE(ids.ok());
    IncrementalDetokenizer detok(tok, {});
    std::vector<std::string> pieces;
    for (int32_t id : *ids) pieces.push_back(detok.Add(id)->text);
    pieces.push_back(detok.Finish().text);
    ExpectMatches(ParsePieces(pieces, Options(c)), c, "tokens of " + c.dump());
  }
}

TEST(ChatOutputParserTest, ThinkEndInsideOneTokenTextSplitsThere) {
  Joined got = ParsePieces({"a</th", "ink>b", "c"}, {.thinking = true});
  EXPECT_EQ(got.reasoning, "a");
  EXPECT_EQ(got.content, "bc");
  got = ParsePieces({"plan.</think>answer"}, {.thinking = true});
  EXPECT_EQ(got.reasoning, "plan.");
  EXPECT_EQ(got.content, "answer");
}

TEST(ChatOutputParserTest, HeldBackPrefixIsReleasedWhenItDoesNotComplete) {
  ChatOutputParser parser({.thinking = true});
  EXPECT_EQ(parser.Add("x</thi").reasoning, "x");
  EXPECT_EQ(parser.Add("s").reasoning, "</this");
  EXPECT_TRUE(parser.in_reasoning());
}

TEST(ChatOutputParserTest, WithoutToolsDsmlStaysContent) {
  const std::string text =
      "a\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n"
      "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  Joined got = ParsePieces({text}, {});
  EXPECT_EQ(got.content, text);
  EXPECT_TRUE(got.calls.empty());
}

// Malformed blocks come back as text, from their opening tag: a complete invoke before the
// broken part is text too (a block counts whole or not at all).
TEST(ChatOutputParserTest, MalformedToolOutputIsReturnedAsText) {
  const std::string open = "\n\n<｜DSML｜tool_calls>\n";
  const std::string good =
      "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" "
      "string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n";
  const std::vector<std::string> broken = {
      "<｜DSML｜invoke nam=\"g\">\n\n</｜DSML｜invoke>\n",  // bad name attribute
      "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"a\" string=\"false\">{oops"
      "</｜DSML｜parameter>\n</｜DSML｜invoke>\n",  // value is not JSON
      "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"a\" string=\"true\">1"
      "</｜DSML｜parameter>\n<｜DSML｜parameter name=\"a\" string=\"true\">2</｜DSML｜parameter>\n"
      "</｜DSML｜invoke>\n",  // duplicate parameter
      "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"a\" string=\"maybe\">1"
      "</｜DSML｜parameter>\n</｜DSML｜invoke>\n",  // bad string flag
      std::string("<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"a\" string=\"false\">0\0"
                  "</｜DSML｜parameter>\n</｜DSML｜invoke>\n",
                  118),  // JSON, then a NUL byte (found by the fuzzer)
      "garbage",         // neither invoke nor end
      "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter",  // cut off by the end of the answer
  };
  for (const std::string& bad : broken) {
    Joined got = ParsePieces({"pre", open, good, bad}, {.tools = true});
    EXPECT_TRUE(got.calls.empty()) << bad;
    EXPECT_EQ(got.content, "pre" + open + good + bad) << bad;
  }
  Joined got = ParsePieces({"x", "\n\n<｜DSML｜tool_callsX"}, {.tools = true});
  EXPECT_TRUE(got.calls.empty());
  EXPECT_EQ(got.content, "x\n\n<｜DSML｜tool_callsX");
}

// breaker G3: an answer cut inside the block's closing tag (max_tokens below a forced call's
// block) returned its complete invoke as a tool call with finish_reason "length". A cut block
// is text, whatever the cut: before, inside or after the invoke's closing tag, or in the block's.
TEST(ChatOutputParserTest, ABlockCutOffByTheEndIsTextEvenWithItsInvokeComplete) {
  const std::string block =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" "
      "string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  const size_t invoke_end = block.find("</｜DSML｜tool_calls>");
  ASSERT_NE(invoke_end, std::string::npos);
  for (size_t cut = 0; cut < block.size(); ++cut) {
    const std::string text = "ok" + block.substr(0, cut);
    for (const auto& pieces :
         {std::vector<std::string>{text}, std::vector<std::string>{text.substr(0, text.size() / 2),
                                                                   text.substr(text.size() / 2)}}) {
      Joined got = ParsePieces(pieces, {.tools = true});
      EXPECT_TRUE(got.calls.empty()) << "cut at " << cut;
      EXPECT_EQ(got.content, text) << "cut at " << cut;
    }
  }
  // Cut inside the closing tag, one byte short: text; whole: one call, no text.
  Joined cut = ParsePieces({"ok" + block.substr(0, block.size() - 1)}, {.tools = true});
  EXPECT_TRUE(cut.calls.empty());
  Joined whole = ParsePieces({"ok" + block}, {.tools = true});
  ASSERT_EQ(whole.calls.size(), 1u);
  EXPECT_EQ(whole.calls[0].name, "f");
  EXPECT_EQ(whole.calls[0].arguments, "{\"a\": 1}");
  EXPECT_EQ(whole.content, "ok");
  // Streamed: the call is released with the closing tag's last byte, not with its invoke.
  ChatOutputParser parser({.tools = true});
  EXPECT_TRUE(parser.Add("ok" + block.substr(0, invoke_end)).tool_calls.empty());
  EXPECT_EQ(parser.Add(block.substr(invoke_end)).tool_calls.size(), 1u);
}

// Found by the fuzzer: a malformed block followed by a valid one. Only the first block decides;
// otherwise how far the text had arrived when it went wrong would change the result.
TEST(ChatOutputParserTest, AfterAMalformedBlockTheRestIsContent) {
  const std::string text =
      "\n\n<｜DSML｜tool_calls>\nbroken\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n"
      "</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
  std::vector<std::string> bytes;
  for (char ch : text) bytes.push_back(std::string(1, ch));
  for (const auto& pieces : {std::vector<std::string>{text}, bytes}) {
    Joined got = ParsePieces(pieces, {.tools = true});
    EXPECT_TRUE(got.calls.empty());
    EXPECT_EQ(got.content, text);
  }
}

}  // namespace
}  // namespace pdserve::text
