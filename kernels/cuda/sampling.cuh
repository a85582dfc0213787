// Batched token sampling on the GPU: the device twin of serving/sampler.h's SampleToken.
//
// Input: raw fp32 logits [rows, stride] (row r's vocab entries at logits[r * stride + t]) and one
// SamplingRow per row. Each row is processed exactly as serving/sampler.h's header lists, in
// double precision and in the same order:
//   0. allowed-token bitset (optional; uint32 words, bit t of word t / 32; the CPU sampler's
//      uint64 words reinterpreted on a little-endian host are the same bits): others get -inf;
//   1. end ids (EOS + stop ids) get -inf while generated < min_tokens;
//   2. logit_bias (sparse: token, bias) added;
//   3. repetition penalty over history entries with `repeat` set (z > 0 ? z / r : z * r);
//   4. z -= count * frequency + presence over history entries with count > 0;
//   5. temperature < kGreedyTemperatureDevice: argmax (lowest id on ties); else z /= T;
//   6. top_k, then top_p, then min_p over candidates sorted by (z desc, id asc);
//   7. one uniform from Philox-4x32-10 keyed by (seed, choice, position), counter
//      {position, choice, 0, 0}, key {seed lo, seed hi}: the first kept candidate whose running
//      sum of exp(z - z_max) exceeds u * (kept sum).
// Logprobs: the chosen token's raw log-softmax (always) and the top_logprobs most likely tokens by
// raw logit (desc, id asc), k <= kMaxSampleTopLogprobs, as serving::SampleToken reports them.
//
// Penalty history: the host passes, per row, a sparse list of the distinct tokens a penalty
// touches (HistoryEntry: token, generated count, whether it is in the prompt or generated), built
// from serving::TokenHistory each step (runtime/cuda/sampling_batch.h). No token-count state
// lives on the device: a row is a pure function of its logits and its SamplingRow.
//
// Method: a prepare kernel writes z (double [rows, stride] of the workspace) with the bitset
// applied and flags NaN / +inf; a sparse kernel applies steps 1-4; a row kernel takes the raw
// log-softmax normalizer, the argmax of z, and for sampled rows writes z / T as descending-order
// keys; sampled rows are sorted by cub::DeviceSegmentedRadixSort (stable, so equal keys keep
// ascending ids: the CPU's (z desc, id asc) order; -0.0 is keyed as +0.0, which the CPU treats
// as equal); a draw kernel runs the filters and the walk and fills the logprobs.
//
// Exactness against the CPU sampler (tests/engine_gpu/sampler_gpu_test.cc measures it):
//   - Bit-identical: z after steps 0-5 (IEEE double add / mul / div, no contraction), the
//     argmax (greedy tokens), the sorted order, the Philox uniform, every comparison order and
//     the running sums of steps 6-7 (one thread, in sorted order, as the CPU).
//   - Not bit-identical: exp() (CUDA's double exp is within 1 ulp, glibc's is correctly rounded
//     almost always), so a weight may differ in its last bit; the total over an untruncated
//     candidate set is a tree sum here and an id-order sum on the CPU; the log-softmax
//     normalizer likewise (logprobs agree to ~1e-12 relative, then rounded to float). A sampled
//     token can therefore differ only when u * total falls within a few ulp (~1e-15 relative) of
//     a boundary of the running sum, or when top_p * total or min_p sits that close to one.
//
// Errors per row in SampledRow::status (the row's other outputs are then unspecified): kBadLogits
// (a NaN or +inf logit: the caller reruns the row on the host for serving's message),
// kAllMasked (every token -inf: the CPU's FailedPrecondition). Ids in the sparse lists must lie
// in [0, vocab) (the host validates them, as serving::ValidateSamplingParams does).
//
// Thread-safety: sample_tokens is asynchronous on `stream` and touches only its arguments and
// workspace; concurrent calls need distinct workspaces. Not meant for graph capture (the sort's
// size is taken per call), and needs no one-time setup.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pdserve::kernels::cuda {

// serving::kGreedyTemperature and serving::kMaxTopLogprobs (checked equal by the GPU tests).
inline constexpr double kGreedyTemperatureDevice = 1e-5;
inline constexpr int32_t kMaxSampleTopLogprobs = 20;

// Per-row sampling parameters (plain data, copied to the device). Offsets index the batch's
// shared arrays (SamplingBatch).
struct SamplingRow {
  double temperature = 1.0;  // < kGreedyTemperatureDevice: greedy
  double top_p = 1.0;        // (0, 1]
  double min_p = 0.0;        // [0, 1]
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  uint64_t seed = 0;
  uint32_t choice = 0;
  uint32_t position = 0;                         // absolute position of the token drawn
  int32_t top_k = 0;                             // <= 0: off
  int32_t top_logprobs = 0;                      // [0, kMaxSampleTopLogprobs]
  int32_t generated = 0;                         // tokens generated before this one
  int32_t min_tokens = 0;                        // end ids masked while generated < min_tokens
  int32_t end_begin = 0, end_count = 0;          // into SamplingBatch::end_ids
  int32_t bias_begin = 0, bias_count = 0;        // into bias_tokens / bias_values
  int32_t history_begin = 0, history_count = 0;  // into history
  int64_t mask_word = -1;  // first of ceil(vocab / 32) words in mask_words; < 0: no mask
};

// A distinct token some penalty touches.
struct HistoryEntry {
  int32_t token = 0;
  int32_t count = 0;   // times generated (presence / frequency penalties)
  int32_t repeat = 0;  // 1: in the prompt or generated (repetition penalty)
};

// Device pointers of one batch; arrays with no entries may be null.
struct SamplingBatch {
  const SamplingRow* rows = nullptr;  // [num_rows]
  const int32_t* end_ids = nullptr;
  const int32_t* bias_tokens = nullptr;
  const double* bias_values = nullptr;
  const HistoryEntry* history = nullptr;
  const uint32_t* mask_words = nullptr;
};

enum SampleStatus : int32_t { kSampleOk = 0, kSampleBadLogits = 1, kSampleAllMasked = 2 };

// One row's result (what crosses to the host).
struct SampledRow {
  int32_t token = 0;
  int32_t status = kSampleOk;
  float logprob = 0.0f;  // raw log-softmax at token
  int32_t num_top = 0;   // min(top_logprobs, vocab)
  int32_t top_tokens[kMaxSampleTopLogprobs] = {};
  float top_logprobs[kMaxSampleTopLogprobs] = {};
};

// Bytes of device workspace sample_tokens needs for up to `max_rows` rows of `vocab` tokens
// (0 when the arguments are out of range: rows in [1, 4096], vocab in [1, 2^24]).
size_t sampling_workspace_bytes(int64_t max_rows, int64_t vocab);

// Samples one token per row. logits: device fp32 [rows, stride], vocab <= stride; batch: device
// arrays as above; out: device [rows]. workspace: device, 256-byte aligned, at least
// sampling_workspace_bytes(rows, vocab) bytes (`workspace_bytes`). Returns cudaErrorInvalidValue
// for bad arguments (RefuseLaunch names the check), else the first launch error.
cudaError_t sample_tokens(const float* logits, int64_t rows, int64_t stride, int64_t vocab,
                          const SamplingBatch& batch, SampledRow* out, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
