// Worker selection policies of the router, one per role (router.prefill_policy and
// router.decode_policy in the deploy config):
//
//  - round_robin: the next healthy worker in turn.
//  - least_load: the healthy worker with the fewest requests in flight, counted at dispatch (the
//    router increments a worker's load when it sends it a request and decrements it when that
//    request's work on the worker ends), lowest index on ties.
//  - power_of_two: two distinct healthy workers drawn at random; the less loaded one.
//  - prefix_aware: requests whose prompts share their first kPrefixTokens tokens go to the same
//    worker (rendezvous hashing of that prefix over the healthy workers, so a worker going down
//    moves only its own prefixes), unless that worker's load exceeds the least loaded healthy
//    worker's by more than `load_cap`; then least_load decides.
//
// Pure logic over a snapshot of candidates; no I/O. Thread-safety: Pick() may be called from
// any thread (the round-robin cursor and the random generator are guarded).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string_view>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::router {

enum class PolicyKind { kRoundRobin, kLeastLoad, kPowerOfTwo, kPrefixAware };

// "round_robin" | "least_load" | "power_of_two" | "prefix_aware"; else InvalidArgument.
absl::StatusOr<PolicyKind> ParsePolicy(std::string_view name);

// One worker as the policy sees it.
struct Candidate {
  bool up = true;    // healthy and its circuit breaker closed
  int64_t load = 0;  // requests in flight on it (dispatched, not finished)
};

class Policy {
 public:
  // Prompt tokens that make up the prefix prefix_aware hashes.
  static constexpr size_t kPrefixTokens = 32;

  // `seed` seeds power_of_two's generator (tests pass a fixed one).
  explicit Policy(PolicyKind kind, int64_t load_cap = 8, uint64_t seed = 0x5eed);

  // The index of the chosen candidate, or -1 when none is up. `prompt` is used by prefix_aware
  // only. `exclude` (-1: none) is skipped, for a retry on another worker.
  int Pick(std::span<const Candidate> candidates, std::span<const int32_t> prompt,
           int exclude = -1);

  PolicyKind kind() const { return kind_; }

 private:
  int LeastLoad(std::span<const Candidate> candidates, int exclude) const;

  const PolicyKind kind_;
  const int64_t load_cap_;
  absl::Mutex mu_;
  uint64_t cursor_ ABSL_GUARDED_BY(mu_) = 0;
  std::mt19937_64 random_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router
