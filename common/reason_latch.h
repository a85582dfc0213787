// Once-per-change logging of a condition that repeats.
//
// A worker pair that cannot work together (another model, another UCX protocol implementation)
// fails every router health check, and the prefill worker refuses every ticket of that pair, the
// same way until someone changes the configuration: a line per occurrence floods the log and
// says nothing new. So the router logs a worker's check failure, and the prefill worker a refused
// ticket, only when the reason differs from the one recorded before. WithoutRequestId makes the
// reasons of two requests comparable.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pdserve {

// `message` without a leading "request <digits>: " (how per-request errors begin); unchanged
// otherwise. Pure; thread-safe.
std::string WithoutRequestId(std::string_view message);

// A reason alone, for ReasonLatch's default value.
struct LatchedReason {
  std::string reason;
};

// The value last recorded for a repeated condition. `Value` has a std::string member `reason`
// ("" when the condition is absent: the check passed) and whatever the caller keeps with it.
// Thread-safe.
template <typename Value = LatchedReason>
class ReasonLatch {
 public:
  // Records `value`; true when its reason is not empty and differs from the reason recorded
  // before: the caller logs it then, and only then. The first failure after a success is a
  // change; a success is recorded but never logged.
  bool Record(Value value) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const bool changed = !value.reason.empty() && value.reason != value_.reason;
    value_ = std::move(value);
    return changed;
  }

  Value last() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return value_;
  }

 private:
  mutable absl::Mutex mu_;
  Value value_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve
