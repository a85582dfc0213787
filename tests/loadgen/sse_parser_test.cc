#include "loadgen/sse_parser.h"

#include <gtest/gtest.h>

namespace pdserve::loadgen {
namespace {

TEST(SseParserTest, EventsSplitAcrossArbitraryChunks) {
  const std::string stream = "data: {\"a\":1}\n\n: comment\n\ndata: [DONE]\n\n";
  for (size_t cut = 0; cut <= stream.size(); ++cut) {
    SseParser parser;
    std::vector<std::string> events = parser.Feed(stream.substr(0, cut));
    for (std::string& e : parser.Feed(stream.substr(cut))) events.push_back(std::move(e));
    ASSERT_EQ(events.size(), 2u) << "cut at " << cut;
    EXPECT_EQ(events[0], "{\"a\":1}");
    EXPECT_EQ(events[1], "[DONE]");
  }
}

TEST(SseParserTest, CrlfAndMultiLineData) {
  SseParser parser;
  auto events = parser.Feed("event: x\r\ndata: one\r\ndata:two\r\n\r\n");
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], "one\ntwo");
}

}  // namespace
}  // namespace pdserve::loadgen
