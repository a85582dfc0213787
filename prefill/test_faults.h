// TEST-ONLY fault switches of the prefill worker, read from the environment at start. Off unless
// set; never set them in a deployment. They wrap one request's transport in
// kv::FaultInjectingTransport so the integration tests can corrupt a page in flight and hold a
// transfer open long enough to abort or kill a process mid-transfer (docs/protocol.md).
//
//   PDSERVE_TEST_CORRUPT_REQUEST=ID   invert one byte of slot 0's payload of request ID
//   PDSERVE_TEST_CORRUPT_PROMPT_LEN=N invert that byte in every request of exactly N prompt tokens
//                                     (for tests through the router, which assigns the ids)
//   PDSERVE_TEST_DELAY_REQUEST=ID|all hold every page of request ID (or of every request) ...
//   PDSERVE_TEST_DELAY_MS=MS          ... for MS milliseconds after it is posted (default 2000)
//   PDSERVE_TEST_DELAY_MIN_PROMPT=N   with `all`: only requests of >= N prompt tokens (so the
//                                     router's short health canaries pass undelayed)
//
// Thread-safety: immutable after FromEnvironment.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/time/time.h"
#include "kvtransfer/fault_transport.h"

namespace pdserve::prefill {

struct TestFaults {
  std::optional<uint64_t> corrupt_request;
  std::optional<int64_t> corrupt_prompt_len;
  bool delay_all = false;
  std::optional<uint64_t> delay_request;
  int64_t delay_min_prompt = 0;  // delay_all applies to prompts of at least this many tokens
  absl::Duration delay = absl::Seconds(2);

  static TestFaults FromEnvironment();
  bool any() const { return corrupt_request || corrupt_prompt_len || delay_all || delay_request; }
  // Adds the rules that apply to `request_id` (of `prompt_tokens` tokens) to `transport`; false
  // when none applies.
  bool Apply(uint64_t request_id, int64_t prompt_tokens,
             kv::FaultInjectingTransport& transport) const;
};

}  // namespace pdserve::prefill
