#include "guards/degeneration_detector.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace pdserve::guards {
namespace {

void PushNgram(DegenerationDetector& d, const std::vector<int32_t>& gram, int times) {
  for (int i = 0; i < times; ++i) {
    for (int32_t t : gram) d.Push(t);
  }
}

TEST(DegenerationDetectorTest, SingleTokenRepeated) {
  DegenerationDetector d;
  d.Push(1);
  d.Push(2);
  PushNgram(d, {9}, 30);
  EXPECT_EQ(d.LongestRun().ngram, 1);
  EXPECT_EQ(d.LongestRun().repeats, 30);
  EXPECT_EQ(d.LongestRun().span_tokens, 30);
  EXPECT_TRUE(d.Repetitive());
  EXPECT_TRUE(d.Degenerate());
}

TEST(DegenerationDetectorTest, TrigramRepeatedAfterDistinctPrefix) {
  DegenerationDetector d;
  PushNgram(d, {100, 101, 102, 103, 104}, 1);
  PushNgram(d, {5, 6, 7}, 10);
  EXPECT_EQ(d.LongestRun().ngram, 3);
  EXPECT_EQ(d.LongestRun().repeats, 10);
  EXPECT_EQ(d.LongestRun().span_tokens, 30);
  EXPECT_TRUE(d.Repetitive());
}

TEST(DegenerationDetectorTest, LongestPeriodIsThirtyTwo) {
  std::vector<int32_t> gram32, gram33;
  for (int i = 0; i < 33; ++i) {
    if (i < 32) gram32.push_back(i);
    gram33.push_back(i);
  }
  DegenerationDetector a;
  PushNgram(a, gram32, 3);
  EXPECT_EQ(a.LongestRun().ngram, 32);
  EXPECT_EQ(a.LongestRun().repeats, 3);
  DegenerationDetector b;
  PushNgram(b, gram33, 3);  // period 33 is beyond max_ngram: not seen
  EXPECT_EQ(b.LongestRun().repeats, 0);
}

// The trial's case: a short loop, then a longer periodic stretch with fewer repeats outranks it
// in LongestRun(); the loop must stay flagged.
TEST(DegenerationDetectorTest, LoopStaysFlaggedWhenALongerStretchFollows) {
  DegenerationDetector d;
  PushNgram(d, {7, 8, 9}, 9);  // 27 tokens, 9 copies: degenerate
  ASSERT_TRUE(d.Repetitive());
  std::vector<int32_t> long_gram;
  for (int i = 0; i < 20; ++i) long_gram.push_back(100 + i);
  PushNgram(d, long_gram, 3);  // 60 tokens, period 20: a longer span, 3 copies
  EXPECT_EQ(d.LongestRun().ngram, 20);
  EXPECT_LT(d.LongestRun().repeats, 8);
  EXPECT_TRUE(d.Repetitive());
}

TEST(DegenerationDetectorTest, FewRepeatsAreNotDegenerate) {
  DegenerationDetector d;
  PushNgram(d, {4, 8}, 5);
  EXPECT_EQ(d.LongestRun().repeats, 5);
  EXPECT_FALSE(d.Repetitive());
}

TEST(DegenerationDetectorTest, VariedTokensStayClean) {
  DegenerationDetector d;
  uint32_t x = 12345;
  for (int i = 0; i < 2000; ++i) {
    x = x * 1664525u + 1013904223u;
    d.Push(static_cast<int32_t>((x >> 8) % 5000));
  }
  EXPECT_LE(d.LongestRun().repeats, 2);
  EXPECT_FALSE(d.Degenerate());
}

TEST(DegenerationDetectorTest, LongestRunSurvivesItsEnd) {
  DegenerationDetector d;
  PushNgram(d, {7}, 20);
  PushNgram(d, {1, 2, 3, 4, 5, 6}, 1);
  EXPECT_EQ(d.CurrentRun().repeats, 0);
  EXPECT_EQ(d.LongestRun().repeats, 20);
}

TEST(DegenerationDetectorTest, WhitespaceOnlyAndEmpty) {
  DegenerationDetector d;
  EXPECT_TRUE(d.Empty());
  EXPECT_FALSE(d.WhitespaceOnly());
  d.PushText(" \n\t");
  d.PushText("\xE3\x80\x80");  // U+3000 IDEOGRAPHIC SPACE
  EXPECT_FALSE(d.Empty());
  EXPECT_TRUE(d.WhitespaceOnly());
  EXPECT_TRUE(d.Degenerate());
  d.PushText("a");
  EXPECT_FALSE(d.WhitespaceOnly());
}

TEST(DegenerationDetectorTest, Utf8SplitAcrossPieces) {
  DegenerationDetector spaces;
  spaces.PushText("\xE3");
  spaces.PushText("\x80\x80");  // U+3000 split over two pieces
  EXPECT_TRUE(spaces.WhitespaceOnly());
  DegenerationDetector cjk;
  cjk.PushText("\xE4\xB8");
  cjk.PushText("\xAD");  // U+4E2D
  EXPECT_FALSE(cjk.WhitespaceOnly());
}

}  // namespace
}  // namespace pdserve::guards
