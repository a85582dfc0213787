#include "common/json_depth.h"

#include <string>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

std::string Nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(JsonDepthTest, TheLimitItselfPassesAndOneMoreLevelIsRefused) {
  EXPECT_FALSE(JsonNestsDeeperThan(Nested(kMaxJsonDepth), kMaxJsonDepth));
  EXPECT_TRUE(JsonNestsDeeperThan(Nested(kMaxJsonDepth + 1), kMaxJsonDepth));
  EXPECT_TRUE(CheckJsonDepth(Nested(kMaxJsonDepth), "x").ok());
  EXPECT_FALSE(CheckJsonDepth(Nested(kMaxJsonDepth + 1), "x").ok());
}

TEST(JsonDepthTest, ObjectsAndArraysBothCountAndScalarsDoNot) {
  EXPECT_FALSE(JsonNestsDeeperThan("1", 0));
  EXPECT_FALSE(JsonNestsDeeperThan("[]", 1));
  EXPECT_FALSE(JsonNestsDeeperThan(R"({"a":[1,2,{"b":3}]})", 3));
  EXPECT_TRUE(JsonNestsDeeperThan(R"({"a":[1,2,{"b":3}]})", 2));
  // Siblings do not add up: the depth is the most levels open at once.
  EXPECT_FALSE(JsonNestsDeeperThan(R"([[1],[2],{"c":3}])", 2));
}

TEST(JsonDepthTest, BracketsInsideStringsAreText) {
  const std::string in_string = R"({"a":")" + Nested(1000) + R"(","b":"[[[{{{"})";
  EXPECT_FALSE(JsonNestsDeeperThan(in_string, 1));
  EXPECT_FALSE(JsonNestsDeeperThan(R"(["]]]]","[[[["])", 1));
}

TEST(JsonDepthTest, EscapesNeitherEndNorOpenAString) {
  // \" stays inside the string, so the brackets after it are text.
  EXPECT_FALSE(JsonNestsDeeperThan(R"(["a\"[[[[", 1])", 1));
  // \\ is one backslash: the '"' after it ends the string, so the brackets after it count.
  EXPECT_TRUE(JsonNestsDeeperThan(R"(["a\\", [[1]]])", 2));
  EXPECT_FALSE(JsonNestsDeeperThan(R"(["a\\", [[1]]])", 3));
  // \u0022 is a '"' spelled with an escape: it does not end the string.
  EXPECT_FALSE(JsonNestsDeeperThan(R"(["\u0022[[[[", 1])", 1));
}

TEST(JsonDepthTest, AHundredThousandLevelsAreRefusedWithTheLimitInTheMessage) {
  const std::string deep = R"({"a":)" + Nested(100000) + R"(,"b":1})";
  const absl::Status status = CheckJsonDepth(deep, "request body");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "request body nests deeper than 256 JSON levels");
}

TEST(JsonDepthTest, UnbalancedTextOnlyCounts) {
  // Not JSON (the parse after the check refuses it); the scan neither crashes nor goes negative.
  EXPECT_FALSE(JsonNestsDeeperThan("]]]]][", 1));
  EXPECT_TRUE(JsonNestsDeeperThan("]]]]][[", 1));
  EXPECT_FALSE(JsonNestsDeeperThan("\"[[[[", 1));  // an unterminated string
  EXPECT_FALSE(JsonNestsDeeperThan("", 0));
}

}  // namespace
}  // namespace pdserve
