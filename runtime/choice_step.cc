#include "runtime/choice_step.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::runtime {

absl::Status CheckSequenceSetup(serving::RequestId id, const SequenceSetup& setup) {
  if (!setup.prompt.empty() && setup.max_tokens >= 1 && setup.request && setup.choice >= 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("sequence ", id, " needs a prompt, max_tokens >= 1, a request and a choice"));
}

void ChoiceProgress::Record(int32_t token) {
  generated.push_back(token);
  detector.Push(token);
  degenerate = degenerate || detector.Repetitive();
}

namespace {

// The part after the draw, under request.mu.
absl::StatusOr<bool> Deliver(const SequenceSetup& setup, RequestContext& request,
                             serving::SampleStep step, DegenerationAction action,
                             ChoiceProgress* progress,
                             const std::function<absl::Status()>& before_final)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(request.mu) {
  progress->Record(step.sampled.token);
  TokenEvent event{setup.choice, std::move(step.sampled), "", progress->degenerate,
                   progress->degenerate ? "repeat" : ""};
  bool stop = false;
  if (step.finish) {
    event.finish_reason = serving::FinishReasonName(*step.finish);
    stop = *step.finish == serving::FinishReason::kStop;
  } else if (progress->degenerate && action == DegenerationAction::kStop) {
    event.finish_reason = "degenerate";
    stop = true;
  }
  // The canary runs before the last token is delivered, so a mismatch fails the choice instead.
  if (before_final && !event.finish_reason.empty()) PDSERVE_RETURN_IF_ERROR(before_final());
  if (request.on_token && request.on_token(event)) stop = true;
  return stop;
}

}  // namespace

absl::StatusOr<bool> SampleAndDeliver(const SequenceSetup& setup, std::span<const float> last,
                                      DegenerationAction action, ChoiceProgress* progress,
                                      const std::function<absl::Status()>& before_final) {
  RequestContext& request = *setup.request;
  absl::MutexLock lock(&request.mu);
  PDSERVE_ASSIGN_OR_RETURN(serving::SampleStep step, request.sampler.Next(setup.choice, last));
  return Deliver(setup, request, std::move(step), action, progress, before_final);
}

absl::StatusOr<bool> CommitAndDeliver(const SequenceSetup& setup, serving::SampledToken sampled,
                                      DegenerationAction action, ChoiceProgress* progress,
                                      const std::function<absl::Status()>& before_final) {
  RequestContext& request = *setup.request;
  absl::MutexLock lock(&request.mu);
  PDSERVE_ASSIGN_OR_RETURN(serving::SampleStep step,
                           request.sampler.CommitDraw(setup.choice, std::move(sampled)));
  return Deliver(setup, request, std::move(step), action, progress, before_final);
}

}  // namespace pdserve::runtime
