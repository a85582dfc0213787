// ParseOrderedJson gives what nlohmann::ordered_json::parse gives, in linear time.
#include "common/ordered_json.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pdserve {
namespace {

using ordered_json = nlohmann::ordered_json;

ordered_json Reference(const std::string& text) {
  return ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
}

TEST(OrderedJsonTest, EqualsNlohmannsParseIncludingOrderAndRepeatedKeys) {
  const std::vector<std::string> texts = {
      "null", "true", "-12", "18446744073709551615", "1.5e300", "\"a\\u00e9\\n\"", "[]", "{}",
      R"({"b":1,"a":[1,{"z":null,"y":[[]]}],"c":{"k":"v"}})",
      // A repeated key keeps its first place and takes its last value, nested ones too.
      R"({"x":1,"y":2,"x":{"p":1,"p":[3]},"z":3})",
      R"([{"a":1},{"a":2,"b":{"c":{"d":{}}}},"s",1.25,false])", R"(  {"spaces" :  [ 1 , 2 ] }  )"};
  for (const std::string& text : texts) {
    const ordered_json mine = ParseOrderedJson(text);
    const ordered_json theirs = Reference(text);
    ASSERT_FALSE(theirs.is_discarded()) << text;
    EXPECT_EQ(mine, theirs) << text;
    EXPECT_EQ(mine.dump(), theirs.dump()) << text;  // dump() shows the member order
  }
  EXPECT_EQ(ParseOrderedJson(R"({"x":1,"y":2,"x":3})").dump(), R"({"x":3,"y":2})");
}

TEST(OrderedJsonTest, TextThatIsNotOneJsonValueIsDiscarded) {
  for (const std::string text :
       {"", "{", "[1,]", "{\"a\" 1}", "{} {}", "nul", "[1] x", "\"\\x\"", "{\"a\":1,}", "\xff"}) {
    EXPECT_TRUE(Reference(text).is_discarded()) << text;
    EXPECT_TRUE(ParseOrderedJson(text).is_discarded()) << text;
  }
}

TEST(OrderedJsonTest, AWideObjectKeepsEveryMemberInOrder) {
  // 200k members: ordered_json::parse needs ~2e10 key compares for this; the index needs none.
  constexpr int kMembers = 200000;
  std::string text = "{";
  for (int i = 0; i < kMembers; ++i) absl::StrAppend(&text, i ? "," : "", "\"k", i, "\":", i);
  absl::StrAppend(&text, ",\"k7\":-1}");
  const ordered_json value = ParseOrderedJson(text);
  ASSERT_TRUE(value.is_object());
  ASSERT_EQ(value.size(), static_cast<size_t>(kMembers));
  int i = 0;
  for (const auto& [key, member] : value.items()) {
    ASSERT_EQ(key, absl::StrCat("k", i));
    ASSERT_EQ(member.get<int>(), i == 7 ? -1 : i);
    ++i;
  }
}

}  // namespace
}  // namespace pdserve
