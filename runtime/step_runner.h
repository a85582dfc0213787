// serving::StepRunner on the CPU engine: executes a Scheduler StepPlan (chunked prefill chunks and
// one decode token per running sequence), keeping every sequence's state in its state-pool pages
// (runtime/paged_state.h), sampling with serving::RequestSampler and watching each choice with
// guards::DegenerationDetector.
//
// Batch invariance. A sequence's tokens and logprobs never depend on which other sequences share
// its steps: each sequence runs its own Model::Forward calls, and their shapes are a function of
// the sequence alone. Decode is one token per call; prefill is cut at absolute multiples of
// `prefill_block` (the scheduler's chunk boundaries, which depend on the token budget and on the
// other sequences, only decide when the tokens before a boundary are computed, never how they are
// grouped). Sampling is keyed by (seed, choice, position) (serving/sampler.h). So a request gives
// bit-identical results alone, in any batch, and with any pool size.
//
// Thread-safety: Add / Remove may be called from any thread; Run from one step loop at a time.
// Sequences of one step run on up to `threads` threads; events of one request are delivered
// serially (one request mutex), events of different requests may be concurrent.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/model.h"
#include "runtime/paged_state.h"
#include "runtime/step_types.h"
#include "serving/page_pool.h"
#include "serving/scheduler.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

class EngineStepRunner : public SequenceRunner {
 public:
  // `model`, `layout` (LayoutForModel(model.config())) and `pool` must outlive the runner.
  EngineStepRunner(const engine::Model& model, const serving::StateLayout& layout,
                   serving::PagePool* pool, RunnerOptions options);
  ~EngineStepRunner() override;

  // Registers sequence `id` before it is submitted to the scheduler. AlreadyExists for a known id,
  // InvalidArgument for an empty prompt or a bad choice.
  absl::Status Add(serving::RequestId id, SequenceSetup setup) override;
  // Forgets `id` (finished, cancelled or expired). A step in flight may still finish it.
  void Remove(serving::RequestId id) override;
  int64_t num_sequences() const override;
  GuardCounts guard_counts() const override;

  // Runs `plan`. A sequence whose Forward or sampling fails gets on_error and is listed stopped;
  // ids no longer registered (cancelled after the plan was built) are skipped. Never fails.
  absl::StatusOr<serving::StepOutcome> Run(const serving::StepPlan& plan) override;

 private:
  struct Sequence;
  using Work = StepWork<Sequence>;
  // Runs one sequence's work; true when the sequence stopped (EOS / stop id / degenerate / error).
  bool RunOne(const Work& work);
  absl::StatusOr<bool> RunOneOrError(const Work& work);

  const engine::Model& model_;
  const serving::StateLayout& layout_;
  serving::PagePool* const pool_;
  // Canary of `seq` over the logits `last` that its newest token (already in seq.generated) was
  // sampled from; OK or the mismatch.
  absl::Status RunCanary(const Sequence& seq, std::span<const float> last);
  // Paranoid check of `seq`'s pinned table; counts and logs a failure.
  absl::Status VerifyPages(const Sequence& seq, const char* where);

  const RunnerOptions options_;
  std::atomic<int64_t> canary_checks_{0};
  std::atomic<int64_t> canary_mismatches_{0};
  std::atomic<int64_t> isolation_errors_{0};
  mutable absl::Mutex mutex_;
  absl::flat_hash_map<serving::RequestId, std::shared_ptr<Sequence>> sequences_
      ABSL_GUARDED_BY(mutex_);
};

}  // namespace pdserve::runtime
