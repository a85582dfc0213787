#include "colocated/gpu/gpu_step_runner.h"

#include <algorithm>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "colocated/choice_step.h"
#include "colocated/paged_state.h"
#include "common/status.h"

namespace pdserve::colocated {

struct GpuStepRunner::Sequence {
  Sequence(serving::RequestId sequence_id, SequenceSetup sequence_setup,
           guards::DegenerationThresholds thresholds)
      : id(sequence_id), setup(std::move(sequence_setup)), progress(thresholds) {}
  const serving::RequestId id;
  const SequenceSetup setup;
  int64_t slot = -1;  // set once under the runner's mutex, by the step loop
  // Touched only by the step loop.
  int64_t computed = 0;  // tokens whose state is in the slot (or, before placement, the pages)
  ChoiceProgress progress;

  int32_t TokenAt(int64_t position) const {
    const auto prompt_length = static_cast<int64_t>(setup.prompt.size());
    return position < prompt_length
               ? setup.prompt[static_cast<size_t>(position)]
               : progress.generated[static_cast<size_t>(position - prompt_length)];
  }
  int64_t known_tokens() const {
    return static_cast<int64_t>(setup.prompt.size() + progress.generated.size());
  }
};

GpuStepRunner::GpuStepRunner(engine::gpu::GpuModel* gpu, const serving::StateLayout& layout,
                             serving::PagePool* pool, RunnerOptions options)
    : gpu_(gpu), layout_(layout), pool_(pool), options_(std::move(options)) {
  for (int64_t s = gpu_->slots() - 1; s >= 0; --s) free_slots_.push_back(s);
}

GpuStepRunner::~GpuStepRunner() = default;

absl::StatusOr<std::unique_ptr<GpuStepRunner>> GpuStepRunner::Create(
    engine::gpu::GpuModel* gpu, const serving::StateLayout& layout, serving::PagePool* pool,
    RunnerOptions options) {
  if (options.prefill_block < 1 || options.prefill_block > gpu->max_chunk()) {
    return absl::InvalidArgumentError(absl::StrCat("GPU runner: prefill_block ",
                                                   options.prefill_block, " outside [1, max_chunk ",
                                                   gpu->max_chunk(), "]"));
  }
  if (options.paranoid) {
    return absl::FailedPreconditionError(
        "GPU runner: paranoid page checks need the state in pool pages; the CUDA backend keeps "
        "it in device slots (use the CPU backend for guards.paranoid)");
  }
  return std::unique_ptr<GpuStepRunner>(new GpuStepRunner(gpu, layout, pool, std::move(options)));
}

absl::StatusOr<std::unique_ptr<GpuStepRunner>> GpuStepRunner::Create(
    std::unique_ptr<engine::gpu::GpuModel> gpu, const serving::StateLayout& layout,
    serving::PagePool* pool, RunnerOptions options) {
  PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<GpuStepRunner> runner,
                           Create(gpu.get(), layout, pool, std::move(options)));
  runner->owned_gpu_ = std::move(gpu);
  return runner;
}

absl::Status GpuStepRunner::Add(serving::RequestId id, SequenceSetup setup) {
  PDSERVE_RETURN_IF_ERROR(CheckSequenceSetup(id, setup));
  if (setup.canary) {
    return absl::FailedPreconditionError(
        "GPU runner: the logits canary recomputes on the CPU engine and is not available on the "
        "CUDA backend");
  }
  const int64_t total = static_cast<int64_t>(setup.prompt.size()) + setup.max_tokens;
  if (total > gpu_->max_context()) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", id, " needs ", total,
                                                   " tokens of context, the GPU holds ",
                                                   gpu_->max_context()));
  }
  const std::optional<int32_t> first_token = setup.first_token;
  auto sequence = std::make_shared<Sequence>(id, std::move(setup), options_.thresholds);
  if (first_token) {
    sequence->computed = static_cast<int64_t>(sequence->setup.prompt.size());
    sequence->progress.Record(*first_token);
  }
  absl::MutexLock lock(&mutex_);
  if (!sequences_.emplace(id, std::move(sequence)).second) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already registered"));
  }
  return absl::OkStatus();
}

void GpuStepRunner::Remove(serving::RequestId id) {
  absl::MutexLock lock(&mutex_);
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  if (it->second->slot >= 0) free_slots_.push_back(it->second->slot);
  sequences_.erase(it);
}

int64_t GpuStepRunner::num_sequences() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(sequences_.size());
}

int64_t GpuStepRunner::free_slots() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(free_slots_.size());
}

bool GpuStepRunner::Fail(const Sequence& seq, const absl::Status& status) {
  RequestContext& request = *seq.setup.request;
  absl::MutexLock lock(&request.mu);
  if (request.on_error) request.on_error(seq.setup.choice, status);
  return true;
}

absl::Status GpuStepRunner::Place(Sequence& seq) {
  if (!seq.setup.first_token) return gpu_->ResetSlot(seq.slot);
  // PD decode: the prompt's state arrived in the sequence's pages.
  PDSERVE_ASSIGN_OR_RETURN(serving::PageTable table, pool_->Table(seq.id));
  PDSERVE_ASSIGN_OR_RETURN(SequencePages pages, MapPages(*pool_, table));
  const int64_t total = static_cast<int64_t>(seq.setup.prompt.size()) + seq.setup.max_tokens;
  const PagedState paged(gpu_->config(), layout_, total);
  engine::ModelState state = gpu_->NewState();
  PDSERVE_RETURN_IF_ERROR(paged.Load(seq.computed, pages, &state));
  return gpu_->ImportState(seq.slot, state);
}

absl::StatusOr<serving::StepOutcome> GpuStepRunner::Run(const serving::StepPlan& plan) {
  std::vector<Work> decode;
  std::vector<Work> prefill;
  std::vector<std::shared_ptr<Sequence>> to_place;
  std::vector<std::shared_ptr<Sequence>> no_slot;
  {
    // A sequence cancelled after the plan was built is skipped: the scheduler releases it when
    // the step completes.
    absl::MutexLock lock(&mutex_);
    auto add = [&](std::vector<Work>* into, serving::RequestId id, int64_t start, int64_t length,
                   bool samples) {
      auto it = sequences_.find(id);
      if (it == sequences_.end()) return;
      Sequence& seq = *it->second;
      if (seq.slot < 0) {
        if (free_slots_.empty()) {
          no_slot.push_back(it->second);
          return;
        }
        seq.slot = free_slots_.back();
        free_slots_.pop_back();
        to_place.push_back(it->second);
      }
      into->push_back({it->second, start, length, samples});
    };
    for (const serving::DecodeSlot& slot : plan.decode) {
      add(&decode, slot.id, slot.position, 1, true);
    }
    for (const serving::PrefillChunk& chunk : plan.prefill) {
      add(&prefill, chunk.id, chunk.start, chunk.length, chunk.completes_prompt);
    }
  }
  serving::StepOutcome outcome;
  for (const auto& seq : no_slot) {
    Fail(*seq, absl::ResourceExhaustedError(
                   absl::StrCat("sequence ", seq->id,
                                ": every GPU state slot is taken (the scheduler admitted "
                                "more sequences than the runner's ",
                                gpu_->slots(), " slots)")));
    outcome.stopped.push_back(seq->id);
  }
  std::vector<std::shared_ptr<Sequence>> failed;
  for (const auto& seq : to_place) {
    absl::Status placed = Place(*seq);
    if (placed.ok()) continue;
    Fail(*seq, placed);
    failed.push_back(seq);
  }
  auto is_failed = [&](const Work& w) {
    return std::find(failed.begin(), failed.end(), w.sequence) != failed.end();
  };
  for (const auto& seq : failed) outcome.stopped.push_back(seq->id);
  decode.erase(std::remove_if(decode.begin(), decode.end(), is_failed), decode.end());
  prefill.erase(std::remove_if(prefill.begin(), prefill.end(), is_failed), prefill.end());

  for (const Work& work : prefill) {
    absl::StatusOr<bool> stopped = RunPrefill(work);
    if (!stopped.ok()) Fail(*work.sequence, stopped.status());
    if (!stopped.ok() || *stopped) outcome.stopped.push_back(work.sequence->id);
  }
  std::vector<char> stopped(decode.size(), 0);
  RunDecode(decode, &stopped);
  for (size_t i = 0; i < decode.size(); ++i) {
    if (stopped[i]) outcome.stopped.push_back(decode[i].sequence->id);
  }
  return outcome;
}

absl::StatusOr<bool> GpuStepRunner::RunPrefill(const Work& work) {
  Sequence& seq = *work.sequence;
  const int64_t end = work.start + work.length;
  const int64_t block = options_.prefill_block;
  // Prefill computes up to the last block boundary the chunk reaches, or the whole prompt.
  const int64_t target = work.samples ? end : end / block * block;
  if (target <= seq.computed && !work.samples) return false;
  if (end > seq.known_tokens() || gpu_->Position(seq.slot) != seq.computed) {
    return absl::InternalError(absl::StrCat("sequence ", seq.id, " scheduled up to position ", end,
                                            " with ", seq.known_tokens(), " tokens known and ",
                                            gpu_->Position(seq.slot), " in its slot"));
  }
  engine::Tensor logits;
  while (seq.computed < target) {
    const int64_t from = seq.computed;
    const int64_t to = std::min(target, (from / block + 1) * block);
    std::vector<int32_t> tokens;
    for (int64_t pos = from; pos < to; ++pos) tokens.push_back(seq.TokenAt(pos));
    PDSERVE_ASSIGN_OR_RETURN(logits, gpu_->Forward(seq.slot, tokens));
    seq.computed = to;
  }
  if (!work.samples) return false;
  if (logits.data.empty()) {
    return absl::InternalError(absl::StrCat(
        "sequence ", seq.id, " was asked to sample at position ", end, " with no new input"));
  }
  const int64_t vocab = logits.dim(1);
  std::span<const float> last(logits.ptr() + (logits.dim(0) - 1) * vocab,
                              static_cast<size_t>(vocab));
  return SampleAndDeliver(seq.setup, last, options_.degeneration, &seq.progress, nullptr);
}

void GpuStepRunner::RunDecode(const std::vector<Work>& works, std::vector<char>* stopped) {
  std::vector<int64_t> slots;
  std::vector<int32_t> tokens;
  std::vector<size_t> batch;  // index into works of each batch row
  for (size_t i = 0; i < works.size(); ++i) {
    Sequence& seq = *works[i].sequence;
    // A decode input is the newest token, at position computed (the slot's position).
    if (works[i].start != seq.computed || works[i].start >= seq.known_tokens() ||
        gpu_->Position(seq.slot) != seq.computed) {
      (*stopped)[i] =
          Fail(seq, absl::InternalError(absl::StrCat(
                        "sequence ", seq.id, " decode at position ", works[i].start, " but ",
                        seq.computed, " computed and ", seq.known_tokens(), " tokens known")));
      continue;
    }
    slots.push_back(seq.slot);
    tokens.push_back(seq.TokenAt(seq.computed));
    batch.push_back(i);
  }
  if (batch.empty()) return;
  absl::StatusOr<engine::Tensor> logits = gpu_->DecodeStep(slots, tokens, /*use_graph=*/true);
  if (!logits.ok()) {
    for (size_t i : batch) (*stopped)[i] = Fail(*works[i].sequence, logits.status());
    return;
  }
  const int64_t vocab = logits->dim(1);
  for (size_t r = 0; r < batch.size(); ++r) {
    Sequence& seq = *works[batch[r]].sequence;
    seq.computed += 1;
    std::span<const float> row(logits->ptr() + static_cast<int64_t>(r) * vocab,
                               static_cast<size_t>(vocab));
    absl::StatusOr<bool> stop =
        SampleAndDeliver(seq.setup, row, options_.degeneration, &seq.progress, nullptr);
    (*stopped)[batch[r]] = stop.ok() ? *stop : Fail(seq, stop.status());
  }
}

}  // namespace pdserve::colocated
