// What every GenerationService does with an ApiRequest before any model work, and with each
// generated token after it, shared by the colocated service and the router so that both modes
// produce the same prompt, the same sampling parameters and the same text for a request:
//
//  - Prepare(): tokenizes (text::Tokenizer; chat through the model's text::ChatFormat, the OpenAI
//    "developer" role read as "system", `thinking` from chat_template_kwargs), fills unset sampling
//    fields from generation_config.json (else temperature 0.6), checks the context length
//    (400 context_length_exceeded) and the sampling ranges (400), and names the request.
//  - ChoiceText: one choice's incremental detokenizer (UTF-8 safe, stop strings held back) that
//    turns sampled tokens into frontend::ChoiceDelta values, logprobs included.
//
// Thread-safety: RequestPreparer is immutable after Load() and safe to share; a ChoiceText is
// used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "frontend/api_request.h"
#include "frontend/api_response.h"
#include "serving/sampling_params.h"
#include "text/chat_format.h"
#include "text/chat_output_parser.h"
#include "text/incremental_detokenizer.h"
#include "text/tokenizer.h"

namespace pdserve::frontend {

// A request ready to run.
struct PreparedRequest {
  // Response id ("cmpl-..." / "chatcmpl-..."); also the string the seed derives from when the
  // request gives none (serving::EffectiveSeed).
  std::string request_id;
  std::vector<int32_t> prompt;  // token ids, non-empty
  // Defaults from generation_config.json, then the request's fields; max_tokens resolved
  // (request value, else the room left in the context); n = number of choices. `seed` is left
  // as the request gave it.
  serving::SamplingParams params;
};

using Prepared = std::variant<PreparedRequest, ApiError>;

// One sampled token as a worker or the engine reports it.
struct SampledText {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // alternatives, best first
};

class RequestPreparer {
 public:
  // Loads `model_dir`'s tokenizer, chat format (optional: without one, chat requests get 400),
  // generation_config.json and config.json (context length, vocabulary, EOS ids). No weights.
  // Errors: those of the loaders (NotFound, InvalidArgument).
  static absl::StatusOr<std::unique_ptr<RequestPreparer>> Load(const std::string& model_dir);

  // The prompt and parameters for `req`, or the 400 error to answer.
  Prepared Prepare(const ApiRequest& req) const;
  // The prompt's token ids alone. Errors: InvalidArgument (no chat format, template failure).
  absl::StatusOr<std::vector<int32_t>> PromptTokens(const ApiRequest& req) const;

  const text::Tokenizer& tokenizer() const { return *tokenizer_; }
  // The model's chat format; nullptr when it has none.
  const text::ChatFormat* chat_format() const { return chat_format_.get(); }
  // EOS ids: generation_config.json's, else config.json's.
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  const serving::SamplingParams& defaults() const { return defaults_; }
  int64_t context_length() const { return context_length_; }
  int64_t vocab_size() const { return vocab_size_; }
  // {directory name, model_dir}: the names accepted in a request's "model" field. The first
  // (the directory's own name, without the path) is the served name /v1/models lists.
  const std::vector<std::string>& model_names() const { return model_names_; }

  // The API logprob entry for one sampled token.
  TokenLogprob Logprob(const SampledText& sampled) const;

 private:
  RequestPreparer() = default;
  // The 400 context_length_exceeded for a prompt of `prompt_length` tokens, or nullopt when it
  // and the request's max_tokens fit the context. A prompt that leaves no room for one token
  // is blamed on the prompt ("prompt" / "messages"); a prompt that fits with a max_tokens that
  // does not, on max_tokens (a chat request without max_tokens gets the room that is left).
  std::optional<ApiError> ContextLengthError(const ApiRequest& req, int64_t prompt_length) const;
  // The 400 context_length_exceeded for a text prompt (or chat messages) whose byte length alone
  // shows that it cannot fit: at least bytes / (2 * max_token_bytes_) tokens, that many >= the
  // context. nullopt when it may fit (then the tokens decide) or the prompt is token ids.
  std::optional<ApiError> SurelyTooLong(const ApiRequest& req) const;
  std::vector<std::string> model_names_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<text::ChatFormat> chat_format_;
  serving::SamplingParams defaults_;
  std::vector<int32_t> eos_ids_;
  int64_t context_length_ = 0;
  int64_t vocab_size_ = 0;
  int64_t max_token_bytes_ = 1;  // the longest any token decodes to (special tokens included)
};

// One choice's text: feed it tokens in order; it says what to send and when the choice is over.
// A chat choice's text is split into reasoning, content and tool calls (text::ChatOutputParser);
// a choice that made tool calls and stopped ends with finish_reason "tool_calls".
class ChoiceText {
 public:
  // REQUIRES: `preparer` outlives this object.
  ChoiceText(const RequestPreparer& preparer, const ApiRequest& req, int index);

  // Adds one token. `finish_reason` non-empty: the generator ended the choice with this token
  // ("stop", "length", "degenerate"). The delta carries the text that became final, the
  // token's logprob when the request asked for them, and finish_reason when the choice ended
  // (a stop string also ends it, as "stop"). An empty delta (no text, no logprobs, no finish)
  // need not be sent.
  ChoiceDelta Add(const SampledText& sampled, const std::string& finish_reason);
  // Ends the choice without a token (a generator that finished after its last token): releases
  // held-back text with `finish_reason`.
  ChoiceDelta Finish(const std::string& finish_reason);

  bool done() const { return done_; }
  int64_t tokens() const { return tokens_; }
  // Of tokens(), those sampled while the answer was still in its reasoning.
  int64_t reasoning_tokens() const { return reasoning_tokens_; }
  // The reason the choice ended ("" while it runs).
  const std::string& finish_reason() const { return finish_reason_; }

 private:
  // Whether `token` ending the choice with `finish_reason` is its EOS or stop token.
  bool EndsChoice(int32_t token, const std::string& finish_reason) const;
  // Runs released text through the answer parser into `delta` (`at_end`: the choice is over).
  void Split(std::string text, bool at_end, ChoiceDelta& delta);
  void End(const std::string& finish_reason, ChoiceDelta& delta);
  // The detokenizer's held-back text at the end of a choice ended with `finish_reason`.
  std::string FinishText(const std::string& finish_reason);

  const RequestPreparer& preparer_;
  text::IncrementalDetokenizer detokenizer_;
  std::optional<text::ChatOutputParser> answer_;
  int index_;
  bool want_logprobs_;
  bool parallel_tool_calls_;
  std::vector<int32_t> stop_token_ids_;
  int tool_calls_ = 0;
  int64_t tokens_ = 0;
  int64_t reasoning_tokens_ = 0;
  bool done_ = false;
  std::string finish_reason_;
};

}  // namespace pdserve::frontend
