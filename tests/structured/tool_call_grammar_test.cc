// The DSML tool-call grammar (tool_choice "required" / a named function): DeepSeek's own encoding
// of a call (the golden fixture of tools/text_chat_golden.py) is accepted, malformed calls are
// refused, the token mask equals a brute force over the bundled tokenizer's vocabulary, and
// random walks through the mask always end in a block that text::ChatOutputParser turns into
// tool calls whose arguments validate against their function's schema.
#include "structured/tool_call_grammar.h"

#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "serving/sampler.h"
#include "structured/grammar_constraint.h"
#include "tests/structured/shortest_walk.h"
#include "text/chat_output_parser.h"
#include "text/tokenizer.h"

namespace pdserve::structured {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

constexpr int32_t kEos = 1;  // the bundled model's eos_token_id
constexpr char kDsml[] = "｜DSML｜";

const std::shared_ptr<const TokenVocabulary>& Vocabulary() {
  static const auto* vocabulary = new std::shared_ptr<const TokenVocabulary>(
      *TokenVocabulary::FromTokenizer(**text::Tokenizer::Load(PDSERVE_BUNDLED_MODEL)));
  return *vocabulary;
}

const ordered_json& Golden() {
  static const auto* golden = [] {
    std::ifstream in(PDSERVE_CHAT_GOLDEN);
    std::stringstream text;
    text << in.rdbuf();
    return new ordered_json(ordered_json::parse(text.str()));
  }();
  return *golden;
}

// The golden fixture's get_weather function without "minimum" (a keyword the grammar cannot
// enforce; ParseRefusesWhatItCannotEnforce checks the refusal).
ordered_json GoldenWeather() {
  for (const ordered_json& c : Golden()["cases"]) {
    if (!c.contains("tools") || c["tools"].empty()) continue;
    ordered_json f = c["tools"][0]["function"];
    f["parameters"]["properties"]["days"].erase("minimum");
    return f;
  }
  return {};
}

std::string Spec(const std::vector<ordered_json>& functions, bool parallel = true) {
  return ToolCallGrammar::Spec(kDsml, parallel, functions);
}

std::shared_ptr<const ToolCallGrammar> Grammar(const std::vector<ordered_json>& functions,
                                               bool parallel = true) {
  auto g = ToolCallGrammar::Parse(Spec(functions, parallel));
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : nullptr;
}

bool Accepts(const std::shared_ptr<const ToolCallGrammar>& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.Advance(text) && m.Complete();
}

bool Reads(const std::shared_ptr<const ToolCallGrammar>& g, const std::string& text) {
  GrammarMatcher m(g);
  return m.Advance(text);
}

std::string Call(const std::string& name, const std::string& params) {
  return "<｜DSML｜invoke name=\"" + name + "\">\n" + params + "\n</｜DSML｜invoke>";
}
std::string Block(const std::string& invokes) {
  return "\n\n<｜DSML｜tool_calls>\n" + invokes + "\n</｜DSML｜tool_calls>";
}
std::string Param(const std::string& key, bool raw, const std::string& value) {
  return "<｜DSML｜parameter name=\"" + key + "\" string=\"" + (raw ? "true" : "false") + "\">" +
         value + "</｜DSML｜parameter>";
}

// The functions the random walks call: strings, enums, numbers, booleans, arrays, nested
// objects, anyOf, optional and required parameters, a function without parameters.
std::vector<ordered_json> Functions() {
  return {GoldenWeather(), ordered_json::parse(R"({"name": "now", "parameters": {"type": "object",
              "properties": {}}})"),
          ordered_json::parse(R"({"name": "search", "parameters": {"type": "object",
              "properties": {"query": {"type": "string"},
                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                             "limit": {"type": "integer"}, "exact": {"type": "boolean"},
                             "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                             "filter": {"type": "object", "properties": {
                                 "from": {"type": "number"}, "to": {"type": ["number", "null"]}},
                                 "required": ["from"], "additionalProperties": false},
                             "mode": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
              "required": ["query", "unit"], "additionalProperties": false}})")};
}

TEST(ToolCallGrammarTest, AWideAnyOfInAParameterKeepsItsShortestAlternativeReachable) {
  // 20 long arrays before [7]: more than kMaxStacks (16) stacks start at the value's '['.
  ordered_json alternatives = ordered_json::array();
  for (int i = 0; i < 20; ++i) {
    alternatives.push_back({{"const", ordered_json::array({1000000000000 + i})}});
  }
  alternatives.push_back({{"const", ordered_json::array({7})}});
  ordered_json f = {{"name", "f"},
                    {"parameters",
                     {{"type", "object"},
                      {"properties", {{"a", {{"anyOf", alternatives}}}}},
                      {"required", {"a"}}}}};
  GrammarMatcher m(Grammar({f}, /*parallel=*/false));
  EXPECT_EQ(testing::WalkShortestCompletion(m), Block(Call("f", Param("a", false, "[7]"))));
  EXPECT_TRUE(m.Complete());
}

TEST(ToolCallGrammarTest, AcceptsDeepSeeksOwnEncodingOfACall) {
  auto g = Grammar({GoldenWeather(), {{"name", "now"}, {"parameters", {{"type", "object"}}}}});
  int checked = 0;
  for (const ordered_json& c : Golden()["completions"]) {
    const std::string completion = c["completion"];
    if (c["thinking"].get<bool>() || c["tool_calls"].empty()) continue;
    const std::string block = completion.substr(completion.find("\n\n<｜DSML｜tool_calls>"));
    const std::string body =
        block.substr(0, block.size() - std::string("<｜end▁of▁sentence｜>").size());
    // The second answer passes "extra", which get_weather does not declare.
    const bool declared = body.find("\"extra\"") == std::string::npos;
    EXPECT_EQ(Accepts(g, body), declared) << body;
    ++checked;
  }
  EXPECT_EQ(checked, 2);
}

TEST(ToolCallGrammarTest, RefusesUndeclaredNamesMissingRequiredOrderAndWrongEncoding) {
  auto g = Grammar({GoldenWeather()});
  const std::string city = Param("city", true, "Oslo");
  EXPECT_TRUE(Accepts(g, Block(Call("get_weather", city))));
  EXPECT_TRUE(
      Accepts(g, Block(Call("get_weather", city + "\n" + Param("detail", false, "-1.5e3")))));
  EXPECT_TRUE(Accepts(g, Block(Call("get_weather", city) + "\n" + Call("get_weather", city))));
  EXPECT_FALSE(Reads(g, Block(Call("get_time", city))));     // not a tool
  EXPECT_FALSE(Accepts(g, Block(Call("get_weather", ""))));  // city missing
  EXPECT_FALSE(Reads(g, Block(Call("get_weather", Param("days", false, "2") + "\n" + city))));
  EXPECT_FALSE(Reads(g, Block(Call("get_weather", Param("city", false, "\"Oslo\"")))));
  EXPECT_FALSE(Reads(g, Block(Call("get_weather", city + "\n" + Param("days", false, "2.5")))));
  EXPECT_FALSE(Reads(g, Block(Call("get_weather", city + "\n" + Param("days", true, "2")))));
  EXPECT_FALSE(Reads(g, Block(Call("get_weather", Param("city", true, "a｜b")))));
  EXPECT_TRUE(Accepts(g, Block(Call("get_weather", Param("city", true, "<b>x</b>\n\"q\"")))));
  EXPECT_FALSE(Reads(g, "content first" + Block(Call("get_weather", city))));
  EXPECT_FALSE(Reads(g, Block(Call("get_weather", city)) + "\n"));  // only EOS may follow
  // Inside a JSON value the DSML marker's first character only escaped (the closing tag).
  auto search = Grammar({Functions()[2]});
  const std::string head = Param("query", true, "q") + "\n" + Param("unit", true, "celsius") + "\n";
  EXPECT_TRUE(
      Accepts(search, Block(Call("search", head + Param("tags", false, R"(["a\uff5cb"])")))));
  EXPECT_FALSE(Reads(search, Block(Call("search", head + Param("tags", false, R"(["a｜b"])")))));
  EXPECT_FALSE(Reads(search, Block(Call("search", head + Param("unit", true, "kelvin")))));
  auto single = Grammar({GoldenWeather()}, /*parallel=*/false);
  EXPECT_FALSE(Reads(single, Block(Call("get_weather", city) + "\n" + Call("get_weather", city))));
}

TEST(ToolCallGrammarTest, ParseRefusesWhatItCannotEnforce) {
  ordered_json weather = GoldenWeather();
  weather["parameters"]["properties"]["days"]["minimum"] = 1;
  auto refused = ToolCallGrammar::Parse(Spec({weather}));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("keyword 'minimum'"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("#/properties/days"), std::string::npos);
  const auto refuses = [](const char* functions) {
    return !ToolCallGrammar::Parse(Spec(ordered_json::parse(functions))).ok();
  };
  EXPECT_TRUE(refuses(R"([{"name": "a\"b"}])"));              // a quote in the name
  EXPECT_TRUE(refuses(R"([{"name": "f"}, {"name": "f"}])"));  // declared twice
  EXPECT_TRUE(refuses(R"([{"name": "f", "parameters": {"anyOf": [{"type": "object"}]}}])"));
  EXPECT_TRUE(refuses(R"([{"name": "f", "parameters": {"type": "string"}}])"));
  EXPECT_FALSE(refuses(R"([{"name": "f"}])"));
}

// Validates `value` against the supported keywords of `schema`: an oracle written apart from the
// grammar.
bool Valid(const json& value, const json& schema) {
  if (schema.contains("anyOf")) {
    for (const json& alt : schema["anyOf"]) {
      if (Valid(value, alt)) return true;
    }
    return false;
  }
  if (schema.contains("enum") &&
      std::find(schema["enum"].begin(), schema["enum"].end(), value) == schema["enum"].end()) {
    return false;
  }
  if (schema.contains("type")) {
    const json types = schema["type"].is_array() ? schema["type"] : json::array({schema["type"]});
    bool ok = false;
    for (const json& t : types) {
      ok = ok || (t == "object" && value.is_object()) || (t == "array" && value.is_array()) ||
           (t == "string" && value.is_string()) || (t == "number" && value.is_number()) ||
           (t == "integer" && value.is_number_integer()) ||
           (t == "boolean" && value.is_boolean()) || (t == "null" && value.is_null());
    }
    if (!ok) return false;
  }
  if (value.is_object()) {
    const json properties = schema.value("properties", json::object());
    for (const json& r : schema.value("required", json::array())) {
      if (!value.contains(r.get<std::string>())) return false;
    }
    for (const auto& [key, v] : value.items()) {
      if (properties.contains(key)) {
        if (!Valid(v, properties[key])) return false;
      } else if (schema.value("additionalProperties", json(true)) == json(false)) {
        return false;
      }
    }
  }
  if (value.is_array()) {
    if (value.size() > schema.value("maxItems", size_t{1} << 20)) return false;
    for (const json& item : value) {
      if (schema.contains("items") && !Valid(item, schema["items"])) return false;
    }
  }
  return true;
}

bool Bit(const std::vector<uint64_t>& bits, int32_t t) { return (bits[t / 64] >> (t % 64)) & 1; }

TEST(ToolCallGrammarTest, MaskEqualsBruteForceAlongABlock) {
  auto constraint = std::make_shared<GrammarConstraint>(Grammar(Functions()), Vocabulary());
  const std::string block = Block(
      Call("search", Param("query", true, "a </b> </x|y") + "\n" + Param("unit", true, "celsius") +
                         "\n" + Param("filter", false, R"({"from": 1.5, "to": null})")) +
      "\n" + Call("now", ""));
  GrammarMatcher m = constraint->Start();
  const int64_t vocab = Vocabulary()->size();
  for (size_t i = 0; i <= block.size(); ++i) {
    std::vector<uint64_t> mask;
    ASSERT_TRUE(constraint->FillMask(m, 1 << 20, {&kEos, 1}, vocab, &mask).ok());
    for (int32_t t = 0; t < vocab; ++t) {
      if (t == kEos) continue;
      GrammarMatcher copy = m;
      const std::string& bytes = Vocabulary()->bytes(t);
      ASSERT_EQ(Bit(mask, t), !bytes.empty() && copy.Advance(bytes))
          << "token " << t << " after " << block.substr(0, i);
    }
    EXPECT_EQ(Bit(mask, kEos), i == block.size()) << block.substr(0, i);
    if (i < block.size()) {
      ASSERT_TRUE(m.Advance(static_cast<uint8_t>(block[i]))) << block.substr(0, i);
    }
  }
}

// One random walk through the mask until EOS or max_tokens: uniformly random allowed tokens,
// except that at a random tenth of the steps the walk starts to spell one of the texts that end
// a raw or a JSON string (when the mask allows it), so that values end before the budget binds
// and the optional parameters, later calls and nested values get their turn.
std::string Walk(GrammarConstraint& constraint, int64_t max_tokens, std::mt19937& rng,
                 bool* complete) {
  static const std::string kEnds[] = {"</｜DSML｜parameter>", "\""};
  GrammarMatcher m = constraint.Start();
  const int64_t vocab = Vocabulary()->size();
  std::string out, spelling;
  std::vector<uint64_t> mask;
  std::vector<int32_t> allowed, spell;
  for (int64_t step = 0; step < max_tokens; ++step) {
    EXPECT_TRUE(constraint.FillMask(m, max_tokens - step, {&kEos, 1}, vocab, &mask).ok());
    if (spelling.empty() && rng() % 10 == 0) spelling = kEnds[rng() % 2];
    allowed.clear();
    spell.clear();
    for (int32_t t = 0; t < vocab; ++t) {
      if (!Bit(mask, t)) continue;
      allowed.push_back(t);
      const std::string& bytes = Vocabulary()->bytes(t);
      if (!bytes.empty() && spelling.starts_with(bytes)) spell.push_back(t);
    }
    if (spell.empty()) spelling.clear();
    const int32_t t = spell.empty() ? allowed[rng() % allowed.size()] : spell[rng() % spell.size()];
    if (!spell.empty()) spelling.erase(0, Vocabulary()->bytes(t).size());
    if (t == kEos) break;
    EXPECT_TRUE(constraint.Accept(m, t));
    out += Vocabulary()->bytes(t);
  }
  *complete = m.Complete();
  return out;
}

// Parses `text` in pieces of random sizes: the tool calls, and any content left over.
std::vector<text::ParsedToolCall> ParseCalls(const std::string& text, std::mt19937& rng,
                                             std::string* content) {
  text::ChatOutputParser parser({.tools = true, .dsml = kDsml});
  std::vector<text::ParsedToolCall> calls;
  auto take = [&](text::ChatOutputPiece piece) {
    *content += piece.content;
    for (auto& c : piece.tool_calls) calls.push_back(std::move(c));
  };
  for (size_t at = 0; at < text.size();) {
    const size_t n = 1 + rng() % 16;
    take(parser.Add(std::string_view(text).substr(at, n)));
    at += n;
  }
  take(parser.Finish());
  return calls;
}

// Every random walk (400 per tool set: 3 sets, parallel on and off, budgets from tight to
// loose) ends in a complete block that parses into calls of declared functions whose arguments
// validate; parallel_tool_calls false gives exactly one call. The walks reach every parameter of
// every function, and several calls in one block.
TEST(ToolCallGrammarTest, RandomWalksParseIntoToolCallsThatValidate) {
  std::mt19937 rng(29);
  const std::vector<ordered_json> all = Functions();
  const std::vector<std::vector<ordered_json>> sets = {all, {all[2]}, {all[0], all[1]}};
  int walks = 0, valid = 0, several = 0;
  std::set<std::string> seen;  // "function.parameter" (and "function" for a call of it)
  for (const auto& functions : sets) {
    for (bool parallel : {true, false}) {
      GrammarConstraint constraint(Grammar(functions, parallel), Vocabulary());
      const int64_t shortest = constraint.Start().MinCompletionBytes();
      for (int walk = 0; walk < 200; ++walk) {
        const int64_t max_tokens = shortest + static_cast<int64_t>(rng() % 240);
        bool complete = false;
        const std::string out = Walk(constraint, max_tokens, rng, &complete);
        std::string content;
        const std::vector<text::ParsedToolCall> calls = ParseCalls(out, rng, &content);
        bool ok = complete && content.empty() && !calls.empty() && (parallel || calls.size() == 1);
        for (const text::ParsedToolCall& call : calls) {
          const json args = json::parse(call.arguments, nullptr, false);
          const auto f =
              std::find_if(functions.begin(), functions.end(),
                           [&](const ordered_json& g) { return g["name"] == call.name; });
          ok = ok && f != functions.end() && args.is_object() &&
               Valid(args, json::parse(f->value("parameters", ordered_json::object()).dump()));
          if (!ok) continue;
          seen.insert(call.name);
          for (const auto& [key, value] : args.items()) seen.insert(call.name + "." + key);
        }
        EXPECT_TRUE(ok) << out;
        ++walks;
        valid += ok;
        several += calls.size() > 1;
      }
    }
  }
  EXPECT_EQ(valid, walks);
  for (const ordered_json& f : all) {
    const std::string name = f["name"];
    EXPECT_TRUE(seen.contains(name)) << name;
    for (const auto& [key, schema] : f["parameters"]["properties"].items()) {
      EXPECT_TRUE(seen.contains(name + "." + key)) << name << "." << key;
    }
  }
  EXPECT_GT(several, 0);
  std::cout << valid << " / " << walks << " random walks parse into valid tool calls (" << several
            << " with several calls)\n";
}

TEST(ToolCallGrammarTest, RequestSamplerMasksRandomLogits) {
  serving::SamplingParams params;
  params.temperature = 1.0;
  params.max_tokens = 300;
  params.tool_call_grammar = Spec({GoldenWeather()}, /*parallel=*/false);
  const int32_t eos[] = {kEos};
  const int64_t vocab = Vocabulary()->size();
  auto sampler = serving::RequestSampler::Create(params, "req", eos, std::vector<int32_t>{5}, vocab,
                                                 Vocabulary());
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::string out;
  while (!sampler->finished(0)) {
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (float& z : logits) z = normal(rng);
    absl::StatusOr<serving::SampleStep> next = sampler->Next(0, logits);
    ASSERT_TRUE(next.ok()) << next.status();
    if (next->sampled.token != kEos) out += Vocabulary()->bytes(next->sampled.token);
  }
  std::string content;
  const std::vector<text::ParsedToolCall> calls = ParseCalls(out, rng, &content);
  ASSERT_EQ(calls.size(), 1u) << out;
  EXPECT_EQ(calls[0].name, "get_weather");
  EXPECT_TRUE(json::parse(calls[0].arguments)["city"].is_string()) << calls[0].arguments;
  EXPECT_EQ(content, "");
}

// A spec from a worker RPC is checked before it is parsed (the schema's test says why).
// A function of `n` optional integer parameters (and `required` of them required, the last).
ordered_json WideFunction(int n, int required = 0) {
  ordered_json properties = ordered_json::object();
  ordered_json names = ordered_json::array();
  for (int i = 0; i < n; ++i) {
    const std::string name = "p" + std::to_string(i);
    properties[name] = {{"type", "integer"}};
    if (i >= n - required) names.push_back(name);
  }
  return {{"name", "wide"},
          {"parameters", {{"type", "object"}, {"properties", properties}, {"required", names}}}};
}

// n optional parameters make a grammar of about n^2 alternatives; 1000 of them (a 26 KB spec)
// took 5 s of a decode worker's Reserve, 3000 took 47 s. Past kMaxToolCallAlternatives the spec
// is refused, naming the function; below it the shortest completion is still exact.
TEST(ToolCallGrammarTest, GrammarsOfTooManyAlternativesAreRefusedNamingTheFunction) {
  const absl::Status status = ToolCallGrammar::Parse(Spec({WideFunction(1000)})).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(status.message(),
                                "more than 262144 alternatives (function "
                                "'wide' has 1000 parameters"))
      << status.message();
  // 1000 parameters of which the last 900 are required: about 100^2 + 900 alternatives.
  EXPECT_TRUE(ToolCallGrammar::Parse(Spec({WideFunction(1000, 900)})).ok());
  // 300 optional ones, then the shortest completion: the block with an invoke and no parameter.
  std::shared_ptr<const ToolCallGrammar> g = Grammar({WideFunction(300)}, /*parallel=*/false);
  ASSERT_NE(g, nullptr);
  GrammarMatcher m(g);
  EXPECT_EQ(testing::WalkShortestCompletion(m), Block(Call("wide", "")));
}

TEST(ToolCallGrammarTest, SpecNestedTooDeepIsInvalidArgumentNotACrash) {
  const std::string deep =
      R"({"a":)" + std::string(100000, '[') + std::string(100000, ']') + R"(,"b":1,"c":2})";
  const absl::Status status = ToolCallGrammar::Parse(deep).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "the tool-call grammar spec nests deeper than 256 JSON levels");
}

}  // namespace
}  // namespace pdserve::structured
