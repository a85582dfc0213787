// response_format on /v1/chat/completions: text, json_object and json_schema read into the schema
// the sampler enforces; what cannot be enforced is a 400 naming it.
#include <string>
#include <variant>

#include "frontend/api_request.h"
#include "gtest/gtest.h"

namespace pdserve::frontend {
namespace {

ParsedRequest Chat(const std::string& response_format) {
  return ParseRequest(Endpoint::kChatCompletions,
                      R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                      R"("response_format":)" +
                          response_format + "}");
}

std::string Schema(const std::string& response_format) {
  ParsedRequest parsed = Chat(response_format);
  if (auto* error = std::get_if<ApiError>(&parsed)) return "error: " + error->message;
  return std::get<ApiRequest>(parsed).json_schema;
}

TEST(ResponseFormatTest, TextIsUnconstrainedAndJsonObjectIsAnyObject) {
  EXPECT_EQ(Schema(R"({"type":"text"})"), "");
  EXPECT_EQ(Schema(R"({"type":"json_object"})"), R"({"type":"object"})");
}

TEST(ResponseFormatTest, JsonSchemaKeepsThePropertiesInTheOrderTheClientWrote) {
  EXPECT_EQ(Schema(R"({"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":)"
                   R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":)"
                   R"({"type":"integer"}},"required":["zeta","alpha"]}}})"),
            R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":)"
            R"({"type":"integer"}},"required":["zeta","alpha"]})");
}

TEST(ResponseFormatTest, UnenforceableKeywordsAndMalformedValuesAre400OnResponseFormat) {
  ParsedRequest parsed =
      Chat(R"({"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object",)"
           R"("properties":{"id":{"type":"string","pattern":"^a"}}}}})");
  ASSERT_TRUE(std::holds_alternative<ApiError>(parsed));
  const ApiError& e = std::get<ApiError>(parsed);
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "response_format");
  EXPECT_EQ(e.message,
            "'response_format.json_schema.schema': keyword 'pattern' is not supported (at "
            "#/properties/id)");
  EXPECT_EQ(Schema(R"({"type":"xml"})"),
            "error: 'response_format.type' must be text, json_object or json_schema, got 'xml'");
  EXPECT_EQ(Schema(R"({"type":"json_schema","json_schema":{"schema":{}}})"),
            "error: 'response_format.json_schema.name' must be a string of 1 to 64 letters, "
            "digits, '_' or '-'");
  EXPECT_EQ(Schema(R"({"type":"json_schema"})"),
            "error: 'response_format' of type json_schema needs a 'json_schema' object");
}

// A 2 MB body of nested schemas (under the 4 MiB body limit) is refused before anything copies
// or re-serializes it: both recurse once per level, and this depth overflowed the reading
// thread's stack (the router died with SIGSEGV).
TEST(ResponseFormatTest, AMillionLevelsDeepSchemaIs400NotACrash) {
  constexpr int kDepth = 200000;
  std::string schema;
  for (int i = 0; i < kDepth; ++i) schema += R"({"items":)";
  schema += "{}";
  schema += std::string(kDepth, '}');
  const std::string error =
      Schema(R"({"type":"json_schema","json_schema":{"name":"deep","schema":)" + schema + "}}");
  EXPECT_NE(error.find("nests deeper than 256 JSON levels"), std::string::npos)
      << error.substr(0, 200);
}

TEST(ResponseFormatTest, ASchemaJustUnderTheJsonDepthLimitReachesTheCompiler) {
  std::string schema;
  for (int i = 0; i < 100; ++i) schema += R"({"items":)";
  schema += "{}" + std::string(100, '}');
  const std::string error =
      Schema(R"({"type":"json_schema","json_schema":{"name":"deep","schema":)" + schema + "}}");
  // The compiler's own, stricter limit answers (schema levels, not JSON levels).
  EXPECT_NE(error.find("nests deeper than 24 levels"), std::string::npos) << error.substr(0, 200);
}

}  // namespace
}  // namespace pdserve::frontend
