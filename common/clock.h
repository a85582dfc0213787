// An injectable source of time, so tests can move time by hand (house style: injectable clock).
// Implementations must be safe to call from any thread.
#pragma once

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// Wall-clock time (absl::Now()).
class SystemClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
};

}  // namespace pdserve
