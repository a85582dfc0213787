#include "frontend/request_preparer.h"

#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/config.h"
#include "frontend/chat_prompt.h"
#include "serving/generation_config.h"
#include "serving/sampler.h"
#include "structured/tool_call_grammar.h"

namespace pdserve::frontend {
namespace {

constexpr double kSuppressedControlTokenBias = -100.0;

serving::SamplingParams RequestParams(const ApiRequest& req, serving::SamplingParams params) {
  if (req.temperature) params.temperature = *req.temperature;
  if (req.top_p) params.top_p = *req.top_p;
  if (req.top_k) params.top_k = static_cast<int32_t>(*req.top_k);
  if (req.min_p) params.min_p = *req.min_p;
  if (req.presence_penalty) params.presence_penalty = *req.presence_penalty;
  if (req.frequency_penalty) params.frequency_penalty = *req.frequency_penalty;
  if (req.repetition_penalty) params.repetition_penalty = *req.repetition_penalty;
  params.logit_bias = req.logit_bias;
  params.seed = req.seed;
  params.stop_token_ids = req.stop_token_ids;
  if (req.min_tokens) params.min_tokens = static_cast<int32_t>(*req.min_tokens);
  params.n = req.n;
  if (req.logprobs) params.logprobs = req.top_logprobs;
  params.ignore_eos = req.ignore_eos;
  params.json_schema = req.json_schema;
  return params;
}

// The request parameter a serving::ValidateSamplingParams error is about: the first word of its
// message ("logit_bias[5] must be ...", "top_p 1e-40 cannot ...").
std::string SamplingParamOf(absl::string_view message) {
  return std::string(message.substr(0, message.find_first_not_of("abcdefghijklmnopqrstuvwxyz_")));
}

// tool_choice "required" / a named function: the grammar spec of the answer's tool-call block
// (structured/tool_call_grammar.h) over the request's tools, or the named one; "" otherwise.
// Errors: a 400 on "tools" naming what of a tool's schema cannot be enforced.
absl::StatusOr<std::string> ToolCallGrammarSpec(const text::ChatFormat* format,
                                                const ApiRequest& req) {
  if (format == nullptr || req.endpoint != Endpoint::kChatCompletions ||
      (req.tool_choice != ToolChoice::kRequired && req.tool_choice != ToolChoice::kNamed)) {
    return std::string();
  }
  std::vector<nlohmann::ordered_json> tools;
  for (const nlohmann::ordered_json& tool : req.tools) {
    if (req.tool_choice == ToolChoice::kRequired || tool["name"] == req.tool_choice_name) {
      tools.push_back(tool);
    }
  }
  const std::string dsml = format->AnswerOptions(ChatOptionsOf(req), /*parse_tools=*/true).dsml;
  std::string spec = structured::ToolCallGrammar::Spec(dsml, req.parallel_tool_calls, tools);
  absl::StatusOr<std::shared_ptr<const structured::ToolCallGrammar>> compiled =
      structured::ToolCallGrammar::Parse(spec);
  if (!compiled.ok()) return compiled.status();
  return spec;
}

// The last component of `model_dir` ("models/kjv-v4-tiny/" and "." name their directory too).
std::string DirectoryName(const std::string& model_dir) {
  std::error_code error;
  std::filesystem::path path = std::filesystem::absolute(model_dir, error);
  if (error) path = model_dir;
  path = path.lexically_normal();
  if (!path.has_filename()) path = path.parent_path();
  return path.filename().string();
}

}  // namespace

absl::StatusOr<std::unique_ptr<RequestPreparer>> RequestPreparer::Load(
    const std::string& model_dir) {
  std::unique_ptr<RequestPreparer> p(new RequestPreparer());
  p->model_names_ = {DirectoryName(model_dir), model_dir};
  PDSERVE_ASSIGN_OR_RETURN(engine::ModelConfig config, engine::ModelConfig::Load(model_dir));
  p->context_length_ = config.max_position_embeddings;
  p->vocab_size_ = config.vocab_size;
  PDSERVE_ASSIGN_OR_RETURN(p->tokenizer_, text::Tokenizer::Load(model_dir));
  std::string bytes;
  for (int32_t id = 0; id < p->tokenizer_->vocab_size(); ++id) {
    bytes.clear();
    if (p->tokenizer_->AppendTokenBytes(id, /*skip_special_tokens=*/false, &bytes).ok()) {
      p->max_token_bytes_ = std::max<int64_t>(p->max_token_bytes_, std::ssize(bytes));
    }
  }
  absl::StatusOr<std::unique_ptr<text::ChatFormat>> chat =
      text::LoadChatFormat(model_dir, *p->tokenizer_);
  if (chat.ok()) p->chat_format_ = std::move(*chat);
  PDSERVE_ASSIGN_OR_RETURN(serving::GenerationConfig generation,
                           serving::GenerationConfig::Load(model_dir));
  p->defaults_ = serving::SamplingParams::FromGenerationConfig(generation);
  p->eos_ids_ = generation.eos_token_ids;
  if (p->eos_ids_.empty()) {
    for (int64_t id : config.eos_token_ids) p->eos_ids_.push_back(static_cast<int32_t>(id));
  }
  return p;
}

absl::StatusOr<std::vector<int32_t>> RequestPreparer::PromptTokens(const ApiRequest& req) const {
  if (req.endpoint == Endpoint::kCompletions) {
    if (req.prompt_tokens) return *req.prompt_tokens;
    return tokenizer_->Encode(req.prompt_text.value_or(""));
  }
  if (!chat_format_) {
    return absl::InvalidArgumentError(
        absl::StrCat("model ", model_names_[0], " has no chat format; use /v1/completions"));
  }
  return ChatPromptTokens(*chat_format_, *tokenizer_, req);
}

std::optional<ApiError> RequestPreparer::SurelyTooLong(const ApiRequest& req) const {
  int64_t bytes = 0;
  if (req.endpoint == Endpoint::kCompletions) {
    if (req.prompt_tokens || !req.prompt_text) return std::nullopt;
    bytes = std::ssize(*req.prompt_text);
  } else {
    for (const ChatMessage& m : req.messages) bytes += std::ssize(m.content);
  }
  // Every token stands for at most max_token_bytes_ bytes of the text (byte-level BPE; the
  // factor 2 leaves room for a normalizer that shortens text), so a prompt of `bytes` bytes has
  // at least this many tokens.
  const int64_t at_least = bytes / (2 * std::max<int64_t>(max_token_bytes_, 1));
  if (at_least < context_length_) return std::nullopt;
  const bool chat = req.endpoint == Endpoint::kChatCompletions;
  const char* what = chat ? "messages" : "prompt";
  return InvalidRequest(
      absl::StrCat("This model's maximum context length is ", context_length_,
                   " tokens. However, your ", what, " (", bytes, " bytes) ", chat ? "have" : "has",
                   " at least ", at_least, " tokens. Please reduce the length of the ", what, "."),
      what, "context_length_exceeded");
}

Prepared RequestPreparer::Prepare(const ApiRequest& req) const {
  // A prompt far too long for the context is refused before it is tokenized (which can take
  // seconds for megabytes of text, on the server's I/O thread).
  if (std::optional<ApiError> error = SurelyTooLong(req)) return *error;
  // A tool schema the grammar cannot enforce is refused whatever the prompt's length.
  absl::StatusOr<std::string> grammar = ToolCallGrammarSpec(chat_format_.get(), req);
  if (!grammar.ok()) {
    return InvalidRequest(absl::StrCat("'tools' cannot be enforced for tool_choice \"required\" "
                                       "or a named function: ",
                                       grammar.status().message()),
                          "tools");
  }
  absl::StatusOr<std::vector<int32_t>> prompt = PromptTokens(req);
  if (!prompt.ok()) {
    return InvalidRequest(std::string(prompt.status().message()),
                          req.endpoint == Endpoint::kCompletions ? "prompt" : "messages");
  }
  if (prompt->empty()) return InvalidRequest("the prompt has no tokens", "prompt");
  const int64_t prompt_length = static_cast<int64_t>(prompt->size());
  if (std::optional<ApiError> error = ContextLengthError(req, prompt_length)) return *error;
  const int64_t max_tokens = req.max_tokens.value_or(context_length_ - prompt_length);
  PreparedRequest out;
  out.request_id = NewResponseId(req.endpoint);
  out.prompt = std::move(*prompt);
  out.params = RequestParams(req, defaults_);
  out.params.max_tokens = static_cast<int32_t>(max_tokens);
  out.params.tool_call_grammar = std::move(*grammar);
  if (req.endpoint == Endpoint::kChatCompletions && chat_format_) {
    // The chat format's control tokens cannot occur in an answer: suppressed (OpenAI's strongest
    // logit_bias), unless the request biases that token itself. docs/chat-format.md.
    for (int32_t id :
         text::ControlTokenIdsNotInAnswer(*chat_format_, *tokenizer_, ChatOptionsOf(req))) {
      out.params.logit_bias.try_emplace(id, kSuppressedControlTokenBias);
    }
  }
  for (int32_t id : out.prompt) {
    if (id < 0 || id >= vocab_size_) {
      return InvalidRequest(
          absl::StrCat("prompt token id ", id, " is outside the vocabulary [0, ", vocab_size_, ")"),
          "prompt");
    }
  }
  if (absl::Status valid = serving::ValidateSamplingParams(out.params, vocab_size_); !valid.ok()) {
    return InvalidRequest(std::string(valid.message()), SamplingParamOf(valid.message()));
  }
  if (absl::Status reachable = serving::CheckMinTokensReachable(out.params, eos_ids_, vocab_size_);
      !reachable.ok()) {
    return InvalidRequest(std::string(reachable.message()), "min_tokens");
  }
  // The values the workers see (worker.v1 carries float32), also colocated: both modes agree.
  serving::RoundToFloat32(out.params);
  return out;
}

std::optional<ApiError> RequestPreparer::ContextLengthError(const ApiRequest& req,
                                                            int64_t prompt_length) const {
  const bool chat = req.endpoint == Endpoint::kChatCompletions;
  const char* what = chat ? "messages" : "prompt";
  const std::string limit =
      absl::StrCat("This model's maximum context length is ", context_length_, " tokens. ");
  if (prompt_length >= context_length_) {
    // The prompt alone leaves no room for one generated token: the prompt is at fault, whatever
    // max_tokens says (OpenAI's wording for an over-long prompt).
    return InvalidRequest(
        absl::StrCat(
            limit, "However, your ", what, " resulted in ", prompt_length, " tokens",
            prompt_length == context_length_ ? ", which leaves no room for the completion" : "",
            ". Please reduce the length of the ", what, "."),
        what, "context_length_exceeded");
  }
  if (req.max_tokens && prompt_length + *req.max_tokens > context_length_) {
    return InvalidRequest(
        absl::StrCat(limit, "However, you requested ", prompt_length + *req.max_tokens, " tokens (",
                     prompt_length, " in the ", what, ", ", *req.max_tokens,
                     " for the completion). Please reduce the length of the ", what,
                     ", or max_tokens to at most ", context_length_ - prompt_length, "."),
        "max_tokens", "context_length_exceeded");
  }
  return std::nullopt;
}

TokenLogprob RequestPreparer::Logprob(const SampledText& sampled) const {
  const auto raw_bytes = [this](int32_t id) {
    std::string bytes;
    if (!tokenizer_->AppendTokenBytes(id, /*skip_special_tokens=*/false, &bytes).ok())
      bytes.clear();
    return bytes;
  };
  TokenLogprob lp;
  lp.token = tokenizer_->Decode(std::vector<int32_t>{sampled.token}).value_or("");
  lp.bytes = raw_bytes(sampled.token);
  lp.logprob = sampled.logprob;
  for (const auto& [token, logprob] : sampled.top) {
    lp.top.emplace_back(tokenizer_->Decode(std::vector<int32_t>{token}).value_or(""), logprob);
    lp.top_bytes.push_back(raw_bytes(token));
  }
  return lp;
}

namespace {

// The answer parser of a chat choice; nullopt for /v1/completions or a model without a chat
// format (its text is all content).
std::optional<text::ChatOutputParser> AnswerParser(const RequestPreparer& preparer,
                                                   const ApiRequest& req) {
  const text::ChatFormat* format = preparer.chat_format();
  if (req.endpoint != Endpoint::kChatCompletions || format == nullptr) return std::nullopt;
  const text::ChatOptions options = ChatOptionsOf(req);
  return text::ChatOutputParser(format->AnswerOptions(options, !options.tools.empty()));
}

}  // namespace

ChoiceText::ChoiceText(const RequestPreparer& preparer, const ApiRequest& req, int index)
    : preparer_(preparer),
      detokenizer_(preparer.tokenizer(),
                   {req.skip_special_tokens, req.stop, req.min_tokens.value_or(0)}),
      answer_(AnswerParser(preparer, req)),
      index_(index),
      want_logprobs_(req.logprobs),
      parallel_tool_calls_(req.parallel_tool_calls),
      stop_token_ids_(req.stop_token_ids) {}

bool ChoiceText::EndsChoice(int32_t token, const std::string& finish_reason) const {
  if (finish_reason != "stop") return false;
  const auto& eos = preparer_.eos_ids();
  return std::find(eos.begin(), eos.end(), token) != eos.end() ||
         std::find(stop_token_ids_.begin(), stop_token_ids_.end(), token) != stop_token_ids_.end();
}

void ChoiceText::Split(std::string text, bool at_end, ChoiceDelta& delta) {
  if (!answer_) {
    delta.text += text;
    return;
  }
  text::ChatOutputPiece piece = answer_->Add(text);
  if (at_end) {
    text::ChatOutputPiece rest = answer_->Finish();
    piece.reasoning += rest.reasoning;
    piece.content += rest.content;
    for (auto& call : rest.tool_calls) piece.tool_calls.push_back(std::move(call));
  }
  delta.text += piece.content;
  delta.reasoning += piece.reasoning;
  for (text::ParsedToolCall& call : piece.tool_calls) {
    // parallel_tool_calls false: one call per answer; later ones are dropped.
    if (!parallel_tool_calls_ && tool_calls_ > 0) continue;
    delta.tool_calls.push_back(
        {tool_calls_++, NewToolCallId(), std::move(call.name), std::move(call.arguments)});
  }
}

std::string ChoiceText::FinishText(const std::string& finish_reason) {
  // A chat answer that max_tokens (or a guard) cut may end inside a character the next token
  // would have completed (e.g. a tool-call block cut inside the 3-byte '｜'): that tail is
  // dropped, not shown as U+FFFD. The model's own end ("stop": EOS, a stop token) keeps Decode's
  // text, and /v1/completions' text is always Decode(ids) (its tokens' texts and text_offset
  // describe exactly that text).
  const bool cut = answer_.has_value() && finish_reason != "stop";
  return (cut ? detokenizer_.FinishCut() : detokenizer_.Finish()).text;
}

void ChoiceText::End(const std::string& finish_reason, ChoiceDelta& delta) {
  // A choice that made tool calls and then stopped on its own ends with "tool_calls" (OpenAI).
  finish_reason_ = finish_reason == "stop" && tool_calls_ > 0 ? "tool_calls" : finish_reason;
  delta.finish_reason = finish_reason_;
  done_ = true;
}

ChoiceDelta ChoiceText::Add(const SampledText& sampled, const std::string& finish_reason) {
  ChoiceDelta delta;
  delta.index = index_;
  if (done_) return delta;
  ++tokens_;
  if (answer_ && answer_->in_reasoning()) ++reasoning_tokens_;
  absl::StatusOr<text::DetokenizeStep> step = detokenizer_.Add(sampled.token);
  // The token that ended the choice (EOS, a stop token) has no text: its logprob is left out
  // so that the logprob tokens join to the text.
  if (want_logprobs_ && !EndsChoice(sampled.token, finish_reason)) {
    delta.logprobs.push_back(preparer_.Logprob(sampled));
  }
  const bool stop_string = step.ok() && step->stopped;
  const bool ends = stop_string || !finish_reason.empty();
  std::string text = step.ok() ? step->text : "";
  if (ends && !stop_string) text += FinishText(finish_reason);
  Split(std::move(text), ends, delta);
  if (ends) End(stop_string ? "stop" : finish_reason, delta);
  return delta;
}

ChoiceDelta ChoiceText::Finish(const std::string& finish_reason) {
  ChoiceDelta delta;
  delta.index = index_;
  if (done_) return delta;
  Split(FinishText(finish_reason), /*at_end=*/true, delta);
  End(finish_reason, delta);
  return delta;
}

}  // namespace pdserve::frontend
