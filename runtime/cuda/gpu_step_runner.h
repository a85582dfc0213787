// serving::StepRunner on the CUDA engine (engine/gpu/gpu_model.h): the contract of
// runtime::EngineStepRunner (same SequenceSetup / TokenEvent / RequestContext, same sampling
// through runtime/choice_step.h, so the same RequestSampler keys (seed, choice, position) and
// the same degeneration detector), but a sequence's state lives in a GpuModel state slot for the
// whole of its life instead of in state-pool pages.
//
// Slots. A sequence takes a free slot at the first step that schedules it and gives it back on
// Remove; Add reserves nothing, so any number of sequences may be registered while they wait.
// The scheduler must admit at most slots() sequences at once (SchedulerOptions::max_running <=
// slots(); colocated::ColocatedService sets max_batch = slots): then a scheduled sequence always
// finds a slot, and a full GPU makes new sequences wait in the scheduler's queue. A sequence that
// finds none anyway (a scheduler allowed more) fails with ResourceExhausted through on_error.
//
// Several GPUs (an expert-parallel engine::gpu::GpuModelGroup): a new sequence goes to the rank
// with the most free slots (engine::PickRank), so the scheduler's batch spreads evenly, and stays
// there; slots() counts every rank's. Each step runs in lock step on the group's rank threads:
// prefill chunks in rounds (round i runs every rank's i-th Forward, all padded to the round's
// longest chunk; a rank without one runs GpuModel::Idle), then one DecodeStep per rank padded to
// the bucket of the largest rank's batch (empty on a rank with nothing to decode). Sampling stays
// on the calling thread. A failed call breaks the group (GpuModelGroup::Run): every later step
// fails its sequences with that error.
// Callers should Remove a cancelled sequence before Scheduler::Cancel, so its slot is free before
// the scheduler can admit another sequence in its place.
//
// A step. Prefill chunks run as Forward calls of one sequence each, cut at absolute multiples of
// prefill_block (<= the model's max_chunk), as the CPU runner cuts them; then every decoding
// sequence of the step runs in ONE GpuModel::DecodeStep(use_graph = true) per rank, padded to its
// bucket.
//
// Batch invariance (what holds on the GPU, unlike the CPU runner's promise): prefill logits depend
// on the sequence alone (its own Forward calls, shapes fixed by prefill_block). Decode logits come
// from GEMMs over the whole padded bucket: cuBLAS may pick another algorithm, split or reduction
// order for another row count, so a sequence's decode logits can change in the last bits when the
// number of decoding sequences crosses a bucket boundary; rows of the same bucket do not interact
// (each row's arithmetic is its own). Tokens therefore equal the alone-run's unless the two
// draws fall on opposite sides of a near-tie. tests/engine_gpu/gpu_step_runner_test.cc measures
// it (GpuModel decode rows alone vs in a batch of 5 and 9) and prints the difference.
//
// PD decode worker: a SequenceSetup with first_token has the prompt's state in the sequence's
// pages (runtime::PagedState layout); at its first step the runner imports them into its slot
// straight from the pages (GpuModel::ImportLayers with PagedState::LoadLayerRing: no CPU-layout
// state in between, two pinned layer buffers per rank, each layer's copy overlapping the next
// one's fill), then decodes from position prompt.size().
//
// Early import (RunnerOptions::early_import, one GPU only): early_importer() is a
// runtime::EarlyImporter over a runtime::GpuSlotImporter of this runner's model. A decode worker
// begins a request's import at Reserve (a slot is taken from the free slots then, with its
// device pages for the prompt), each layer is imported as its pages arrive (on the importer's
// thread: the fill with no lock, the copies enqueued on the model's import stream under the
// model lock, which Run holds for its step), and a sequence Added with first_token after
// EarlyImporter::Take starts in that slot: its first step only finishes the staged import
// (GpuModel::FinishStagedImport). A Removed sequence whose import was never finished, and an
// Add that fails, give the slot back (cancelled at the next step).
//
// Sampling. Decode rows are sampled on the GPU by default (runtime/cuda/gpu_sampler.h): the step
// leaves its logits on the device (GpuModel::DecodeStepOnDevice), the sampler runs after the
// decode graph on the same stream (outside the graph, which still holds only the forward
// pass), and only token ids and the requested logprobs come back, with one synchronization per
// rank and step. Each row's inputs come from RequestSampler::PrepareDraw before the step and its
// token is recorded with CommitDraw after (runtime/choice_step.h's CommitAndDeliver), so the
// tokens are serving::SampleToken's on the same logits (kernels/cuda/sampling.cuh says where
// bit-identity is not guaranteed). RunnerOptions::gpu_sampling = false or PDSERVE_HOST_SAMPLER=1
// samples on the host instead (logits copied back), for A/B. Prefill's sampled token (one per
// sequence) is always drawn on the host from the Forward's host logits.
//
// State pages. A sequence's compressed entries and indexer keys grow in its rank's page pools
// (GpuModelOptions::state_tokens). Admission is the caller's (colocated::ServiceOptions::
// device_state_tokens reserves prompt + max_tokens at admission, so a step always fits on one
// GPU; the canary's slot gets its own pages, runtime/cuda/gpu_backend.h); before a step is
// launched the runner still asks GpuModel::CanHold for each rank's sequences at their end
// positions and, where the pools cannot hold them (a caller that did not reserve, or a group
// whose rank ran short), stops the newest sequences of that rank with ResourceExhausted (freeing
// their pages at once) until the rest fit: failed loudly, never preempted, nothing half-run.
//
// Guards. The degeneration detector runs as on the CPU (runtime/choice_step.h). The logits
// canary (guards/canary.h, SequenceSetup::canary) recomputes on the GPU: with
// RunnerOptions::canary the runner keeps one slot per rank out of service, and when a canary
// choice ends it resets that slot and runs the whole sequence (prompt and every generated token
// but the last) through one-shot Forward calls on the sequence's rank (chunks cut at multiples
// of prefill_block, at most max_chunk tokens), then compares the last row's logits with the ones
// the last token was sampled from (guards::CompareLogits; tolerance RunnerOptions::
// canary_tolerance, default guards::kGpuCanaryTolerance). Forward runs the any-shape attention
// and indexer kernels, so a recompute checks the fixed-shape decode kernels against another code
// path as well as the state itself. Decode rows of canary choices that were sampled on the device
// have their fp32 logits copied to the host at every step (one row, vocab x 4 bytes), since
// whether a token ends the choice is known only after it is drawn. Every check is logged (info
// "canary pass: ...", error "canary mismatch: ..."), counted in guard_counts(); a mismatch fails
// the choice before its last token is delivered. Cost per checked choice: one prefill of the
// whole sequence on the step thread, plus its host logits (Forward returns every row's).
// The recompute slot gives its state pages back when the check is done. Paranoid mode
// (options.paranoid) checks, before each step is launched, every state page each sequence of
// the step reads against the GPU model's allocator (GpuModel::VerifySlotPages: owner + epoch);
// a failure stops only that sequence with an isolation error and counts in
// guard_counts().isolation_errors. A removed sequence's slot gives its state pages back at the
// next step.
//
// Thread-safety: Add / Remove / num_sequences / free_slots from any thread; Run from one step loop
// at a time (it alone drives the models, which are not thread-safe). A one-GPU step runs on the
// calling thread; a group's forward passes run on its rank threads, each touching only its own
// rank's sequences, and every event is delivered from the calling thread under its request's
// mutex.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/task_pool.h"
#include "engine/gpu/gpu_model.h"
#include "engine/gpu/gpu_model_group.h"
#include "engine/gpu/state_staging.h"
#include "runtime/cuda/gpu_sampler.h"
#include "runtime/cuda/gpu_slot_importer.h"
#include "runtime/early_import.h"
#include "runtime/step_types.h"
#include "serving/page_pool.h"
#include "serving/scheduler.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

class GpuStepRunner : public SequenceRunner {
 public:
  // `gpu`, `layout` (LayoutForModel(gpu->config())) and `pool` must outlive the runner; the runner
  // alone drives `gpu` and uses all of its slots. InvalidArgument for prefill_block outside [1,
  // gpu->max_chunk()], or options.canary with fewer than 2 slots on a rank.
  static absl::StatusOr<std::unique_ptr<GpuStepRunner>> Create(engine::gpu::GpuModel* gpu,
                                                               const serving::StateLayout& layout,
                                                               serving::PagePool* pool,
                                                               RunnerOptions options);
  // Over every rank of `group` (owned; what pdserve serve --backend cuda and a cuda decode worker
  // build, runtime/cuda/gpu_backend.h). Errors as above.
  static absl::StatusOr<std::unique_ptr<GpuStepRunner>> Create(
      std::unique_ptr<engine::gpu::GpuModelGroup> group, const serving::StateLayout& layout,
      serving::PagePool* pool, RunnerOptions options);
  ~GpuStepRunner() override;

  // As EngineStepRunner::Add; also InvalidArgument when prompt + max_tokens exceeds the model's
  // max_context, and FailedPrecondition for a canary choice without RunnerOptions::canary.
  absl::Status Add(serving::RequestId id, SequenceSetup setup) override;
  // Forgets `id` and frees its slot.
  void Remove(serving::RequestId id) override;
  int64_t num_sequences() const override;
  int64_t free_slots() const;  // over every rank, the canary's slots not counted
  GuardCounts guard_counts() const override;
  EarlyImporter* early_importer() override { return early_importer_.get(); }

  // Runs `plan` (see the header comment). A sequence whose engine call or sampling fails gets
  // on_error and is listed stopped; a failed DecodeStep fails every sequence of the batch. Never
  // fails as a whole.
  absl::StatusOr<serving::StepOutcome> Run(const serving::StepPlan& plan) override;

 private:
  struct Sequence;
  using Work = StepWork<Sequence>;
  GpuStepRunner(std::unique_ptr<engine::gpu::GpuModelGroup> group,
                const serving::StateLayout& layout, serving::PagePool* pool, RunnerOptions options);
  engine::gpu::GpuModel& Model(const Sequence& seq);
  // Add's work (Add also gives back the early import's slot of a sequence it refuses).
  absl::Status AddSequence(serving::RequestId id, SequenceSetup setup);
  // Run's work, with the model lock held.
  absl::StatusOr<serving::StepOutcome> RunLocked(const serving::StepPlan& plan);
  // Gives `seq` a slot (fresh, or holding its transferred prompt state).
  absl::Status Place(Sequence& seq);
  // RunnerOptions::early_import on one GPU: the slot importer and the early importer over it.
  absl::Status StartEarlyImport();
  // Cancels the early imports Remove or a failed Add left (their slots back); Run, model lock
  // held.
  void CancelEarlyImports();
  // The prefill works of one step, in lock-step rounds over the ranks; sets stopped[i] for
  // works[i].
  void RunPrefill(const std::vector<Work>& works, std::vector<char>* stopped);
  // The decode works of one step through one DecodeStep per rank; sets stopped[i] for works[i].
  void RunDecode(const std::vector<Work>& works, std::vector<char>* stopped);
  // The decode batch of each rank: works' rows (indices into works), slots and input tokens.
  struct DecodeBatch {
    std::vector<std::vector<size_t>> rows;
    std::vector<std::vector<int64_t>> slots;
    std::vector<std::vector<int32_t>> tokens;
    std::vector<int64_t> sizes;
  };
  // Delivers rank r's decode logits [rows, vocab] (host) through the host sampler.
  void SampleOnHost(const std::vector<Work>& works, const std::vector<size_t>& rows,
                    const engine::Tensor& logits, std::vector<char>* stopped);
  // The decode works through DecodeStepOnDevice and the GPU sampler; `draws` are the rows'
  // PrepareDraw inputs, per rank in batch order.
  void DecodeOnDevice(const std::vector<Work>& works, const DecodeBatch& batch, int64_t rows,
                      const std::vector<std::vector<GpuSampleRow>>& draws,
                      std::vector<char>* stopped);
  // ResetSlot of the slots Remove freed since the last step (their pages back to the pool).
  void ReleaseRemovedSlots();
  // Paranoid mode: the sequences of the step whose pages fail VerifySlotPages (each failed).
  std::vector<std::shared_ptr<Sequence>> VerifyPages(const std::vector<Work>& decode,
                                                     const std::vector<Work>& prefill);
  // The sequences of the step whose rank's page pools cannot hold it (GpuModel::CanHold over
  // every work of the rank at its end position), newest first until the rest fit; each failed
  // with ResourceExhausted and its slot's pages freed at once.
  std::vector<std::shared_ptr<Sequence>> ShortOfPages(const std::vector<Work>& decode,
                                                      const std::vector<Work>& prefill);
  // on_error for `seq`'s choice; returns true (the sequence stops).
  static bool Fail(const Sequence& seq, const absl::Status& status);
  // The canary of `seq` over `last`, the logits its newest token (already recorded) was sampled
  // from: the GPU recompute of the header comment. A mismatch is an Internal error
  // (guards::CanaryMismatchError); a failed recompute its own error.
  absl::Status RunCanary(const Sequence& seq, std::span<const float> last);
  // The fp32 logits of the sequence's whole token list but the newest token, last row only, from
  // one-shot Forward calls into the rank's canary slot.
  absl::StatusOr<std::vector<float>> Recompute(const Sequence& seq);
  // before_final for SampleAndDeliver / CommitAndDeliver: the canary over `last` for a canary
  // choice, else empty. `last` must stay valid until the delivery returns.
  std::function<absl::Status()> CanaryHook(const Sequence& seq, std::span<const float> last);

  const std::unique_ptr<engine::gpu::GpuModelGroup> group_;
  const serving::StateLayout& layout_;
  serving::PagePool* const pool_;
  const RunnerOptions options_;
  mutable absl::Mutex mutex_;
  absl::flat_hash_map<serving::RequestId, std::shared_ptr<Sequence>> sequences_
      ABSL_GUARDED_BY(mutex_);
  std::vector<std::vector<int64_t>> free_slots_ ABSL_GUARDED_BY(mutex_);  // per rank
  // (rank, slot) of removed sequences whose pages the next step gives back.
  std::vector<std::pair<int64_t, int64_t>> to_release_ ABSL_GUARDED_BY(mutex_);
  std::atomic<int64_t> isolation_errors_{0};
  // Per rank, made at the first PD placement: the pinned buffers a transferred prompt state is
  // imported through (two layers). Used by Run only (one step at a time).
  std::vector<std::unique_ptr<engine::gpu::StateStaging>> import_staging_;
  // The host threads an import's page reads are spread over (PagedState::LoadLayerRing;
  // DefaultTransferHostThreads of the host), made at the first PD placement; its Run serializes
  // ranks that place at once.
  std::once_flag import_pool_once_;
  std::unique_ptr<TaskPool> import_pool_;
  // Decode sampling on the device (options.gpu_sampling and no PDSERVE_HOST_SAMPLER=1).
  const bool gpu_sampling_;
  // Per rank, made on the rank's thread at its first decode step. Used by Run only.
  std::vector<std::unique_ptr<GpuSampler>> samplers_;
  // Per rank with options.canary: the slot the canary recomputes in (never given to a sequence).
  std::vector<int64_t> canary_slots_;
  std::atomic<int64_t> canary_checks_{0};
  std::atomic<int64_t> canary_mismatches_{0};
  // The early import (RunnerOptions::early_import): Run holds model_lock_ around its step; the
  // importers (declared last: destroyed first, while the slots and the model are still here)
  // take it for their model calls. Sequences whose early import Run must cancel.
  ModelLock model_lock_;
  std::vector<serving::RequestId> early_cancels_ ABSL_GUARDED_BY(mutex_);
  std::unique_ptr<TaskPool> early_pool_;
  std::unique_ptr<GpuSlotImporter> slot_importer_;
  std::unique_ptr<EarlyImporter> early_importer_;
};

}  // namespace pdserve::runtime
