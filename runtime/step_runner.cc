#include "runtime/step_runner.h"

#include <algorithm>
#include <atomic>
#include <span>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "guards/canary.h"
#include "guards/page_ownership.h"
#include "runtime/choice_step.h"
#include "spdlog/spdlog.h"

namespace pdserve::runtime {

struct EngineStepRunner::Sequence {
  Sequence(serving::RequestId sequence_id, SequenceSetup sequence_setup, PagedState state,
           guards::DegenerationThresholds thresholds)
      : id(sequence_id),
        setup(std::move(sequence_setup)),
        paged(std::move(state)),
        progress(thresholds) {}
  const serving::RequestId id;
  const SequenceSetup setup;
  const PagedState paged;
  // Touched only by the thread running this sequence's work in a step; steps are ordered by the
  // scheduler's fence.
  int64_t computed = 0;                      // tokens whose state is in the pages
  std::optional<serving::PageTable> pinned;  // paranoid mode: the table of the first step
  ChoiceProgress progress;                   // sampled tokens and the detector
};

EngineStepRunner::EngineStepRunner(const engine::Model& model, const serving::StateLayout& layout,
                                   serving::PagePool* pool, RunnerOptions options)
    : model_(model), layout_(layout), pool_(pool), options_(std::move(options)) {}

EngineStepRunner::~EngineStepRunner() = default;

absl::Status EngineStepRunner::Add(serving::RequestId id, SequenceSetup setup) {
  PDSERVE_RETURN_IF_ERROR(CheckSequenceSetup(id, setup));
  const int64_t total = static_cast<int64_t>(setup.prompt.size()) + setup.max_tokens;
  const std::optional<int32_t> first_token = setup.first_token;
  auto sequence = std::make_shared<Sequence>(
      id, std::move(setup), PagedState(model_.config(), layout_, total), options_.thresholds);
  if (first_token) {
    // The same bookkeeping RunOneOrError does after sampling the token that completes the prompt.
    sequence->computed = static_cast<int64_t>(sequence->setup.prompt.size());
    sequence->progress.Record(*first_token);
  }
  absl::MutexLock lock(&mutex_);
  if (!sequences_.emplace(id, std::move(sequence)).second) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", id, " is already registered"));
  }
  return absl::OkStatus();
}

void EngineStepRunner::Remove(serving::RequestId id) {
  absl::MutexLock lock(&mutex_);
  sequences_.erase(id);
}

int64_t EngineStepRunner::num_sequences() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(sequences_.size());
}

GuardCounts EngineStepRunner::guard_counts() const {
  return {canary_checks_.load(), canary_mismatches_.load(), isolation_errors_.load()};
}

absl::Status EngineStepRunner::VerifyPages(const Sequence& seq, const char* where) {
  absl::Status ok = guards::VerifyPinnedPages(*pool_, *seq.pinned, where);
  if (!ok.ok()) {
    ++isolation_errors_;
    spdlog::error("paranoid: {}", std::string(ok.message()));
  }
  return ok;
}

absl::Status EngineStepRunner::RunCanary(const Sequence& seq, std::span<const float> last) {
  // The inputs `last` came from: the prompt and every generated token but the one just sampled.
  std::vector<int32_t> tokens = seq.setup.prompt;
  const std::vector<int32_t>& generated = seq.progress.generated;
  tokens.insert(tokens.end(), generated.begin(), generated.end() - 1);
  const double tolerance =
      options_.canary_tolerance > 0 ? options_.canary_tolerance : guards::kCanaryTolerance;
  PDSERVE_ASSIGN_OR_RETURN(guards::CanaryResult result,
                           guards::CheckLastTokenLogits(model_, tokens, last, tolerance));
  ++canary_checks_;
  if (result.pass) return absl::OkStatus();
  ++canary_mismatches_;
  absl::Status mismatch = guards::CanaryMismatchError(
      absl::StrCat("sequence ", seq.id, " at position ", tokens.size()), result, tolerance);
  spdlog::error("{}", std::string(mismatch.message()));
  return mismatch;
}

absl::StatusOr<serving::StepOutcome> EngineStepRunner::Run(const serving::StepPlan& plan) {
  std::vector<Work> works;
  {
    // A sequence cancelled after the plan was built is skipped: the scheduler releases it when
    // the step completes.
    absl::MutexLock lock(&mutex_);
    auto add = [&](serving::RequestId id, int64_t start, int64_t length, bool samples) {
      auto it = sequences_.find(id);
      if (it != sequences_.end()) works.push_back({it->second, start, length, samples});
    };
    for (const serving::DecodeSlot& slot : plan.decode) add(slot.id, slot.position, 1, true);
    for (const serving::PrefillChunk& chunk : plan.prefill) {
      add(chunk.id, chunk.start, chunk.length, chunk.completes_prompt);
    }
  }
  std::vector<char> stopped(works.size(), 0);
  const int hardware = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::min<int>(options_.threads > 0 ? options_.threads : hardware,
                                    static_cast<int>(works.size()));
  std::atomic<size_t> next{0};
  auto worker = [&] {
    for (size_t i = next++; i < works.size(); i = next++) stopped[i] = RunOne(works[i]);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();

  serving::StepOutcome outcome;
  for (size_t i = 0; i < works.size(); ++i) {
    if (stopped[i]) outcome.stopped.push_back(works[i].sequence->id);
  }
  return outcome;
}

bool EngineStepRunner::RunOne(const Work& work) {
  absl::StatusOr<bool> stopped = RunOneOrError(work);
  if (stopped.ok()) return *stopped;
  RequestContext& request = *work.sequence->setup.request;
  absl::MutexLock lock(&request.mu);
  if (request.on_error) request.on_error(work.sequence->setup.choice, stopped.status());
  return true;
}

absl::StatusOr<bool> EngineStepRunner::RunOneOrError(const Work& work) {
  Sequence& seq = *work.sequence;
  const std::vector<int32_t>& prompt = seq.setup.prompt;
  const int64_t prompt_length = static_cast<int64_t>(prompt.size());
  const int64_t end = work.start + work.length;
  // Prefill computes up to the last block boundary the chunk reaches, or the whole prompt.
  const int64_t target = work.samples ? end : end / options_.prefill_block * options_.prefill_block;
  if (target <= seq.computed && !work.samples) return false;
  const std::vector<int32_t>& generated = seq.progress.generated;
  if (end > prompt_length + static_cast<int64_t>(generated.size())) {
    return absl::InternalError(absl::StrCat("sequence ", seq.id, " scheduled up to position ", end,
                                            " but has only ", prompt_length + generated.size(),
                                            " tokens"));
  }

  PDSERVE_ASSIGN_OR_RETURN(serving::PageTable table, pool_->Table(seq.id));
  if (options_.paranoid) {
    if (!seq.pinned) seq.pinned = table;
    PDSERVE_RETURN_IF_ERROR(VerifyPages(seq, "before load"));
    table = *seq.pinned;
  }
  PDSERVE_ASSIGN_OR_RETURN(SequencePages pages, MapPages(*pool_, table));
  engine::ModelState state = model_.NewState();
  PDSERVE_RETURN_IF_ERROR(seq.paged.Load(seq.computed, pages, &state));
  engine::Tensor logits;
  while (state.position < target) {
    const int64_t from = state.position;
    const int64_t to =
        std::min(target, (from / options_.prefill_block + 1) * options_.prefill_block);
    std::vector<int32_t> tokens;
    for (int64_t pos = from; pos < to; ++pos) {
      tokens.push_back(pos < prompt_length ? prompt[pos] : generated[pos - prompt_length]);
    }
    // Only the last row is sampled from (a prompt chunk's or the decode token's).
    PDSERVE_ASSIGN_OR_RETURN(
        logits, model_.Forward(&state, tokens, nullptr, engine::ChunkLogits::kLastRow));
  }
  PDSERVE_RETURN_IF_ERROR(seq.paged.Store(state, seq.computed, pages));
  if (options_.paranoid) PDSERVE_RETURN_IF_ERROR(VerifyPages(seq, "after store"));
  seq.computed = state.position;
  if (!work.samples) return false;
  if (logits.data.empty()) {
    return absl::InternalError(absl::StrCat(
        "sequence ", seq.id, " was asked to sample at position ", end, " with no new input"));
  }

  const int64_t vocab = logits.dim(1);
  std::span<const float> last(logits.ptr() + (logits.dim(0) - 1) * vocab,
                              static_cast<size_t>(vocab));
  std::function<absl::Status()> canary;
  if (seq.setup.canary) canary = [&] { return RunCanary(seq, last); };
  return SampleAndDeliver(seq.setup, last, options_.degeneration, &seq.progress, canary);
}

}  // namespace pdserve::runtime
