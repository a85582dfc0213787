// The logits canary (issue 9): a sampled 1 in N requests has the logits that the serving path
// produced for its last token recomputed from scratch (a fresh engine state, one one-shot
// Model::Forward over the whole token sequence) and compared. A mismatch means the serving path's
// state (paged, chunked, transferred from a prefill worker, or computed by a custom kernel) no
// longer equals what the model computes, which is exactly what contaminated or corrupted decode
// state looks like from outside: a fluent answer to the wrong context.
//
// Comparison: max_i |served_i - ref_i| / max_i |ref_i| over the vocabulary (the same normalized
// error as tests/engine/fixture_test.cc). Incremental decode and the one-shot forward are not
// bit-identical (float summation order differs between GEMM shapes); on the bundled model the
// normal error is ~1e-6 (docs/guards.md measures it), so kCanaryTolerance = 1e-3 sits three orders
// of magnitude above it and two below the error a single wrong state row causes.
//
// Cost: one prefill of the whole sequence per checked choice, on the caller's thread.
// Thread-safety: CanarySampler is immutable; CheckLastTokenLogits may run concurrently (Model's
// Forward is safe on distinct states and the function makes its own).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/model.h"

namespace pdserve::guards {

// Normalized error above which the canary fails (see the header comment for the measurement).
inline constexpr double kCanaryTolerance = 1e-3;

// Picks 1 in `every` requests, deterministically: request ids whose xxh3-64 is 0 mod `every`.
// The same id is picked on every worker and every run, so a failing request can be replayed.
class CanarySampler {
 public:
  // every <= 0: never picks; 1: picks every request.
  explicit CanarySampler(int64_t every) : every_(every) {}
  bool Picks(absl::string_view request_id) const;
  int64_t every() const { return every_; }

 private:
  int64_t every_;
};

struct CanaryResult {
  double max_abs_diff = 0;  // max_i |served_i - ref_i|
  double max_abs_ref = 0;   // max_i |ref_i|
  double error = 0;         // max_abs_diff / max_abs_ref (max_abs_diff when max_abs_ref is 0)
  bool pass = false;        // error <= tolerance, and no NaN / Inf on either side
};

// Recomputes the logits of tokens.back() (i.e. the distribution the serving path sampled the
// next token from) and compares `served` (float32 [vocab_size]) with them.
// tokens: the whole sequence so far, prompt then generated, every id in [0, vocab_size).
// Errors: InvalidArgument for an empty sequence, a sequence longer than max_position_embeddings,
// a `served` of the wrong size, or an out-of-range token id. A mismatch is not an error: see pass.
absl::StatusOr<CanaryResult> CheckLastTokenLogits(const engine::Model& model,
                                                  const std::vector<int32_t>& tokens,
                                                  std::span<const float> served,
                                                  double tolerance = kCanaryTolerance);

// The error a failed canary turns into: Internal, "canary mismatch: <who>: logits differ from a
// fresh one-shot forward by <error> (max|diff| <d>, max|ref| <r>, tolerance <t>)".
absl::Status CanaryMismatchError(absl::string_view who, const CanaryResult& result,
                                 double tolerance = kCanaryTolerance);

}  // namespace pdserve::guards
