#include "prefill/test_faults.h"

#include <cstdlib>
#include <string>

#include "absl/strings/numbers.h"

namespace pdserve::prefill {
namespace {

std::optional<uint64_t> ParseId(const char* text) {
  uint64_t id = 0;
  if (text == nullptr || !absl::SimpleAtoi(text, &id)) return std::nullopt;
  return id;
}

}  // namespace

TestFaults TestFaults::FromEnvironment() {
  TestFaults faults;
  faults.corrupt_request = ParseId(std::getenv("PDSERVE_TEST_CORRUPT_REQUEST"));
  int64_t corrupt_len = 0;
  const char* corrupt_len_text = std::getenv("PDSERVE_TEST_CORRUPT_PROMPT_LEN");
  if (corrupt_len_text != nullptr && absl::SimpleAtoi(corrupt_len_text, &corrupt_len)) {
    faults.corrupt_prompt_len = corrupt_len;
  }
  const char* delay = std::getenv("PDSERVE_TEST_DELAY_REQUEST");
  if (delay != nullptr && std::string(delay) == "all") {
    faults.delay_all = true;
  } else {
    faults.delay_request = ParseId(delay);
  }
  int64_t min_prompt = 0;
  const char* min_prompt_text = std::getenv("PDSERVE_TEST_DELAY_MIN_PROMPT");
  if (min_prompt_text != nullptr && absl::SimpleAtoi(min_prompt_text, &min_prompt)) {
    faults.delay_min_prompt = min_prompt;
  }
  int64_t ms = 0;
  const char* delay_ms = std::getenv("PDSERVE_TEST_DELAY_MS");
  if (delay_ms != nullptr && absl::SimpleAtoi(delay_ms, &ms) && ms >= 0) {
    faults.delay = absl::Milliseconds(ms);
  }
  return faults;
}

bool TestFaults::Apply(uint64_t request_id, int64_t prompt_tokens,
                       kv::FaultInjectingTransport& transport) const {
  bool applied = false;
  if (corrupt_request == request_id || corrupt_prompt_len == prompt_tokens) {
    transport.AddRule({.action = kv::FaultRule::Action::kCorruptByte,
                       .kind = kv::WireKind::kPage,
                       .slot = 0,
                       .offset = 5});
    applied = true;
  }
  if ((delay_all && prompt_tokens >= delay_min_prompt) || delay_request == request_id) {
    transport.AddRule({.action = kv::FaultRule::Action::kDelay,
                       .kind = kv::WireKind::kPage,
                       .delay = delay,
                       .uses = -1});
    applied = true;
  }
  return applied;
}

}  // namespace pdserve::prefill
