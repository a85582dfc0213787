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

// Normalized error above which the canary fails on the CPU engine (fp32; see the header comment
// for the measurement).
inline constexpr double kCanaryTolerance = 1e-3;
// The same bound on the CUDA engine (runtime/cuda/gpu_step_runner.h), which stores the state and
// rounds every GEMM input in bf16 (8 significant bits: one rounding is a relative error up to
// 2^-9 = 2e-3) and recomputes through other kernels than the served decode steps (the any-shape
// attention and indexer instead of the fixed-shape ones, other GEMM row counts). Rounding alone
// keeps decode rows within ~3e-3 of the fp32 CPU engine (docs/engine-gpu.md); a routing or top-k
// near-tie flipped by rounding moves a row by up to ~0.1 there, but only the last position's own
// flip moves the last-token logits that much. A state that attended to the wrong compressed
// entries for every generated token (the test-only wrong indexer) moves them by far more: the
// bound sits above rounding and under that. docs/guards.md gives the distributions measured on
// the GPU (tools/gpu/run_guards_proof.sh prints them).
inline constexpr double kGpuCanaryTolerance = 5e-2;

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

// Compares `served` with `ref` (both float32 [vocab]): max|diff| / max|ref| over the entries
// finite on both sides; pass when that is <= tolerance and no entry is NaN / Inf on either side.
// InvalidArgument when the sizes differ or are 0.
absl::StatusOr<CanaryResult> CompareLogits(std::span<const float> served,
                                           std::span<const float> ref, double tolerance);

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
