// Continuous batching over an abstract step: which sequences prefill (in chunks) and which decode
// in each engine step, with admission against the state page pool.
//
// Each step serves every decoding sequence one token and spends the rest of a per-step token
// budget on chunked prefill of admitted sequences, oldest admission first (the Sarathi-Serve /
// vLLM "chunked prefill" policy: Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM
// Inference with Sarathi-Serve", section 4). A sequence's pages for prompt + max_tokens are
// allocated once, at admission, so a running sequence never waits for memory and nothing is ever
// preempted: a full pool only delays (policy kWait) or refuses (kReject) new sequences.
// Admission is strict FIFO: a sequence that does not fit blocks those behind it, so a long
// prompt cannot be starved by a stream of short ones.
//
// The scheduler is pure logic: it never calls the engine. A step is BuildStep -> run the plan ->
// CompleteStep (or Step(runner) doing all three). Pages leave through a ReleaseFence, which in
// colocated mode frees them at once and in PD mode after the transfer fence (docs/serving.md).
//
// Thread-safety: all methods are safe to call concurrently (one absl::Mutex); Submit and Cancel
// typically come from request threads, BuildStep / CompleteStep from the one step loop. The
// ReleaseFence is called without the scheduler's lock held.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "serving/page_pool.h"

namespace pdserve::serving {

enum class AdmissionPolicy {
  kWait,    // a sequence that does not fit waits in FIFO order
  kReject,  // a sequence that does not fit now is refused with Unavailable (HTTP 503)
};

struct SchedulerOptions {
  int64_t token_budget = 2048;  // tokens per step, decode + prefill; must exceed max_running
  int64_t max_running = 64;     // sequences holding pages (prefilling or decoding), >= 1
  AdmissionPolicy policy = AdmissionPolicy::kWait;
  // A sequence still waiting after this long is dropped and listed in StepPlan::expired.
  absl::Duration max_queue_time = absl::InfiniteDuration();
};

// One sequence: one choice of one request. Its decode state holds prompt + max_tokens tokens.
struct SequenceSpec {
  RequestId id = 0;
  int64_t prompt_tokens = 0;  // >= 1
  int64_t max_tokens = 0;     // >= 1
};

// The pages a sequence of `total_tokens` (prompt + max_tokens) tokens needs, per page kind.
using PageDemandFn = std::function<PageDemand(int64_t total_tokens)>;

// Where a departing sequence's pages go. Called once per sequence that leaves after admission
// (finished, cancelled), never under the scheduler's lock.
class ReleaseFence {
 public:
  virtual ~ReleaseFence() = default;
  // Takes ownership of `table`; must free it in the pool now or later (PD mode: once the prefill
  // worker confirms no write is in flight or the transfer lease ends). An error is returned to the
  // caller of the scheduler method that released the sequence.
  virtual absl::Status Release(PageTable table) = 0;
};

// Prompt tokens [start, start + length) of a sequence; `completes_prompt` when the chunk reaches
// the end of the prompt, so the step samples the sequence's first token.
struct PrefillChunk {
  RequestId id = 0;
  int64_t start = 0;
  int64_t length = 0;
  bool completes_prompt = false;
};

// One decode token: the input is the token at `position` (prompt + generated - 1), the output
// the next token.
struct DecodeSlot {
  RequestId id = 0;
  int64_t position = 0;
};

struct StepPlan {
  uint64_t step = 0;                  // 1, 2, ... per BuildStep
  std::vector<DecodeSlot> decode;     // every decoding sequence, in admission order
  std::vector<PrefillChunk> prefill;  // in admission order
  std::vector<RequestId> expired;     // dropped from the queue (max_queue_time); never admitted
  int64_t tokens() const;             // decode.size() + sum of chunk lengths
  bool empty() const { return decode.empty() && prefill.empty(); }
};

// What the engine reports after running a plan: sequences whose sampled token was EOS or a stop
// id. Sequences reaching max_tokens finish without being listed.
struct StepOutcome {
  std::vector<RequestId> stopped;
};

class StepRunner {
 public:
  virtual ~StepRunner() = default;
  virtual absl::StatusOr<StepOutcome> Run(const StepPlan& plan) = 0;
};

enum class SequencePhase { kWaiting, kPrefill, kDecode };

// A snapshot of one sequence, for metrics and tests.
struct SequenceStatus {
  SequencePhase phase = SequencePhase::kWaiting;
  int64_t prefilled = 0;  // prompt tokens whose state is computed
  int64_t generated = 0;  // tokens sampled so far
};

class Scheduler {
 public:
  // `pool` and `clock` must outlive the scheduler; `fence` may be null (free at once in `pool`).
  // Errors: InvalidArgument for max_running < 1, token_budget <= max_running, a negative
  // max_queue_time, null pool / clock or an empty demand function.
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(SchedulerOptions options, PagePool* pool,
                                                           PageDemandFn demand, const Clock* clock,
                                                           ReleaseFence* fence);

  // Adds a sequence: admitted at once when nobody waits and its pages fit, else queued (kWait) or
  // refused (kReject). Errors: InvalidArgument for non-positive sizes, or a demand larger than the
  // whole pool (it could never run); AlreadyExists for a known id; Unavailable when refused.
  absl::Status Submit(const SequenceSpec& spec);

  // Drops a sequence. Its pages go to the fence at once, unless it is part of the step in flight:
  // then they go when that step completes (the engine may still be writing them). Errors: NotFound
  // for an unknown id; a fence error.
  absl::Status Cancel(RequestId id);

  // Expires, admits (FIFO, while pages and max_running allow) and plans one step.
  // Errors: FailedPrecondition while a step is in flight.
  absl::StatusOr<StepPlan> BuildStep();
  // Records the in-flight step's progress and releases the sequences it finished, returned in plan
  // order. Errors: FailedPrecondition when no step is in flight; InvalidArgument (nothing recorded,
  // the step stays in flight) when `outcome` names a sequence that sampled no token in the plan;
  // a fence error (progress is recorded).
  absl::StatusOr<std::vector<RequestId>> CompleteStep(const StepOutcome& outcome);
  // Forgets the in-flight step without recording progress (the engine failed it).
  // Errors: FailedPrecondition when no step is in flight; a fence error.
  absl::Status AbortStep();

  struct StepResult {
    StepPlan plan;
    std::vector<RequestId> finished;
  };
  // BuildStep, runner.Run, CompleteStep; on a runner error AbortStep and return the error.
  absl::StatusOr<StepResult> Step(StepRunner& runner);

  std::optional<SequenceStatus> Find(RequestId id) const;
  // Metrics.
  int64_t num_waiting() const;
  int64_t num_running() const;  // prefilling + decoding
  int64_t num_decoding() const;
  uint64_t steps_built() const;

 private:
  struct Sequence {
    SequenceSpec spec;
    PageDemand demand;
    absl::Time arrival;
    SequencePhase phase = SequencePhase::kWaiting;
    int64_t prefilled = 0;
    int64_t generated = 0;
    PageTable table;
    bool cancelled = false;  // dropped while in the in-flight step
  };

  Scheduler(SchedulerOptions options, PagePool* pool, PageDemandFn demand, const Clock* clock,
            ReleaseFence* fence);
  // Allocates the sequence's pages and moves it to the running set.
  absl::Status AdmitLocked(Sequence& sequence) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  bool FitsLocked(const Sequence& sequence) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Removes a running sequence and returns its pages for release.
  PageTable RemoveRunningLocked(RequestId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Records one sequence's progress in the completed step; true when it finished. False for a
  // sequence cancelled during the step (EndStepLocked already took it).
  bool AdvanceLocked(RequestId id, int64_t prefilled, int64_t generated, bool stopped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Clears the in-flight ids and returns the tables of sequences cancelled during the step.
  std::vector<PageTable> EndStepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  absl::Status ReleaseAll(std::vector<PageTable> tables);

  const SchedulerOptions options_;
  PagePool* const pool_;
  const PageDemandFn demand_;
  const Clock* const clock_;
  ReleaseFence* const fence_;

  mutable absl::Mutex mutex_;
  absl::flat_hash_map<RequestId, Sequence> sequences_ ABSL_GUARDED_BY(mutex_);
  std::deque<RequestId> waiting_ ABSL_GUARDED_BY(mutex_);
  std::vector<RequestId> running_ ABSL_GUARDED_BY(mutex_);  // admission order
  std::optional<StepPlan> in_flight_ ABSL_GUARDED_BY(mutex_);
  absl::flat_hash_set<RequestId> in_flight_ids_ ABSL_GUARDED_BY(mutex_);
  uint64_t steps_built_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace pdserve::serving
