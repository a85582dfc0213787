// Streaming detokenization: UTF-8 safety and stop strings at every token boundary.
#include "text/incremental_detokenizer.h"

#include "gtest/gtest.h"
#include "tests/text/test_util.h"
#include "text/byte_level.h"
#include "text/utf8.h"

namespace pdserve::text {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

const char* const kTexts[] = {
    "Family: 👨‍👩‍👧‍👦 and flags 🇯🇵🇺🇸, skin 👍🏽!",
    "中文分词测试：你好，世界。日本語のテキストも。한국어 텍스트",
    "e\u0301 a\u0308 Z\u0336a\u0337 mixed 🧑🏿‍🤝‍🧑🏻 end",
    "plain ASCII text with a stop word STOP inside and more",
};

// One token per byte: every byte boundary is a token boundary.
std::vector<int32_t> ByteTokens(const Tokenizer& tok, std::string_view text) {
  std::vector<int32_t> ids;
  for (char c : text) ids.push_back(*tok.TokenToId(ByteLevelChar(static_cast<uint8_t>(c))));
  return ids;
}

std::vector<int32_t> BpeTokens(const Tokenizer& tok, std::string_view text) {
  return *tok.Encode(text, {.add_special_tokens = false});
}

struct Streamed {
  std::vector<std::string> pieces;
  std::string text;
  bool stopped = false;
};

Streamed Stream(const Tokenizer& tok, const std::vector<int32_t>& ids, DetokenizeOptions options) {
  IncrementalDetokenizer detok(tok, std::move(options));
  Streamed out;
  for (int32_t id : ids) {
    auto step = detok.Add(id);
    EXPECT_TRUE(step.ok());
    out.pieces.push_back(step->text);
    out.text += step->text;
    out.stopped = out.stopped || step->stopped;
  }
  DetokenizeStep last = detok.Finish();
  out.pieces.push_back(last.text);
  out.text += last.text;
  out.stopped = out.stopped || last.stopped;
  return out;
}

TEST(IncrementalDetokenizerTest, PiecesAreCompleteUtf8AtEveryByteBoundary) {
  const Tokenizer& tok = FixtureTokenizer();
  for (const char* text : kTexts) {
    const Streamed s = Stream(tok, ByteTokens(tok, text), {});
    for (const std::string& piece : s.pieces) {
      EXPECT_TRUE(IsValidUtf8(piece));
      EXPECT_EQ(piece.find(kReplacement), std::string::npos) << text;
    }
    EXPECT_EQ(s.text, text);
  }
}

// FinishCut (a stream cut by max_tokens): the text is Decode's without the unfinished character
// at the end, never a trailing U+FFFD, at every byte boundary.
TEST(IncrementalDetokenizerTest, FinishCutDropsOnlyAnUnfinishedTail) {
  const Tokenizer& tok = FixtureTokenizer();
  int dropped = 0;
  for (const char* text : kTexts) {
    const std::vector<int32_t> ids = ByteTokens(tok, text);
    const std::string_view all(text);
    for (size_t n = 0; n <= ids.size(); ++n) {
      IncrementalDetokenizer detok(tok, {});
      std::string got;
      for (size_t i = 0; i < n; ++i) got += detok.Add(ids[i])->text;
      got += detok.FinishCut().text;
      const std::string_view prefix = all.substr(0, n);
      const size_t tail = IncompleteUtf8Tail(prefix);
      dropped += tail > 0;
      EXPECT_EQ(got, Utf8Lossy(prefix.substr(0, n - tail))) << text << " cut at " << n;
    }
  }
  EXPECT_GT(dropped, 0);
}

TEST(IncrementalDetokenizerTest, ConcatenationEqualsDecodeForBpeTokens) {
  const Tokenizer& tok = FixtureTokenizer();
  for (const char* text : kTexts) {
    const std::vector<int32_t> ids = BpeTokens(tok, text);
    const Streamed s = Stream(tok, ids, {.skip_special_tokens = false});
    EXPECT_EQ(s.text, *tok.Decode(ids, false));
    for (const std::string& piece : s.pieces) {
      EXPECT_EQ(piece.find(kReplacement), std::string::npos);
    }
  }
}

TEST(IncrementalDetokenizerTest, EveryPrefixOfIdsStreamsLikeDecode) {
  // Streams ending at every token boundary, including inside an emoji: the concatenation must
  // still equal Decode(prefix), with U+FFFD exactly where Decode has it.
  const Tokenizer& tok = FixtureTokenizer();
  const std::vector<int32_t> ids = ByteTokens(tok, kTexts[0]);
  for (size_t n = 0; n <= ids.size(); ++n) {
    const std::vector<int32_t> prefix(ids.begin(), ids.begin() + n);
    EXPECT_EQ(Stream(tok, prefix, {}).text, *tok.Decode(prefix, true)) << n;
  }
}

TEST(IncrementalDetokenizerTest, SpecialTokensAreSkippedWhenAsked) {
  const Tokenizer& tok = FixtureTokenizer();
  std::vector<int32_t> ids = BpeTokens(tok, "answer");
  ids.push_back(*tok.eos_id());
  EXPECT_EQ(Stream(tok, ids, {.skip_special_tokens = true}).text, "answer");
  EXPECT_EQ(Stream(tok, ids, {.skip_special_tokens = false}).text, *tok.Decode(ids, false));
}

TEST(IncrementalDetokenizerTest, UnknownIdIsAnErrorAndLeavesStateUnchanged) {
  const Tokenizer& tok = FixtureTokenizer();
  IncrementalDetokenizer detok(tok, {});
  ASSERT_TRUE(detok.Add(*tok.TokenToId(ByteLevelChar(0xE4))).ok());
  EXPECT_EQ(detok.Add(tok.vocab_size() + 5).status().code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(detok.Add(*tok.TokenToId(ByteLevelChar(0xB8))).ok());
  auto step = detok.Add(*tok.TokenToId(ByteLevelChar(0xAD)));
  ASSERT_TRUE(step.ok());
  EXPECT_EQ(step->text, "中");
}

// For every stop string cut from `text` (every start at a character boundary, lengths 1..6
// characters) and both token splittings, streaming equals the non-streamed text cut at the stop
// and the stop string is never sent.
void ExpectStopStringsHeldBack(const std::string& text) {
  const Tokenizer& tok = FixtureTokenizer();
  std::vector<size_t> starts;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<uint8_t>(text[i]) & 0xC0) != 0x80) starts.push_back(i);
  }
  starts.push_back(text.size());
  for (const auto& ids : {ByteTokens(tok, text), BpeTokens(tok, text)}) {
    const std::string full = *tok.Decode(ids, true);
    for (size_t a = 0; a + 1 < starts.size(); ++a) {
      for (size_t len = 1; len <= 6 && a + len < starts.size(); ++len) {
        const std::string stop = text.substr(starts[a], starts[a + len] - starts[a]);
        const std::vector<std::string> stops = {stop, "never-present"};
        const Streamed s = Stream(tok, ids, {.skip_special_tokens = true, .stop_strings = stops});
        ASSERT_EQ(s.text, TruncateAtStop(full, stops)) << "stop " << stop;
        ASSERT_TRUE(s.stopped) << stop;
        ASSERT_EQ(s.text.find(stop), std::string::npos);
      }
    }
  }
}

TEST(IncrementalDetokenizerTest, StopStringsInEmojiTextAtEveryBoundary) {
  ExpectStopStringsHeldBack(kTexts[0]);
}

TEST(IncrementalDetokenizerTest, StopStringsInCjkTextAtEveryBoundary) {
  ExpectStopStringsHeldBack(kTexts[1]);
}

TEST(IncrementalDetokenizerTest, StopStringsInAsciiTextAtEveryBoundary) {
  ExpectStopStringsHeldBack(kTexts[3]);
}

TEST(IncrementalDetokenizerTest, EarlierStartingStopStringWinsOverEarlierCompletingOne) {
  const Tokenizer& tok = FixtureTokenizer();
  const std::vector<std::string> stops = {"abcd", "c"};
  for (const char* text : {"xxabcdyy", "xxabcyy"}) {
    const std::vector<int32_t> ids = ByteTokens(tok, text);
    const Streamed s = Stream(tok, ids, {.stop_strings = stops});
    EXPECT_EQ(s.text, TruncateAtStop(text, stops)) << text;
    EXPECT_TRUE(s.stopped);
  }
}

// vLLM's rule: a stop string counts only when it ends in the text of the min_tokens-th token or a
// later one; earlier occurrences are plain text.
TEST(IncrementalDetokenizerTest, StopStringsEndingBeforeMinTokensAreText) {
  const Tokenizer& tok = FixtureTokenizer();
  const std::string text = "ab STOP cd STOP ef";  // one token per byte: the first STOP ends at 7
  const std::vector<int32_t> ids = ByteTokens(tok, text);
  const auto streamed = [&](int32_t min_tokens) {
    return Stream(tok, ids, {.stop_strings = {"STOP"}, .min_tokens = min_tokens}).text;
  };
  EXPECT_EQ(streamed(0), "ab ");
  EXPECT_EQ(streamed(7), "ab ");  // the 7th token completes it: it counts
  EXPECT_EQ(streamed(8), "ab STOP cd ");
  EXPECT_EQ(streamed(15), "ab STOP cd ");
  EXPECT_EQ(streamed(16), text);  // no stop counts: everything, and not stopped
  EXPECT_FALSE(Stream(tok, ids, {.stop_strings = {"STOP"}, .min_tokens = 16}).stopped);
  // An occurrence that starts before the min_tokens-th token and ends in it counts (vLLM looks
  // back a stop string's length from the new text).
  EXPECT_EQ(
      Stream(tok, ByteTokens(tok, "xxSTOP"), {.stop_strings = {"STOP"}, .min_tokens = 6}).text,
      "xx");
}

TEST(IncrementalDetokenizerTest, PartialStopPrefixIsReleasedAtFinish) {
  const Tokenizer& tok = FixtureTokenizer();
  const Streamed s = Stream(tok, ByteTokens(tok, "the end is ST"), {.stop_strings = {"STOP"}});
  EXPECT_EQ(s.text, "the end is ST");
  EXPECT_FALSE(s.stopped);
  EXPECT_EQ(s.pieces.back(), "ST");
}

TEST(IncrementalDetokenizerTest, IdsAfterStopAreIgnored) {
  const Tokenizer& tok = FixtureTokenizer();
  IncrementalDetokenizer detok(tok, {.stop_strings = {"b"}});
  std::string text;
  for (int32_t id : ByteTokens(tok, "abcdef")) text += detok.Add(id)->text;
  text += detok.Finish().text;
  EXPECT_EQ(text, "a");
  EXPECT_TRUE(detok.stopped());
}

}  // namespace
}  // namespace pdserve::text
