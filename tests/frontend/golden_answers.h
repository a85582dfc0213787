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

}  // namespace pdserve::frontend::testing
