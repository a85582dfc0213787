#include "common/json_parse_failure.h"

#include <string>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

using Kind = JsonParseFailure::Kind;

TEST(JsonParseFailureTest, ValidJsonHasNoFailure) {
  EXPECT_FALSE(FindJsonParseFailure(R"({"a":[1,2.5e300,-1e-400,"x",null,true]})").has_value());
  EXPECT_FALSE(FindJsonParseFailure("1.7976931348623157e308").has_value());  // DBL_MAX
}

TEST(JsonParseFailureTest, AnOverflowingNumberIsOutOfRangeWithItsPath) {
  const auto f = FindJsonParseFailure(R"({"model":"m","max_tokens":1e400,"n":1})");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->kind, Kind::kNumberOutOfRange);
  EXPECT_EQ(f->path, "max_tokens");
  EXPECT_EQ(f->top_key, "max_tokens");
  EXPECT_EQ(f->token, "1e400");
  EXPECT_EQ(f->byte, 31u);  // read through the number's last byte
}

TEST(JsonParseFailureTest, ThePathCountsArrayElementsAndNamesMembers) {
  // The failing element is the third of the inner array, inside the second of the outer one.
  const auto f = FindJsonParseFailure(R"({"a":{"b":[{},[1,{"c":2},-9e999]]}})");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->kind, Kind::kNumberOutOfRange);
  EXPECT_EQ(f->path, "a.b[1][2]");
  EXPECT_EQ(f->top_key, "a");
  EXPECT_EQ(f->token, "-9e999");
  // At the root of an array there is no member to name.
  const auto g = FindJsonParseFailure("[0,1e400]");
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->path, "[1]");
  EXPECT_EQ(g->top_key, "");
}

TEST(JsonParseFailureTest, LongKeysAndTokensAreCut) {
  const std::string key(100, 'k');
  const auto f = FindJsonParseFailure("{\"" + key + "\":1" + std::string(400, '0') + "}");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->kind, Kind::kNumberOutOfRange);
  EXPECT_EQ(f->top_key, std::string(64, 'k') + "...");
  EXPECT_EQ(f->path, f->top_key);
  EXPECT_EQ(f->token, "1" + std::string(31, '0') + "...");
}

TEST(JsonParseFailureTest, BrokenGrammarIsASyntaxError) {
  for (const char* text : {"{not json", R"({"a":1,})", "", R"({"a":1} x)", R"({"a":"\x"})"}) {
    SCOPED_TRACE(text);
    const auto f = FindJsonParseFailure(text);
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->kind, Kind::kSyntax);
  }
}

TEST(JsonParseFailureTest, TheMessageJoinsBaseAndPath) {
  const auto member = FindJsonParseFailure(R"({"maximum":1e400})");
  const auto element = FindJsonParseFailure("[1e400]");
  const auto root = FindJsonParseFailure("1e400");
  ASSERT_TRUE(member && element && root);
  const std::string range =
      " is out of range (a JSON number here must fit a double, at most about 1.8e308 in "
      "magnitude)";
  EXPECT_EQ(NumberOutOfRangeMessage("", *member), "'maximum': the number 1e400" + range);
  EXPECT_EQ(NumberOutOfRangeMessage("schema", *member),
            "'schema.maximum': the number 1e400" + range);
  EXPECT_EQ(NumberOutOfRangeMessage("enum", *element), "'enum[0]': the number 1e400" + range);
  EXPECT_EQ(NumberOutOfRangeMessage("schema", *root), "'schema': the number 1e400" + range);
  EXPECT_EQ(NumberOutOfRangeMessage("", *root), "request body: the number 1e400" + range);
}

}  // namespace
}  // namespace pdserve
