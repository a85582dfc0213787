// Token sampling for one request: logits processing, filtering and a counter-based random draw.
//
// For one choice at one position, SampleToken transforms the model's raw logits z (fp32, shape
// [vocab]) in double precision, in this order:
//   0. response_format / tool_choice "required" or named: tokens outside the step's allowed set
//      (a bitset from structured::GrammarConstraint, when the request has a json_schema or a
//      tool_call_grammar) get -inf.
//   1. min_tokens: while fewer than min_tokens tokens are generated, EOS and stop ids get -inf
//      (vLLM MinTokensLogitsProcessor).
//   2. logit_bias: z[t] += bias[t] (OpenAI).
//   3. repetition_penalty r over the distinct prompt and generated tokens: z > 0 -> z / r, else
//      z * r (Keskar et al. 2019, CTRL, section 4.1; transformers
//      RepetitionPenaltyLogitsProcessor).
//   4. presence / frequency penalties over generated tokens: z[t] -= c[t] * frequency +
//      (c[t] > 0) * presence, c[t] the count of t (OpenAI "parameter details").
//   5. temperature T: T < kGreedyTemperature returns the argmax (lowest token id on ties);
//      else z /= T.
//   6. top_k, then top_p on the top-k set renormalized, then min_p (keep p >= min_p * p_max), the
//      order of transformers' TopK / TopP / MinP warpers. Every filter keeps a prefix of the
//      candidates sorted by (z descending, token id ascending), a strict total order, so the kept
//      set and its order never depend on how the sort was carried out.
//   7. One uniform u in [0, 1) from Philox-4x32-10 keyed by (seed, choice, position) (serving/
//      philox.h); the token is the first in the sorted kept set whose running sum of
//      exp(z - z_max) exceeds u times the kept set's sum. One draw per token, a fixed summation
//      order: the result is bit-for-bit reproducible and independent of batch composition.
// Reported logprobs are the log-softmax of the raw logits (before steps 1-6), vLLM's default
// ("raw_logprobs"), so they describe the model, not the sampling transform.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "serving/sampling_params.h"
#include "serving/token_history.h"
#include "structured/grammar_constraint.h"
#include "structured/token_vocabulary.h"

namespace pdserve::serving {

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;  // natural log, from the raw logits
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;  // raw log-softmax at `token`
  // params.logprobs most likely tokens by raw logit (descending, lower id first on ties); empty
  // when params.logprobs is absent.
  std::vector<TokenLogprob> top_logprobs;
};

// The counter of one random draw. `position` is the absolute position of the token being sampled
// (prompt length + tokens generated before it), so the prefill worker's first token and the
// decode worker's later tokens come from one stream.
struct SampleKey {
  uint64_t seed = 0;
  uint32_t choice = 0;
  uint32_t position = 0;
};

// Steps 0-4 of the header: the processed logits, double [vocab], before temperature. Same
// arguments and InvalidArgument errors as SampleToken. Thread-safe: a pure function.
absl::StatusOr<std::vector<double>> ProcessLogits(std::span<const float> logits,
                                                  const SamplingParams& params,
                                                  std::span<const int32_t> end_token_ids,
                                                  const TokenHistory& history,
                                                  std::span<const uint64_t> allowed = {});

// Samples one token. `logits`: raw model output for this choice's last position, fp32 [vocab].
// `params` must have passed ValidateSamplingParams for this vocab. `end_token_ids`: EOS and stop
// ids, masked while history.generated_length() < params.min_tokens. `allowed`: empty, or the
// bitset of the tokens this step may take (bit t of word t / 64; tokens past it are refused).
// Errors: InvalidArgument when logits are empty or hold NaN or +inf (named by token id), or when a
// logit_bias / end token id is outside the logits; FailedPrecondition when every token is masked.
// Thread-safe: a pure function of its arguments.
absl::StatusOr<SampledToken> SampleToken(std::span<const float> logits,
                                         const SamplingParams& params,
                                         std::span<const int32_t> end_token_ids,
                                         const TokenHistory& history, SampleKey key,
                                         std::span<const uint64_t> allowed = {});

enum class FinishReason { kStop, kLength };
const char* FinishReasonName(FinishReason reason);  // "stop" / "length" (OpenAI finish_reason)

// InvalidArgument naming min_tokens when params.min_tokens > 0 and the end ids (eos_token_ids
// unless params.ignore_eos, plus params.stop_token_ids) cover the whole vocabulary [0,
// vocab_size): every token is masked before min_tokens, so no first token could be sampled.
// Ids outside the vocabulary are ignored here (ValidateSamplingParams refuses them). Called by
// the request preparer (400 on min_tokens) and the decode worker's Reserve; RequestSampler::Create
// does not call it (such a sampler fails its first step with FailedPrecondition).
absl::Status CheckMinTokensReachable(const SamplingParams& params,
                                     std::span<const int32_t> eos_token_ids, int64_t vocab_size);

struct SampleStep {
  SampledToken sampled;
  std::optional<FinishReason> finish;  // set when this token ends the choice
};

// The sampling state of one request: its parameters, seed and one TokenHistory per choice.
// Not thread-safe; a request is advanced by one thread at a time (its step in the batch loop).
class RequestSampler {
 public:
  // Validates `params` against `vocab_size` (see ValidateSamplingParams); `eos_token_ids` come from
  // generation_config.json or the model config and are not used when params.ignore_eos (then
  // only params.stop_token_ids end a choice). The seed is EffectiveSeed(params, request_id).
  // A request with params.json_schema or params.tool_call_grammar needs `vocabulary` (the
  // tokenizer's tokens as bytes): its grammar is compiled here (InvalidArgument naming an
  // unsupported keyword) and every choice's tokens are masked to keep the output in it; without
  // a vocabulary such a request is FailedPrecondition.
  static absl::StatusOr<RequestSampler> Create(
      const SamplingParams& params, std::string_view request_id,
      std::span<const int32_t> eos_token_ids, std::span<const int32_t> prompt, int64_t vocab_size,
      std::shared_ptr<const structured::TokenVocabulary> vocabulary = nullptr);

  // Samples and records the next token of `choice` in [0, n). A token that is an EOS or stop id
  // (once min_tokens is reached) finishes the choice with kStop, the max_tokens-th with kLength.
  // Errors: OutOfRange for a bad choice, FailedPrecondition for a finished one, and SampleToken's.
  absl::StatusOr<SampleStep> Next(int32_t choice, std::span<const float> logits);
  // Next in two halves, for a sampler that draws elsewhere (the GPU sampler,
  // runtime/cuda/gpu_sampler.h): PrepareDraw returns SampleToken's arguments for the next token of
  // `choice` (computing the response_format mask over `vocab` tokens); CommitDraw records the
  // token drawn from them and returns Next's SampleStep. The pointers and spans stay valid until
  // the next PrepareDraw, CommitDraw, Next or Record of that choice. Errors: as Next's.
  struct DrawInputs {
    const SamplingParams* params = nullptr;
    std::span<const int32_t> end_token_ids;
    const TokenHistory* history = nullptr;
    SampleKey key;
    std::span<const uint64_t> allowed;
  };
  absl::StatusOr<DrawInputs> PrepareDraw(int32_t choice, int64_t vocab);
  absl::StatusOr<SampleStep> CommitDraw(int32_t choice, SampledToken sampled);
  // Records a token of `choice` drawn elsewhere with this request's key (in PD mode, the prefill
  // worker's first token), so later draws continue the same stream; returns the finish it causes.
  // Errors: as Next's, and InvalidArgument for a token outside the vocabulary or one the
  // constrained output (response_format, tool_choice) cannot continue with.
  absl::StatusOr<std::optional<FinishReason>> Record(int32_t choice, int32_t token);

  const SamplingParams& params() const { return params_; }
  uint64_t seed() const { return seed_; }
  // REQUIRES: 0 <= choice < params().n.
  const TokenHistory& history(int32_t choice) const { return choices_[choice].history; }
  bool finished(int32_t choice) const { return choices_[choice].finished; }

 private:
  struct Choice {
    TokenHistory history;
    bool finished = false;
    // With a json_schema or tool_call_grammar: where the output is in its grammar.
    std::optional<structured::GrammarMatcher> grammar;
    std::vector<uint64_t> mask;  // its last step's allowed tokens
  };
  RequestSampler(const SamplingParams& params, uint64_t seed, int64_t vocab_size,
                 std::vector<int32_t> end_token_ids, std::vector<Choice> choices,
                 std::shared_ptr<structured::GrammarConstraint> constraint);
  // The choice's state when it may take another token; OutOfRange / FailedPrecondition otherwise.
  absl::StatusOr<Choice*> OpenChoice(int32_t choice);
  // Moves the choice's grammar matcher past `token` (an end id: only when the output is
  // complete); InvalidArgument when the output cannot continue with it.
  absl::Status AdvanceGrammar(Choice& state, int32_t token);
  // Appends `token` and returns the finish it causes.
  std::optional<FinishReason> Append(Choice& state, int32_t token);

  SamplingParams params_;
  uint64_t seed_;
  int64_t vocab_size_;
  std::vector<int32_t> end_token_ids_;  // EOS ids then stop ids
  std::vector<Choice> choices_;
  // Shared by copies of this sampler and its choices (thread-safe); null without a json_schema
  // or tool_call_grammar.
  std::shared_ptr<structured::GrammarConstraint> constraint_;
};

}  // namespace pdserve::serving
