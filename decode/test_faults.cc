#include "decode/test_faults.h"

#include <cstdint>
#include <cstdlib>

#include "absl/strings/numbers.h"

namespace pdserve::decode {

TestFaults TestFaults::FromEnvironment() {
  TestFaults faults;
  int64_t ms = 0;
  const char* stall = std::getenv("PDSERVE_TEST_STALL_DECODE_LOOP_MS");
  if (stall != nullptr && absl::SimpleAtoi(stall, &ms) && ms >= 0) {
    faults.stall_loop_after = absl::Milliseconds(ms);
  }
  return faults;
}

}  // namespace pdserve::decode
