// The golden chat answers of tools/text_chat_golden.py (DeepSeek's encoding of answers with
// reasoning and tool calls, and DeepSeek's own parse of each) as token streams of the bundled
// model's tokenizer, for the tests that feed them to frontend::ChoiceText. A test target that
// includes this defines PDSERVE_FIXTURES_DIR.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include "frontend/request_preparer.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend::testing {

inline constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";

// tests/fixtures/text/deepseek_v4_chat_golden.json's "completions": each {"thinking",
// "completion" (the answer's text, EOS last), "reasoning_content", "content", "tool_calls"}.
inline nlohmann::json GoldenCompletions() {
  std::ifstream in(PDSERVE_FIXTURES_DIR "/text/deepseek_v4_chat_golden.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return nlohmann::json::parse(text)["completions"];
}

// The ids of `text` (control tokens included, a trailing EOS text dropped), then EOS.
inline std::vector<int32_t> AnswerIds(const RequestPreparer& preparer, std::string text) {
  if (text.ends_with(kEos)) text.resize(text.size() - kEos.size());
  auto ids =
      preparer.tokenizer().Encode(text, {.add_special_tokens = false, .allow_special = true});
  EXPECT_TRUE(ids.ok()) << ids.status();
  if (!ids.ok()) return {};
  ids->push_back(preparer.eos_ids().at(0));
  return *ids;
}

// A forced call's whole answer as the tool-call grammar writes it: one invoke of
// get_weather(city: "Paris"), with the request kForcedCallRequest.
inline constexpr std::string_view kForcedCallBlock =
    "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter "
    "name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>";
inline constexpr std::string_view kForcedCallRequest =
    R"({"model":"m","messages":[{"role":"user","content":"go"}],"tools":[{"type":"function",)"
    R"("function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":)"
    R"({"type":"string"}},"required":["city"]}}}],"tool_choice":{"type":"function",)"
    R"("function":{"name":"get_weather"}}})";

// The ids of kForcedCallBlock up to the first one that ends inside the block's closing tag, after
// its "</" and at an ASCII byte (an answer max_tokens cut there: its invoke complete, no EOS),
// and their text in `text`.
inline std::vector<int32_t> CutInsideTheClosingTag(const RequestPreparer& preparer,
                                                   std::string* text) {
  std::vector<int32_t> ids = AnswerIds(preparer, std::string(kForcedCallBlock));
  ids.pop_back();  // EOS
  const size_t closing = kForcedCallBlock.rfind("</");
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(preparer.tokenizer().AppendTokenBytes(ids[i], false, &bytes).ok());
    // Past "</", short of the end, at a character's end (a cut answer drops a partial one).
    if (bytes.size() > closing + 2 && bytes.size() < kForcedCallBlock.size() &&
        static_cast<unsigned char>(bytes.back()) < 0x80) {
      ids.resize(i + 1);
      *text = bytes;
      return ids;
    }
  }
  ADD_FAILURE() << "no token ends inside the closing tag";
  return {};
}

}  // namespace pdserve::frontend::testing
