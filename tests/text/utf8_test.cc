// UTF-8 helpers: the prefix-stability that the streaming detokenizer relies on.
#include "text/utf8.h"

#include <random>

#include "gtest/gtest.h"

namespace pdserve::text {
namespace {

// Random byte strings mixing valid multi-byte characters with stray and truncated bytes.
std::string RandomBytes(std::mt19937& rng) {
  static const char* const kPieces[] = {"a",
                                        "é",
                                        "中",
                                        "😀",
                                        "\xF0\x9F",
                                        "\xE4\xB8",
                                        "\x80",
                                        "\xC3",
                                        "\xFF",
                                        "\xED\xA0\x80",
                                        "\xF4\x90\x80\x80"};
  std::string out;
  const int n = static_cast<int>(rng() % 8);
  for (int i = 0; i < n; ++i) out += kPieces[rng() % std::size(kPieces)];
  return out;
}

TEST(Utf8Test, LossyDecodeIsStableBeforeTheIncompleteTail) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::string bytes = RandomBytes(rng);
    for (size_t cut = 0; cut <= bytes.size(); ++cut) {
      const std::string_view head = std::string_view(bytes).substr(0, cut);
      const size_t final_bytes = cut - IncompleteUtf8Tail(head);
      const std::string joined = Utf8Lossy(head.substr(0, final_bytes)) +
                                 Utf8Lossy(std::string_view(bytes).substr(final_bytes));
      ASSERT_EQ(joined, Utf8Lossy(bytes)) << "cut " << cut;
    }
  }
}

TEST(Utf8Test, TruncatedSequenceIsOneReplacementCharacter) {
  EXPECT_EQ(Utf8Lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0\x9F\x98"), 3u);
}

TEST(Utf8Test, SurrogateEncodingIsInvalidPerByte) {
  // ED A0 80 (a UTF-16 surrogate) is three maximal subparts: ED, A0, 80.
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_FALSE(IsValidUtf8("\xED\xA0\x80"));
  EXPECT_TRUE(IsValidUtf8("中😀"));
}

}  // namespace
}  // namespace pdserve::text
