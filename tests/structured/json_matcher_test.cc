// The JSON automaton: documents a schema accepts and refuses, byte by byte, and the shortest
// completion it reports.
#include "structured/json_matcher.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/structured/shortest_walk.h"

namespace pdserve::structured {
namespace {

std::shared_ptr<const JsonSchema> Schema(const std::string& text) {
  absl::StatusOr<std::shared_ptr<const JsonSchema>> schema = JsonSchema::Parse(text);
  EXPECT_TRUE(schema.ok()) << schema.status();
  return *schema;
}

// The whole of `doc` is read and forms a complete document.
bool Accepts(const std::string& schema, const std::string& doc) {
  GrammarMatcher m = StartJson(Schema(schema));
  return m.Advance(doc) && m.Complete();
}

// The bytes of `doc` are all read (a prefix of some document), complete or not.
bool Reads(const std::string& schema, const std::string& doc) {
  GrammarMatcher m = StartJson(Schema(schema));
  return m.Advance(doc);
}

const char kPerson[] = R"({"type":"object","properties":{
  "name":{"type":"string"},"age":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"}},
  "kind":{"enum":["a","b",3]}},"required":["name","kind"],"additionalProperties":false})";

TEST(JsonMatcherTest, AcceptsObjectsInDeclarationOrderWithOptionalPropertiesLeftOut) {
  EXPECT_TRUE(Accepts(kPerson, R"({"name":"x","kind":"a"})"));
  EXPECT_TRUE(Accepts(kPerson, R"({"name":"x","age":-12,"tags":["p","q"],"kind":3})"));
  EXPECT_TRUE(Accepts(kPerson, "{ \"name\" : \"x\" ,\n\"kind\": \"b\" }"));
}

TEST(JsonMatcherTest, RefusesMissingRequiredOtherOrderUnknownKeysAndValuesOutsideEnum) {
  EXPECT_FALSE(Accepts(kPerson, R"({"name":"x"})"));              // kind missing
  EXPECT_FALSE(Reads(kPerson, R"({"kind":"a","name":"x"})"));     // order
  EXPECT_FALSE(Reads(kPerson, R"({"name":"x","other":1})"));      // not declared
  EXPECT_FALSE(Reads(kPerson, R"({"name":"x","kind":"c"})"));     // not in enum
  EXPECT_FALSE(Reads(kPerson, R"({"name":"x","age":1.5})"));      // integer
  EXPECT_FALSE(Reads(kPerson, R"({"name":"x","tags":["p",]})"));  // trailing comma
  EXPECT_FALSE(Reads(kPerson, R"({"name":"x","kind":"a"} )"));    // after the document
}

TEST(JsonMatcherTest, StringsTakeEscapesAndUtf8AndRefuseControlBytesAndSurrogates) {
  const std::string s = R"({"type":"string"})";
  EXPECT_TRUE(Accepts(s, R"("a\"b\\c\/\n\t\u00e9\uFFFF")"));
  EXPECT_TRUE(Accepts(s, "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\""));
  EXPECT_FALSE(Reads(s, "\"a\x01"));         // control byte
  EXPECT_FALSE(Reads(s, R"("\x")"));         // no such escape
  EXPECT_FALSE(Reads(s, R"("\ud800")"));     // surrogate code unit
  EXPECT_FALSE(Reads(s, "\"\xc0\x80\""));    // overlong
  EXPECT_FALSE(Reads(s, "\"\xed\xa0\x80"));  // UTF-8 surrogate
  EXPECT_FALSE(Reads(s, "\"\xe2\x82\""));    // truncated sequence
}

TEST(JsonMatcherTest, NumbersFollowJsonGrammarWithBoundedDigits) {
  const std::string n = R"({"type":"number"})";
  for (const char* ok : {"0", "-0", "12", "-3.25", "1e5", "2.5E-3", "6e+10"}) {
    EXPECT_TRUE(Accepts(n, ok)) << ok;
  }
  for (const char* bad : {"01", "-", "1.", ".5", "1e", "+1", "--1"}) {
    EXPECT_FALSE(Accepts(n, bad)) << bad;
  }
  EXPECT_TRUE(Accepts(n, std::string(kMaxIntegerDigits, '7')));
  EXPECT_FALSE(Reads(n, std::string(kMaxIntegerDigits + 1, '7')));
  EXPECT_FALSE(Reads(R"({"type":"integer"})", "1.0"));
  EXPECT_FALSE(Reads(R"({"type":"integer"})", "1e3"));
}

TEST(JsonMatcherTest, AnyOfConstAndArraysBoundedByMinAndMaxItems) {
  const std::string any_of = R"({"anyOf":[{"type":"object","properties":{"a":{"type":"null"}},
    "required":["a"],"additionalProperties":false},{"type":"object","properties":{"b":{"type":
    "boolean"}},"required":["b"],"additionalProperties":false},{"type":"string"}]})";
  EXPECT_TRUE(Accepts(any_of, R"({"a":null})"));
  EXPECT_TRUE(Accepts(any_of, R"({"b":true})"));
  EXPECT_TRUE(Accepts(any_of, R"("s")"));
  EXPECT_FALSE(Reads(any_of, R"({"a":true})"));
  EXPECT_TRUE(Accepts(R"({"const":{"k":[1,"two"]}})", R"({"k":[1,"two"]})"));
  EXPECT_FALSE(Reads(R"({"const":{"k":[1,"two"]}})", R"({"k":[2)"));
  const std::string items =
      R"({"type":"array","items":{"type":"integer"},"minItems":2,"maxItems":3})";
  EXPECT_FALSE(Accepts(items, "[1]"));
  EXPECT_TRUE(Accepts(items, "[1,2]"));
  EXPECT_TRUE(Accepts(items, "[1,2,3]"));
  EXPECT_FALSE(Reads(items, "[1,2,3,"));
  EXPECT_TRUE(Accepts(R"({"enum":[1,12]})", "12"));
  EXPECT_TRUE(Accepts(R"({"enum":[1,12]})", "1"));
  EXPECT_FALSE(Reads(R"({"enum":[1,12]})", "13"));
}

TEST(JsonMatcherTest, WhitespaceRunsAreBounded) {
  const std::string o = R"({"type":"object"})";
  EXPECT_TRUE(Accepts(o, std::string("{") + std::string(kMaxWhitespace, ' ') + "}"));
  EXPECT_FALSE(Reads(o, std::string("{") + std::string(kMaxWhitespace + 1, ' ')));
}

TEST(JsonMatcherTest, TheDocumentStartsAtItsValueWithWhitespaceOnlyInside) {
  for (const char* lead : {" ", "\n", "\t", "\r"}) {
    EXPECT_FALSE(Reads(R"({"type":"object"})", lead)) << int{lead[0]};
    EXPECT_FALSE(Reads("{}", lead)) << int{lead[0]};
  }
  EXPECT_TRUE(Accepts(kPerson, "{\n  \"name\": \"x\",\n  \"kind\": 3\n}"));
  EXPECT_TRUE(Accepts("{}", "[ 1, {\"a\" :\tnull} ]"));
}

TEST(JsonMatcherTest, ShortestCompletionCountsRequiredPropertiesAndClosers) {
  GrammarMatcher m = StartJson(Schema(R"({"type":"object","properties":{"a":{"type":"integer"},
    "b":{"type":"array","items":{"type":"string"},"minItems":2}},"required":["a","b"]})"));
  EXPECT_EQ(m.MinCompletionBytes(), std::string(R"({"a":0,"b":["",""]})").size());
  ASSERT_TRUE(m.Advance(R"({"a":)"));
  EXPECT_EQ(m.MinCompletionBytes(), std::string(R"(0,"b":["",""]})").size());
  ASSERT_TRUE(m.Advance(R"(17,"b":["xy)"));
  EXPECT_EQ(m.MinCompletionBytes(), std::string("\",\"\"]}").size());
  ASSERT_TRUE(m.Advance(R"(","z"]})"));
  EXPECT_EQ(m.MinCompletionBytes(), 0);
  EXPECT_TRUE(m.Complete());
}

// From every prefix of a document, following bytes that each shorten the completion by one
// ends in a complete document after exactly MinCompletionBytes bytes, and it parses.
TEST(JsonMatcherTest, ShortestCompletionIsReachableFromEveryPrefix) {
  const std::string schema = R"({"type":"object","properties":{"id":{"type":"integer"},
    "v":{"anyOf":[{"type":"null"},{"type":"array","items":{"enum":["p","qq"]},"minItems":1}]},
    "o":{"type":"object","properties":{"s":{"type":"string"}},"required":["s"]}},
    "required":["id","v","o"]})";
  const std::string doc = R"({"id":-40,"v":["qq","p"],"o":{"s":"a\u0041b"}})";
  for (size_t cut = 0; cut <= doc.size(); ++cut) {
    GrammarMatcher m = StartJson(Schema(schema));
    ASSERT_TRUE(m.Advance(doc.substr(0, cut))) << cut;
    std::string out = doc.substr(0, cut);
    const int64_t need = m.MinCompletionBytes();
    for (int64_t step = 0; step < need; ++step) {
      bool moved = false;
      for (int byte = 0; byte < 256 && !moved; ++byte) {
        GrammarMatcher next = m;
        if (next.Advance(static_cast<uint8_t>(byte)) &&
            next.MinCompletionBytes() == need - step - 1) {
          m = next;
          out.push_back(static_cast<char>(byte));
          moved = true;
        }
      }
      ASSERT_TRUE(moved) << "stuck after " << out;
    }
    EXPECT_TRUE(m.Complete()) << out;
    EXPECT_FALSE(nlohmann::json::parse(out, nullptr, false).is_discarded()) << out;
  }
}

TEST(JsonMatcherTest, AWideAnyOfKeepsItsShortestAlternativeReachable) {
  // 20 long alternatives before "z": more than kMaxStacks (16) stacks start at the value's '"'.
  std::string alternatives;
  for (int i = 0; i < 20; ++i) {
    alternatives += absl::StrCat(R"({"const":"alternative_number_)", i, R"(_is_long"},)");
  }
  const std::string schema = R"({"type":"object","properties":{"a":{"anyOf":[)" + alternatives +
                             R"({"const":"z"}]}},"required":["a"],"additionalProperties":false})";
  EXPECT_EQ(StartJson(Schema(schema)).MinCompletionBytes(), 9);
  GrammarMatcher m = StartJson(Schema(schema));
  EXPECT_EQ(testing::WalkShortestCompletion(m), R"({"a":"z"})");
  EXPECT_TRUE(m.Complete());
  EXPECT_TRUE(Accepts(schema, R"({"a":"alternative_number_3_is_long"})"));
}

TEST(JsonSchemaTest, RefusesKeywordsItCannotEnforceByName) {
  for (const char* keyword : {"pattern", "format", "minLength", "minimum", "$ref", "allOf", "oneOf",
                              "uniqueItems", "patternProperties"}) {
    const std::string schema =
        std::string(R"({"type":"object","properties":{"x":{")") + keyword + R"(":1}}})";
    absl::StatusOr<std::shared_ptr<const JsonSchema>> compiled = JsonSchema::Parse(schema);
    ASSERT_FALSE(compiled.ok()) << keyword;
    EXPECT_NE(compiled.status().message().find(std::string("'") + keyword + "'"), std::string::npos)
        << compiled.status();
    EXPECT_NE(compiled.status().message().find("#/properties/x"), std::string::npos);
  }
  EXPECT_FALSE(JsonSchema::Parse(R"({"required":["a"],"properties":{}})").ok());
  EXPECT_FALSE(JsonSchema::Parse(R"({"type":"string","anyOf":[{}]})").ok());
  EXPECT_FALSE(JsonSchema::Parse(R"({"type":"integer","enum":["a"]})").ok());
  EXPECT_TRUE(JsonSchema::Parse(R"({"title":"t","description":"d","type":"null"})").ok());
}

// 'items': false allows only []: with minItems >= 1 the schema accepts nothing and is refused
// (a breaker's trial got "[ ]" for it, the schema broken), nested too; with minItems 0 it is [].
TEST(JsonSchemaTest, ItemsFalseWithMinItemsIsRefusedAsAcceptingNothing) {
  for (const char* schema :
       {R"({"type":"array","items":false,"minItems":1})",
        R"({"type":"object","properties":{"a":{"type":"array","items":false,"minItems":2}}})",
        R"({"type":"array","items":{"type":"array","items":false,"minItems":1}})",
        R"({"type":"array","minItems":3,"items":false,"maxItems":5})"}) {
    absl::StatusOr<std::shared_ptr<const JsonSchema>> compiled = JsonSchema::Parse(schema);
    ASSERT_FALSE(compiled.ok()) << schema;
    EXPECT_EQ(compiled.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(compiled.status().message().find("accepts nothing"), std::string::npos)
        << compiled.status();
  }
  const std::string empty_only = R"({"type":"array","items":false,"minItems":0})";
  EXPECT_TRUE(Accepts(empty_only, "[]"));
  EXPECT_FALSE(Reads(empty_only, "[1"));
  EXPECT_TRUE(Accepts(R"({"type":"array","items":false})", "[ ]"));
  // minItems above maxItems is still refused by name.
  absl::StatusOr<std::shared_ptr<const JsonSchema>> crossed =
      JsonSchema::Parse(R"({"type":"array","maxItems":1,"minItems":2})");
  ASSERT_FALSE(crossed.ok());
  EXPECT_NE(crossed.status().message().find("'minItems' is larger than 'maxItems'"),
            std::string::npos);
}

// What the openai SDK's parse() sends for a pydantic model with a nested model, an enum and a
// list of the nested model (openai.lib._pydantic.to_strict_json_schema).
const char kPydanticNested[] = R"({"$defs":{
  "Color":{"enum":["red","blue"],"title":"Color","type":"string"},
  "Sub":{"properties":{"x":{"title":"X","type":"integer"},
    "y":{"anyOf":[{"type":"number"},{"type":"null"}],"title":"Y"}},
    "required":["x","y"],"title":"Sub","type":"object","additionalProperties":false}},
  "properties":{"book":{"title":"Book","type":"string"},"color":{"$ref":"#/$defs/Color"},
    "sub":{"$ref":"#/$defs/Sub"},"subs":{"items":{"$ref":"#/$defs/Sub"},"title":"Subs","type":"array"}},
  "required":["book","color","sub","subs"],"title":"Verse","type":"object",
  "additionalProperties":false})";

TEST(JsonSchemaTest, LocalRefsCompileInPlaceOfTheReference) {
  EXPECT_TRUE(
      Accepts(kPydanticNested,
              R"({"book":"Ruth","color":"red","sub":{"x":1,"y":null},"subs":[{"x":2,"y":0.5}]})"));
  EXPECT_TRUE(
      Accepts(kPydanticNested, R"({"book":"","color":"blue","sub":{"x":1,"y":2},"subs":[]})"));
  EXPECT_FALSE(Reads(kPydanticNested, R"({"book":"Ruth","color":"green")"));          // enum
  EXPECT_FALSE(Reads(kPydanticNested, R"({"book":"R","color":"red","sub":{"y":1)"));  // order
  EXPECT_FALSE(Reads(kPydanticNested, R"({"book":"R","color":"red","sub":{"x":1,"y":1,"z")"));
  EXPECT_FALSE(
      Reads(kPydanticNested, R"({"book":"R","color":"red","sub":{"x":1,"y":1},"subs":[{"x":1.5)"));
  // Draft-7 "definitions", a pointer with RFC 6901 escapes and a reference through another one.
  EXPECT_TRUE(
      Accepts(R"({"definitions":{"a/b":{"type":"integer"},"c~d":{"$ref":"#/definitions/a~1b"}},
                          "type":"array","items":{"$ref":"#/definitions/c~0d"}})",
              "[1,2]"));
  EXPECT_FALSE(
      Reads(R"({"definitions":{"a/b":{"type":"integer"}},"items":{"$ref":"#/definitions/a~1b"},
                         "type":"array"})",
            R"(["x")"));
}

TEST(JsonSchemaTest, ShortestCompletionCountsTheReferencedSchema) {
  GrammarMatcher m = StartJson(Schema(
      R"({"$defs":{"P":{"type":"object","properties":{"k":{"const":"vv"}},"required":["k"]}},
          "$ref":"#/$defs/P"})"));
  EXPECT_EQ(m.MinCompletionBytes(), static_cast<int64_t>(std::string(R"({"k":"vv"})").size()));
}

TEST(JsonSchemaTest, RefusesRecursiveDanglingRemoteAndConstrainedRefs) {
  struct Case {
    const char* schema;
    const char* message;
  };
  for (const Case& c : {
           Case{R"({"$ref":"#"})", "refers back into itself"},
           Case{R"({"type":"object","properties":{"child":{"$ref":"#"}}})",
                "refers back into itself"},
           Case{R"({"$defs":{"n":{"type":"object","properties":{"next":{"$ref":"#/$defs/n"}}}},
                   "$ref":"#/$defs/n"})",
                "refers back into itself"},
           Case{R"({"$defs":{"a":{"anyOf":[{"$ref":"#/$defs/b"}]},"b":{"$ref":"#/$defs/a"}},
                   "$ref":"#/$defs/a"})",
                "refers back into itself"},
           Case{R"({"$ref":"#/$defs/missing"})", "names nothing in the schema"},
           Case{R"({"$ref":"#anchor"})", "names nothing in the schema"},
           Case{R"({"$ref":"https://example.com/s.json"})", "must be a reference into this schema"},
           Case{R"({"$ref":5})", "must be a reference into this schema"},
           Case{R"({"$defs":{"a":{"type":"string"}},"$ref":"#/$defs/a","type":"integer"})",
                "keyword 'type' next to '$ref' is not supported"},
       }) {
    absl::StatusOr<std::shared_ptr<const JsonSchema>> compiled = JsonSchema::Parse(c.schema);
    ASSERT_FALSE(compiled.ok()) << c.schema;
    EXPECT_NE(compiled.status().message().find(c.message), std::string::npos) << compiled.status();
  }
}

TEST(JsonSchemaTest, RefsKeepTheNestingLimitWhereTheyAreUsed) {
  // Three nested arrays below `outer` arrays, written out and through a '$ref': refused exactly
  // when written out they nest deeper than kMaxNesting.
  const std::string three = R"({"type":"array","items":{"type":"array","items":{"type":"array"}}})";
  int accepted = 0;
  for (int outer = 20; outer <= 23; ++outer) {
    std::string open;
    std::string close;
    for (int i = 0; i < outer; ++i) {
      open += R"({"type":"array","items":)";
      close += "}";
    }
    const std::string inline_schema = open + three + close;
    const std::string ref_schema = R"({"$defs":{"d":)" + three + R"(},"type":"array","items":)" +
                                   open.substr(std::string(R"({"type":"array","items":)").size()) +
                                   R"({"$ref":"#/$defs/d"})" + close;
    absl::StatusOr<std::shared_ptr<const JsonSchema>> a = JsonSchema::Parse(inline_schema);
    absl::StatusOr<std::shared_ptr<const JsonSchema>> b = JsonSchema::Parse(ref_schema);
    EXPECT_EQ(a.ok(), b.ok()) << outer << " " << a.status() << " / " << b.status();
    if (!b.ok()) {
      EXPECT_NE(b.status().message().find("deeper than"), std::string::npos) << b.status();
    }
    accepted += b.ok() ? 1 : 0;
  }
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, 4);
}

TEST(JsonSchemaTest, RefExpansionIsBounded) {
  // Each level references the next twice, at the same depth: 40 levels would expand to 2^40
  // schemas if every reference compiled anew; it compiles each definition once.
  std::string schema = R"({"$defs":{)";
  for (int i = 0; i < 40; ++i) {
    schema += absl::StrCat("\"d", i, "\":{\"anyOf\":[{\"$ref\":\"#/$defs/d", i + 1,
                           "\"},{\"$ref\":\"#/$defs/d", i + 1, "\"}]},");
  }
  schema += R"("d40":{"type":"integer"}},"$ref":"#/$defs/d0"})";
  EXPECT_TRUE(Accepts(schema, "17"));
}

// A schema of 100k properties cost seconds per token before (the mask's work at a key grows with
// its object's properties); a schema may declare kMaxProperties in all, counted across objects.
TEST(JsonSchemaTest, PropertiesAreBoundedInAllAcrossObjects) {
  auto object = [](int from, int count, const std::string& inner) {
    std::string properties;
    for (int i = from; i < from + count; ++i) {
      properties += absl::StrCat(i == from ? "" : ",", "\"p", i, "\":{}");
    }
    if (!inner.empty()) properties += ",\"inner\":" + inner;
    return R"({"type":"object","properties":{)" + properties + "}}";
  };
  // 4000 + 1000 properties, "inner" one of them: 5000 in all.
  const std::string at_limit = object(0, 3999, object(4000, 1000, ""));
  ASSERT_TRUE(JsonSchema::Parse(at_limit).ok()) << JsonSchema::Parse(at_limit).status();
  const absl::Status over = JsonSchema::Parse(object(0, 3999, object(4000, 1001, ""))).status();
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(over.message(),
            "the schema declares more than 5000 properties in all (at #/properties/inner)");
}

// The per-object tables the automaton reads at a key equal their definitions: the last property
// that may come next (the first required one at or after i, else the last) and the shortest close
// through any candidate.
TEST(JsonSchemaTest, KeyTablesEqualTheirDefinitions) {
  std::string properties;
  std::string required;
  for (int i = 0; i < 40; ++i) {
    // Values of different shortest lengths; every fifth property (and a run at 20-23) required.
    const char* value = i % 3 == 0   ? R"({"type":"integer"})"
                        : i % 3 == 1 ? R"({"type":"string"})"
                                     : R"({"type":"boolean"})";
    properties += absl::StrCat(i == 0 ? "" : ",", "\"k", std::string(i % 7, 'x'), i, "\":", value);
    if (i % 5 == 4 || (i >= 20 && i < 24)) {
      required +=
          absl::StrCat(required.empty() ? "" : ",", "\"k", std::string(i % 7, 'x'), i, "\"");
    }
  }
  const std::shared_ptr<const JsonSchema> schema = Schema(
      R"({"type":"object","properties":{)" + properties + "},\"required\":[" + required + "]}");
  const SchemaNode& node = schema->root();
  const size_t n = node.properties.size();
  ASSERT_EQ(n, 40u);
  for (size_t i = 0; i < n; ++i) {
    size_t last = n - 1;
    for (size_t j = i; j < n; ++j) {
      if (node.properties[j].required) {
        last = j;
        break;
      }
    }
    int64_t best = node.via_key[i];
    for (size_t j = i; j <= last; ++j) best = std::min(best, node.via_key[j]);
    EXPECT_EQ(node.last_candidate[i], last) << i;
    EXPECT_EQ(node.key_start_cost[i], best) << i;
  }
  // Through the automaton: after the first property the cheapest close goes straight to the first
  // required one, "kxxxx4" (an optional one before it would add its own bytes).
  GrammarMatcher m = StartJson(schema);
  ASSERT_TRUE(m.Advance(R"({"k0":1,)"));
  EXPECT_EQ(testing::WalkShortestCompletion(m).substr(0, 7), R"("kxxxx4)");
}

// Schema text from a worker RPC is checked before it is parsed: an ordered_json object that grows
// copies its members, recursing once per level, and this text overflowed the worker's stack.
TEST(JsonSchemaTest, SchemaTextNestedTooDeepIsInvalidArgumentNotACrash) {
  const std::string deep =
      R"({"a":)" + std::string(100000, '[') + std::string(100000, ']') + R"(,"b":1,"c":2})";
  const absl::Status status = JsonSchema::Parse(deep).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "the schema nests deeper than 256 JSON levels");
}

}  // namespace
}  // namespace pdserve::structured
