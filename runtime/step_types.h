// The sequence and step types every runtime step runner shares: what a caller registers
// (SequenceSetup, with its request's RequestContext), what a runner delivers (TokenEvent), how it
// is configured (RunnerOptions, RunnerContext) and the interface the colocated service and the
// decode worker drive (SequenceRunner). EngineStepRunner (runtime/step_runner.h, CPU engine) and
// GpuStepRunner (runtime/cuda/gpu_step_runner.h, CUDA) implement it; runtime/choice_step.h samples
// for both.
//
// Thread-safety: RequestContext serializes a request's sampler and callbacks with its mutex; a
// SequenceRunner's Add / Remove may be called from any thread, Run from one step loop at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "engine/config.h"
#include "guards/degeneration_detector.h"
#include "runtime/early_import.h"
#include "serving/page_pool.h"
#include "serving/sampler.h"
#include "serving/scheduler.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

// What a choice does when its output becomes degenerate (guards/degeneration_detector.h).
enum class DegenerationAction {
  kFlag,  // keep generating; the event carries degenerate = true
  kStop,  // end the choice with finish_reason "degenerate"
};

// One sampled token of one choice.
struct TokenEvent {
  int32_t choice = 0;
  serving::SampledToken sampled;
  // "stop" (EOS / stop id), "length" (max_tokens) or "degenerate"; empty while the choice goes on.
  std::string finish_reason;
  bool degenerate = false;  // the detector flagged this choice (at this token or before)
  // With degenerate: what it found, docs/metrics.md's `kind` ("repeat": an n-gram repeated; the
  // runner feeds the detector token ids only, so its content checks do not run here).
  std::string degeneration_kind;
};

// The sampler shared by a request's choices, with the mutex that serializes its use.
struct RequestContext {
  explicit RequestContext(serving::RequestSampler s) : sampler(std::move(s)) {}
  absl::Mutex mu;
  serving::RequestSampler sampler ABSL_GUARDED_BY(mu);
  // Receives every token, under `mu`. Returning true ends the choice now with finish "stop" (a
  // stop string matched); the runner reports it to the scheduler as stopped.
  std::function<bool(const TokenEvent&)> on_token;
  // Receives an engine or sampling failure of one choice (which is then reported stopped).
  std::function<void(int32_t choice, const absl::Status&)> on_error;
};

struct SequenceSetup {
  std::shared_ptr<RequestContext> request;
  int32_t choice = 0;
  std::vector<int32_t> prompt;  // >= 1 token
  int64_t max_tokens = 1;       // as submitted to the scheduler
  // PD decode worker: the prompt's state is already in the sequence's pages (transferred) and
  // the first token was sampled elsewhere (recorded in the request's sampler by the caller), so
  // the sequence starts decoding at position prompt.size() + 1 with this token as its input.
  std::optional<int32_t> first_token;
  // Picked by the canary (guards::CanarySampler): when the runner ends this choice (EOS, stop id,
  // max_tokens, degeneration stop) the logits it sampled the last token from are recomputed by
  // a fresh one-shot forward (guards::CheckLastTokenLogits) before that token is delivered; a
  // mismatch fails the choice through on_error instead. A choice ended by a stop string (known
  // only to on_token) is not checked.
  bool canary = false;
};

struct RunnerOptions {
  int64_t prefill_block = 64;  // >= 1: prefill Forward calls never cross a multiple of this
  // Sequences of one step run on up to this many threads; 0: hardware concurrency. Default 1:
  // on the CPU backend each Forward already spreads its GEMMs over OpenBLAS's threads, and
  // sequence threads on top oversubscribe the cores (docs/perf.md measures both).
  int threads = 1;
  DegenerationAction degeneration = DegenerationAction::kFlag;
  guards::DegenerationThresholds thresholds;
  // Paranoid mode (deploy config guards.paranoid): a sequence's page table is pinned at its first
  // step, and before every Load and after every Store each pinned page is verified to be still the
  // sequence's live allocation (guards::VerifyPinnedPages); a page that changed owner or epoch
  // fails the choice with an isolation error. Without it the runner uses the pool's current table
  // and the owner + epoch check of MapPages.
  bool paranoid = false;
  // CUDA runner only: decode rows are sampled on the device (runtime/cuda/gpu_sampler.h) and only
  // token ids and logprobs come back. false, or the environment variable
  // PDSERVE_HOST_SAMPLER=1 when the runner is created, copies every decode row's fp32 logits to
  // the host and samples there with serving::RequestSampler (the A/B fallback).
  bool gpu_sampling = true;
  // Some sequences may be canary choices (SequenceSetup::canary; the colocated service and the
  // decode worker set it when canary_every > 0). The CUDA runner then holds one state slot per
  // rank back for the canary's recompute, so it serves one sequence less per rank (its factory,
  // runtime/cuda/gpu_backend.h, allocates one slot more per rank for it).
  bool canary = false;
  // The canary's bound on max|diff| / max|ref|; 0: the backend's own (guards::kCanaryTolerance
  // on the CPU engine, guards::kGpuCanaryTolerance on CUDA). `pdserve serve --canary-tolerance`.
  double canary_tolerance = 0;
  // CUDA runner on one GPU only (deploy config transfer.early_import, true by default, sets it
  // for `pdserve decode`): a PD decode worker's transferred prompt is imported into its slot
  // layer by layer while the transfer runs (runtime/early_import.h;
  // SequenceRunner::early_importer), instead of at the sequence's first step.
  bool early_import = false;
};

// Guard counters since the runner started (monotonic).
struct GuardCounts {
  int64_t canary_checks = 0;      // choices whose last-token logits were recomputed
  int64_t canary_mismatches = 0;  // ... and differed beyond the canary's tolerance
  int64_t isolation_errors = 0;   // paranoid page checks that failed
};

// What a service drives: a StepRunner whose sequences it registers before Scheduler::Submit and
// forgets once released. EngineStepRunner (CPU engine) and GpuStepRunner (runtime/cuda, CUDA).
class SequenceRunner : public serving::StepRunner {
 public:
  // Registers sequence `id`. AlreadyExists for a known id, InvalidArgument for a bad setup; a
  // runner may refuse what it cannot serve (FailedPrecondition).
  virtual absl::Status Add(serving::RequestId id, SequenceSetup setup) = 0;
  // Forgets `id` (finished, cancelled or expired). A step in flight may still finish it.
  virtual void Remove(serving::RequestId id) = 0;
  virtual int64_t num_sequences() const = 0;
  virtual GuardCounts guard_counts() const = 0;
  // The runner's early import (RunnerOptions::early_import, where it can): a PD decode worker
  // begins it for a request at Reserve (EarlyImporter::Begin with the sequence id), feeds it the
  // layers and the verification, and, once Ready, Takes it and Adds the sequence with
  // first_token: the runner then starts it in the imported slot. Null: not supported or not
  // asked for (the runner imports the pages at the sequence's first step).
  virtual EarlyImporter* early_importer() { return nullptr; }
};

// What a RunnerFactory gets: the model and the pool its caller (the colocated service, the
// decode worker) built.
struct RunnerContext {
  std::string model_dir;
  const engine::ModelConfig* config = nullptr;
  const serving::StateLayout* layout = nullptr;
  serving::PagePool* pool = nullptr;
  RunnerOptions options;
  int64_t slots = 0;        // sequences at once (the scheduler's max_running, or max_batch)
  int64_t max_context = 0;  // tokens per sequence at most (prompt + max_tokens)
  // CUDA: GpuModelOptions::state_tokens of the paged device state (0: every slot full);
  // colocated::ServiceOptions::device_state_tokens says how admission counts it.
  int64_t state_tokens = 0;
};
// Builds a runner on another engine than the CPU's (runtime/cuda/gpu_backend.h for CUDA).
using RunnerFactory =
    std::function<absl::StatusOr<std::unique_ptr<SequenceRunner>>(const RunnerContext&)>;

// One sequence's share of a step, as a runner takes it from a serving::StepPlan: input positions
// [start, start + length), and whether the step samples a token after them. `Sequence` is the
// runner's own per-sequence record.
template <typename Sequence>
struct StepWork {
  std::shared_ptr<Sequence> sequence;
  int64_t start = 0;     // first input position
  int64_t length = 0;    // scheduled input tokens
  bool samples = false;  // the step samples a token for this sequence
};

}  // namespace pdserve::runtime
