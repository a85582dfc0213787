// TEST-ONLY fault switches of the decode worker, read from the environment at start. Off unless
// set; never set them in a deployment.
//
//   PDSERVE_TEST_STALL_DECODE_LOOP_MS=MS  the decode loop stops making progress MS milliseconds
//                                         after it started (it waits until the worker stops, as
//                                         a hung step would), so the systemd watchdog test sees
//                                         a wedged worker stop its pings
//
// Thread-safety: immutable after FromEnvironment.
#pragma once

#include <optional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve::decode {

struct TestFaults {
  std::optional<absl::Duration> stall_loop_after;

  static TestFaults FromEnvironment();
  // Whether the decode loop, started at `loop_start`, is to stall now.
  bool StallsLoop(absl::Time loop_start) const {
    return stall_loop_after && absl::Now() - loop_start >= *stall_loop_after;
  }
};

}  // namespace pdserve::decode
