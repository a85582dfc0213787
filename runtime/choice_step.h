// The sampling half of a runner step, shared by the CPU and CUDA step runners
// (runtime/step_runner.h, runtime/cuda/gpu_step_runner.h): a choice's next token drawn with its
// request's serving::RequestSampler from the logits the engine produced, the degeneration
// detector fed, the TokenEvent built and delivered. Both runners therefore sample, flag and stop
// identically; only how the logits are computed differs.
//
// Thread-safety: a ChoiceProgress belongs to one sequence and is touched by the one thread running
// that sequence's work in a step. SampleAndDeliver locks the request's mutex.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "guards/degeneration_detector.h"
#include "runtime/step_types.h"

namespace pdserve::runtime {

// InvalidArgument unless `setup` has a prompt, max_tokens >= 1, a request and a choice >= 0 (what
// both runners' Add require of sequence `id`).
absl::Status CheckSequenceSetup(serving::RequestId id, const SequenceSetup& setup);

// What a choice has generated so far, and what the detector thinks of it.
struct ChoiceProgress {
  explicit ChoiceProgress(const guards::DegenerationThresholds& thresholds)
      : detector(thresholds) {}
  // Appends `token` (sampled here, or elsewhere: the PD first token) and updates the flag.
  void Record(int32_t token);

  std::vector<int32_t> generated;
  guards::DegenerationDetector detector;
  bool degenerate = false;  // sticky once the detector fired
};

// Samples `setup`'s next token from `last` (fp32 logits [vocab] of the token at the sequence's
// current end), records it in `progress` and delivers the TokenEvent to on_token. When the token
// ends the choice (EOS / stop id, max_tokens, or degeneration with action kStop) `before_final`
// (may be empty: the canary) runs first; its error fails the choice instead of delivering the
// token. Returns true when the choice stops (EOS / stop id, degeneration stop, or on_token asked),
// false when it goes on or ended by length. Errors: the sampler's and before_final's.
absl::StatusOr<bool> SampleAndDeliver(const SequenceSetup& setup, std::span<const float> last,
                                      DegenerationAction action, ChoiceProgress* progress,
                                      const std::function<absl::Status()>& before_final);

// As SampleAndDeliver, for a token drawn elsewhere from the inputs of
// RequestSampler::PrepareDraw (the GPU sampler): records `sampled` with CommitDraw, then flags,
// runs `before_final` and delivers exactly as SampleAndDeliver. Errors: CommitDraw's and
// before_final's.
absl::StatusOr<bool> CommitAndDeliver(const SequenceSetup& setup, serving::SampledToken sampled,
                                      DegenerationAction action, ChoiceProgress* progress,
                                      const std::function<absl::Status()>& before_final);

}  // namespace pdserve::runtime
