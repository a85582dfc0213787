#include "serving/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::serving {

int64_t StepPlan::tokens() const {
  int64_t total = static_cast<int64_t>(decode.size());
  for (const PrefillChunk& chunk : prefill) total += chunk.length;
  return total;
}

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(SchedulerOptions options,
                                                             PagePool* pool, PageDemandFn demand,
                                                             const Clock* clock,
                                                             ReleaseFence* fence) {
  if (options.max_running < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_running must be >= 1, got ", options.max_running));
  }
  // With at most max_running - 1 decodes beside a prefilling sequence, a larger budget leaves
  // every step at least one prefill token, so admitted prompts always progress.
  if (options.token_budget <= options.max_running) {
    return absl::InvalidArgumentError(absl::StrCat("token_budget (", options.token_budget,
                                                   ") must exceed max_running (",
                                                   options.max_running, ")"));
  }
  if (options.max_queue_time < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_queue_time must not be negative");
  }
  if (pool == nullptr || clock == nullptr || !demand) {
    return absl::InvalidArgumentError("scheduler needs a page pool, a clock and a demand function");
  }
  return std::unique_ptr<Scheduler>(new Scheduler(options, pool, std::move(demand), clock, fence));
}

Scheduler::Scheduler(SchedulerOptions options, PagePool* pool, PageDemandFn demand,
                     const Clock* clock, ReleaseFence* fence)
    : options_(options), pool_(pool), demand_(std::move(demand)), clock_(clock), fence_(fence) {}

absl::Status Scheduler::Submit(const SequenceSpec& spec) {
  if (spec.prompt_tokens < 1 || spec.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", spec.id,
                                                   " needs prompt_tokens >= 1 and max_tokens >= 1, "
                                                   "got ",
                                                   spec.prompt_tokens, " and ", spec.max_tokens));
  }
  Sequence sequence{spec, demand_(spec.prompt_tokens + spec.max_tokens), clock_->Now()};
  if (sequence.demand.size() != static_cast<size_t>(pool_->num_kinds())) {
    return absl::InvalidArgumentError(absl::StrCat("page demand names ", sequence.demand.size(),
                                                   " kinds, the pool has ", pool_->num_kinds()));
  }
  for (int32_t k = 0; k < pool_->num_kinds(); ++k) {
    if (sequence.demand[k] < 0 || sequence.demand[k] > pool_->pages_total(k)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence ", spec.id, " of ", spec.prompt_tokens + spec.max_tokens,
                       " tokens needs ", sequence.demand[k], " pages of kind '",
                       pool_->kind(k).name, "'; the pool has ", pool_->pages_total(k)));
    }
  }
  absl::MutexLock lock(&mutex_);
  if (sequences_.contains(spec.id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", spec.id, " is already scheduled"));
  }
  if (waiting_.empty() && FitsLocked(sequence)) {
    auto [it, inserted] = sequences_.emplace(spec.id, std::move(sequence));
    if (absl::Status status = AdmitLocked(it->second); !status.ok()) {
      sequences_.erase(it);
      return status;
    }
    return absl::OkStatus();
  }
  if (options_.policy == AdmissionPolicy::kReject) {
    return absl::UnavailableError(absl::StrCat(
        "no room for sequence ", spec.id, ": ", running_.size(), " of ", options_.max_running,
        " running, ", waiting_.size(), " waiting, or too few free state pages"));
  }
  sequences_.emplace(spec.id, std::move(sequence));
  waiting_.push_back(spec.id);
  return absl::OkStatus();
}

bool Scheduler::FitsLocked(const Sequence& sequence) const {
  return static_cast<int64_t>(running_.size()) < options_.max_running &&
         pool_->CanAllocate(sequence.demand);
}

absl::Status Scheduler::AdmitLocked(Sequence& sequence) {
  PDSERVE_ASSIGN_OR_RETURN(sequence.table, pool_->Allocate(sequence.spec.id, sequence.demand));
  sequence.phase = SequencePhase::kPrefill;
  running_.push_back(sequence.spec.id);
  return absl::OkStatus();
}

PageTable Scheduler::RemoveRunningLocked(RequestId id) {
  running_.erase(std::find(running_.begin(), running_.end(), id));
  auto node = sequences_.extract(id);
  return std::move(node.mapped().table);
}

absl::Status Scheduler::ReleaseAll(std::vector<PageTable> tables) {
  absl::Status first_error;
  for (PageTable& table : tables) {
    absl::Status status =
        fence_ != nullptr ? fence_->Release(std::move(table)) : pool_->Free(table);
    first_error.Update(status);
  }
  return first_error;
}

absl::Status Scheduler::Cancel(RequestId id) {
  std::vector<PageTable> release;
  {
    absl::MutexLock lock(&mutex_);
    auto it = sequences_.find(id);
    if (it == sequences_.end() || it->second.cancelled) {
      return absl::NotFoundError(absl::StrCat("sequence ", id, " is not scheduled"));
    }
    Sequence& sequence = it->second;
    if (sequence.phase == SequencePhase::kWaiting) {
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
      sequences_.erase(it);
      return absl::OkStatus();
    }
    if (in_flight_ids_.contains(id)) {
      sequence.cancelled = true;
      running_.erase(std::find(running_.begin(), running_.end(), id));
      return absl::OkStatus();
    }
    release.push_back(RemoveRunningLocked(id));
  }
  return ReleaseAll(std::move(release));
}

absl::StatusOr<StepPlan> Scheduler::BuildStep() {
  absl::MutexLock lock(&mutex_);
  if (in_flight_) return absl::FailedPreconditionError("a step is already in flight");
  StepPlan plan;
  plan.step = ++steps_built_;

  const absl::Time now = clock_->Now();
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (now - sequences_.at(*it).arrival >= options_.max_queue_time) {
      plan.expired.push_back(*it);
      sequences_.erase(*it);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  while (!waiting_.empty() && FitsLocked(sequences_.at(waiting_.front()))) {
    PDSERVE_RETURN_IF_ERROR(AdmitLocked(sequences_.at(waiting_.front())));
    waiting_.pop_front();
  }

  int64_t budget = options_.token_budget;
  for (RequestId id : running_) {
    const Sequence& sequence = sequences_.at(id);
    if (sequence.phase != SequencePhase::kDecode) continue;
    plan.decode.push_back({id, sequence.spec.prompt_tokens + sequence.generated - 1});
    --budget;
  }
  for (RequestId id : running_) {
    if (budget == 0) break;
    const Sequence& sequence = sequences_.at(id);
    if (sequence.phase != SequencePhase::kPrefill) continue;
    const int64_t remaining = sequence.spec.prompt_tokens - sequence.prefilled;
    const int64_t length = std::min(remaining, budget);
    plan.prefill.push_back({id, sequence.prefilled, length, length == remaining});
    budget -= length;
  }

  in_flight_ids_.clear();
  for (const DecodeSlot& slot : plan.decode) in_flight_ids_.insert(slot.id);
  for (const PrefillChunk& chunk : plan.prefill) in_flight_ids_.insert(chunk.id);
  in_flight_ = plan;
  return plan;
}

absl::StatusOr<std::vector<RequestId>> Scheduler::CompleteStep(const StepOutcome& outcome) {
  std::vector<RequestId> finished;
  std::vector<PageTable> release;
  {
    absl::MutexLock lock(&mutex_);
    if (!in_flight_) return absl::FailedPreconditionError("no step is in flight");
    absl::flat_hash_set<RequestId> sampled;
    for (const DecodeSlot& slot : in_flight_->decode) sampled.insert(slot.id);
    for (const PrefillChunk& chunk : in_flight_->prefill) {
      if (chunk.completes_prompt) sampled.insert(chunk.id);
    }
    const absl::flat_hash_set<RequestId> stopped(outcome.stopped.begin(), outcome.stopped.end());
    for (RequestId id : stopped) {
      if (!sampled.contains(id)) {
        return absl::InvalidArgumentError(
            absl::StrCat("step ", in_flight_->step, " sampled no token for sequence ", id));
      }
    }

    release = EndStepLocked();
    const StepPlan& plan = *in_flight_;
    for (const DecodeSlot& slot : plan.decode) {
      if (AdvanceLocked(slot.id, 0, 1, stopped.contains(slot.id))) finished.push_back(slot.id);
    }
    for (const PrefillChunk& chunk : plan.prefill) {
      if (AdvanceLocked(chunk.id, chunk.length, chunk.completes_prompt ? 1 : 0,
                        stopped.contains(chunk.id))) {
        finished.push_back(chunk.id);
      }
    }
    for (RequestId id : finished) release.push_back(RemoveRunningLocked(id));
    in_flight_.reset();
  }
  PDSERVE_RETURN_IF_ERROR(ReleaseAll(std::move(release)));
  return finished;
}

bool Scheduler::AdvanceLocked(RequestId id, int64_t prefilled, int64_t generated, bool stopped) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return false;  // cancelled during the step, already released
  Sequence& sequence = it->second;
  sequence.prefilled += prefilled;
  if (sequence.prefilled == sequence.spec.prompt_tokens) sequence.phase = SequencePhase::kDecode;
  sequence.generated += generated;
  return stopped || sequence.generated >= sequence.spec.max_tokens;
}

std::vector<PageTable> Scheduler::EndStepLocked() {
  std::vector<PageTable> release;
  for (RequestId id : in_flight_ids_) {
    auto it = sequences_.find(id);
    if (it != sequences_.end() && it->second.cancelled) {
      release.push_back(std::move(it->second.table));
      sequences_.erase(it);
    }
  }
  in_flight_ids_.clear();
  return release;
}

absl::Status Scheduler::AbortStep() {
  std::vector<PageTable> release;
  {
    absl::MutexLock lock(&mutex_);
    if (!in_flight_) return absl::FailedPreconditionError("no step is in flight");
    release = EndStepLocked();
    in_flight_.reset();
  }
  return ReleaseAll(std::move(release));
}

absl::StatusOr<Scheduler::StepResult> Scheduler::Step(StepRunner& runner) {
  StepResult result;
  PDSERVE_ASSIGN_OR_RETURN(result.plan, BuildStep());
  absl::StatusOr<StepOutcome> outcome = runner.Run(result.plan);
  if (!outcome.ok()) {
    PDSERVE_RETURN_IF_ERROR(AbortStep());
    return outcome.status();
  }
  PDSERVE_ASSIGN_OR_RETURN(result.finished, CompleteStep(*outcome));
  return result;
}

std::optional<SequenceStatus> Scheduler::Find(RequestId id) const {
  absl::MutexLock lock(&mutex_);
  auto it = sequences_.find(id);
  if (it == sequences_.end() || it->second.cancelled) return std::nullopt;
  return SequenceStatus{it->second.phase, it->second.prefilled, it->second.generated};
}

int64_t Scheduler::num_waiting() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(waiting_.size());
}

int64_t Scheduler::num_running() const {
  absl::MutexLock lock(&mutex_);
  return static_cast<int64_t>(running_.size());
}

int64_t Scheduler::num_decoding() const {
  absl::MutexLock lock(&mutex_);
  int64_t decoding = 0;
  for (RequestId id : running_) decoding += sequences_.at(id).phase == SequencePhase::kDecode;
  return decoding;
}

uint64_t Scheduler::steps_built() const {
  absl::MutexLock lock(&mutex_);
  return steps_built_;
}

}  // namespace pdserve::serving
