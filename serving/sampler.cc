#include "serving/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "serving/philox.h"

namespace pdserve::serving {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
// The first sort extends over this many candidates; later ones double it.
constexpr size_t kInitialSortedPrefix = 64;

absl::Status CheckLogits(std::span<const float> logits) {
  if (logits.empty()) return absl::InvalidArgumentError("logits are empty");
  for (size_t t = 0; t < logits.size(); ++t) {
    if (std::isnan(logits[t]) || logits[t] == std::numeric_limits<float>::infinity()) {
      return absl::InvalidArgumentError(
          absl::StrCat("logits hold ", logits[t], " at token ", t, " of ", logits.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckIdInLogits(absl::string_view what, int32_t token, size_t vocab) {
  if (token < 0 || static_cast<size_t>(token) >= vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " token id ", token, " is outside the logits [0, ", vocab, ")"));
  }
  return absl::OkStatus();
}

// Orders token ids by (score descending, id ascending): a strict total order.
struct ByScoreThenId {
  const std::vector<double>* score;
  bool operator()(int32_t a, int32_t b) const {
    const double sa = (*score)[a];
    const double sb = (*score)[b];
    return sa > sb || (sa == sb && a < b);
  }
};

// Candidate ids whose first sorted_ entries are in final order and precede all the others.
// Sorting lazily keeps the common case (a peaked distribution) linear in the vocabulary.
class SortedPrefix {
 public:
  SortedPrefix(std::vector<int32_t> ids, ByScoreThenId order)
      : ids_(std::move(ids)), order_(order) {}

  size_t size() const { return ids_.size(); }
  // The i-th candidate in sorted order.
  int32_t at(size_t i) {
    if (i >= sorted_) Extend(i + 1);
    return ids_[i];
  }
  void Truncate(size_t n) {
    if (n < ids_.size()) {
      Extend(n);
      ids_.resize(n);
      sorted_ = n;
    }
  }

 private:
  void Extend(size_t n) {
    n = std::min(ids_.size(), std::max({n, 2 * sorted_, kInitialSortedPrefix}));
    if (n <= sorted_) return;
    const auto begin = ids_.begin() + static_cast<std::ptrdiff_t>(sorted_);
    const auto middle = ids_.begin() + static_cast<std::ptrdiff_t>(n);
    if (middle != ids_.end()) std::nth_element(begin, middle, ids_.end(), order_);
    std::sort(begin, middle, order_);
    sorted_ = n;
  }

  std::vector<int32_t> ids_;
  ByScoreThenId order_;
  size_t sorted_ = 0;
};

// Raw log-softmax at `token` and the `top` most likely tokens.
void FillLogprobs(std::span<const float> logits, const SamplingParams& params,
                  SampledToken& result) {
  double max_logit = kNegInf;
  for (float logit : logits) max_logit = std::max<double>(max_logit, logit);
  double sum = 0.0;
  for (float logit : logits) sum += std::exp(logit - max_logit);
  const double log_normalizer = max_logit + std::log(sum);
  result.logprob = static_cast<float>(logits[result.token] - log_normalizer);
  if (!params.logprobs) return;

  std::vector<double> raw(logits.begin(), logits.end());
  std::vector<int32_t> ids(raw.size());
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<int32_t>(t);
  const size_t top = std::min<size_t>(*params.logprobs, ids.size());
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(top), ids.end(),
                    ByScoreThenId{&raw});
  for (size_t i = 0; i < top; ++i) {
    result.top_logprobs.push_back({ids[i], static_cast<float>(raw[ids[i]] - log_normalizer)});
  }
}

int32_t Argmax(const std::vector<double>& z) {
  int32_t best = 0;
  for (size_t t = 1; t < z.size(); ++t) {
    if (z[t] > z[best]) best = static_cast<int32_t>(t);
  }
  return best;
}

// Steps 6-7 of the header over the temperature-scaled logits `z` (at least one finite). Sums run
// in token id order over all candidates or in sorted order over a truncated prefix, both unique.
int32_t DrawFiltered(const std::vector<double>& z, const SamplingParams& params, double uniform) {
  double max_z = kNegInf;
  for (double value : z) max_z = std::max(max_z, value);
  // Weights relative to the most likely token: exp(z - max_z) in [0, 1], 1 for the first.
  std::vector<double> weights(z.size());
  auto weight = [&](int32_t token) { return weights[token]; };

  std::vector<int32_t> candidates;
  double total = 0.0;
  for (size_t t = 0; t < z.size(); ++t) {
    if (z[t] == kNegInf) continue;
    candidates.push_back(static_cast<int32_t>(t));
    weights[t] = std::exp(z[t] - max_z);
    total += weights[t];
  }
  SortedPrefix sorted(std::move(candidates), ByScoreThenId{&z});
  auto truncate = [&](size_t n) {
    if (n >= sorted.size()) return;
    sorted.Truncate(n);
    total = 0.0;
    for (size_t i = 0; i < n; ++i) total += weight(sorted.at(i));
  };
  if (params.top_k > 0) truncate(static_cast<size_t>(params.top_k));
  if (params.top_p < 1.0) {
    const double threshold = params.top_p * total;
    double cumulative = 0.0;
    for (size_t i = 0; i < sorted.size(); ++i) {
      cumulative += weight(sorted.at(i));
      if (cumulative >= threshold) {
        truncate(i + 1);
        break;
      }
    }
  }
  if (params.min_p > 0.0) {
    size_t kept = 1;
    while (kept < sorted.size() && weight(sorted.at(kept)) >= params.min_p) ++kept;
    truncate(kept);
  }

  const double target = uniform * total;
  double cumulative = 0.0;
  int32_t last_positive = sorted.at(0);
  for (size_t i = 0; i < sorted.size(); ++i) {
    const int32_t token = sorted.at(i);
    const double w = weight(token);
    if (w <= 0.0) break;
    cumulative += w;
    last_positive = token;
    if (cumulative > target) return token;
  }
  // Only reachable through rounding in the running sum: the draw belongs to the tail.
  return last_positive;
}

}  // namespace

absl::StatusOr<std::vector<double>> ProcessLogits(std::span<const float> logits,
                                                  const SamplingParams& params,
                                                  std::span<const int32_t> end_token_ids,
                                                  const TokenHistory& history,
                                                  std::span<const uint64_t> allowed) {
  PDSERVE_RETURN_IF_ERROR(CheckLogits(logits));
  std::vector<double> z(logits.begin(), logits.end());
  if (!allowed.empty()) {
    for (size_t t = 0; t < z.size(); ++t) {
      if (t / 64 >= allowed.size() || !((allowed[t / 64] >> (t % 64)) & 1)) z[t] = kNegInf;
    }
  }
  if (history.generated_length() < params.min_tokens) {
    for (int32_t token : end_token_ids) {
      PDSERVE_RETURN_IF_ERROR(CheckIdInLogits("end", token, z.size()));
      z[token] = kNegInf;
    }
  }
  for (const auto& [token, bias] : params.logit_bias) {
    PDSERVE_RETURN_IF_ERROR(CheckIdInLogits("logit_bias", token, z.size()));
    z[token] += bias;
  }
  const double penalty = params.repetition_penalty;
  auto repeat = [&](int32_t token) {
    PDSERVE_RETURN_IF_ERROR(CheckIdInLogits("history", token, z.size()));
    z[token] = z[token] > 0.0 ? z[token] / penalty : z[token] * penalty;
    return absl::OkStatus();
  };
  if (penalty != 1.0) {
    for (int32_t token : history.prompt_tokens()) PDSERVE_RETURN_IF_ERROR(repeat(token));
    for (const auto& [token, count] : history.generated_counts()) {
      if (!history.prompt_tokens().contains(token)) PDSERVE_RETURN_IF_ERROR(repeat(token));
    }
  }
  for (const auto& [token, count] : history.generated_counts()) {
    PDSERVE_RETURN_IF_ERROR(CheckIdInLogits("history", token, z.size()));
    z[token] -= count * params.frequency_penalty + params.presence_penalty;
  }
  return z;
}

absl::StatusOr<SampledToken> SampleToken(std::span<const float> logits,
                                         const SamplingParams& params,
                                         std::span<const int32_t> end_token_ids,
                                         const TokenHistory& history, SampleKey key,
                                         std::span<const uint64_t> allowed) {
  PDSERVE_ASSIGN_OR_RETURN(std::vector<double> z,
                           ProcessLogits(logits, params, end_token_ids, history, allowed));
  SampledToken result;
  result.token = Argmax(z);
  if (z[result.token] == kNegInf) {
    return absl::FailedPreconditionError(
        "every token is masked (min_tokens, logit_bias, response_format or -inf logits)");
  }
  if (params.temperature >= kGreedyTemperature) {
    for (double& value : z) value /= params.temperature;
    const PhiloxCounter counter = {key.position, key.choice, 0, 0};
    const PhiloxKey philox_key = {static_cast<uint32_t>(key.seed),
                                  static_cast<uint32_t>(key.seed >> 32)};
    result.token = DrawFiltered(z, params, PhiloxUniform(counter, philox_key));
  }
  FillLogprobs(logits, params, result);
  return result;
}

const char* FinishReasonName(FinishReason reason) {
  return reason == FinishReason::kStop ? "stop" : "length";
}

RequestSampler::RequestSampler(const SamplingParams& params, uint64_t seed, int64_t vocab_size,
                               std::vector<int32_t> end_token_ids, std::vector<Choice> choices,
                               std::shared_ptr<structured::GrammarConstraint> constraint)
    : params_(params),
      seed_(seed),
      vocab_size_(vocab_size),
      end_token_ids_(std::move(end_token_ids)),
      choices_(std::move(choices)),
      constraint_(std::move(constraint)) {}

absl::Status CheckMinTokensReachable(const SamplingParams& params,
                                     std::span<const int32_t> eos_token_ids, int64_t vocab_size) {
  if (params.min_tokens <= 0 || vocab_size <= 0) return absl::OkStatus();
  std::vector<bool> ends(static_cast<size_t>(vocab_size), false);
  int64_t covered = 0;
  auto mark = [&](int32_t token) {
    if (token >= 0 && token < vocab_size && !ends[static_cast<size_t>(token)]) {
      ends[static_cast<size_t>(token)] = true;
      ++covered;
    }
  };
  if (!params.ignore_eos) {
    for (int32_t token : eos_token_ids) mark(token);
  }
  for (int32_t token : params.stop_token_ids) mark(token);
  if (covered < vocab_size) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("min_tokens is ", params.min_tokens,
                   " but stop_token_ids and the end-of-sequence ids cover "
                   "all ",
                   vocab_size,
                   " tokens of the vocabulary: every token is masked before min_tokens, so no "
                   "token could be generated"));
}

absl::StatusOr<RequestSampler> RequestSampler::Create(
    const SamplingParams& params, std::string_view request_id,
    std::span<const int32_t> eos_token_ids, std::span<const int32_t> prompt, int64_t vocab_size,
    std::shared_ptr<const structured::TokenVocabulary> vocabulary) {
  PDSERVE_RETURN_IF_ERROR(ValidateSamplingParams(params, vocab_size));
  std::shared_ptr<structured::GrammarConstraint> constraint;
  if (!params.json_schema.empty() || !params.tool_call_grammar.empty()) {
    if (!vocabulary) {
      return absl::FailedPreconditionError(
          "response_format and tool_choice \"required\" / a named function need the tokenizer's "
          "vocabulary, which this server did not load");
    }
    if (!params.json_schema.empty()) {
      PDSERVE_ASSIGN_OR_RETURN(constraint, structured::GrammarConstraint::ForJsonSchema(
                                               params.json_schema, std::move(vocabulary)));
    } else {
      PDSERVE_ASSIGN_OR_RETURN(constraint, structured::GrammarConstraint::ForToolCalls(
                                               params.tool_call_grammar, std::move(vocabulary)));
    }
  }
  std::vector<int32_t> end_ids;
  if (!params.ignore_eos) end_ids.assign(eos_token_ids.begin(), eos_token_ids.end());
  for (int32_t token : end_ids) {
    if (token < 0 || token >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("eos token id ", token, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  end_ids.insert(end_ids.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
  for (int32_t token : prompt) {
    if (token < 0 || token >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt token id ", token, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  std::vector<Choice> choices;
  choices.push_back({TokenHistory(prompt)});
  for (int32_t i = 1; i < params.n; ++i) {
    choices.push_back({TokenHistory::SamePrompt(choices.front().history)});
  }
  if (constraint) {
    for (Choice& choice : choices) choice.grammar = constraint->Start();
  }
  return RequestSampler(params, EffectiveSeed(params, request_id), vocab_size, std::move(end_ids),
                        std::move(choices), std::move(constraint));
}

absl::StatusOr<RequestSampler::Choice*> RequestSampler::OpenChoice(int32_t choice) {
  if (choice < 0 || choice >= static_cast<int32_t>(choices_.size())) {
    return absl::OutOfRangeError(
        absl::StrCat("choice ", choice, " is outside [0, ", choices_.size(), ")"));
  }
  if (choices_[choice].finished) {
    return absl::FailedPreconditionError(absl::StrCat("choice ", choice, " has finished"));
  }
  return &choices_[choice];
}

namespace {

// The constrained output is whole and no byte can extend it (a closed object, array or string;
// not a number, which may still grow): only an end id could follow.
bool GrammarEnded(const structured::GrammarMatcher& matcher) {
  if (!matcher.Complete()) return false;
  structured::MatcherState next;
  for (int b = 0; b < 256; ++b) {
    if (matcher.grammar().Step(matcher.state(), static_cast<uint8_t>(b), &next)) return false;
  }
  return true;
}

}  // namespace

std::optional<FinishReason> RequestSampler::Append(Choice& state, int32_t token) {
  state.history.Append(token);
  std::optional<FinishReason> finish;
  if (std::find(end_token_ids_.begin(), end_token_ids_.end(), token) != end_token_ids_.end()) {
    finish = FinishReason::kStop;
  } else if (state.history.generated_length() >= params_.max_tokens) {
    // The budget binds where the grammar's own end fell (the mask steers a budget that fits the
    // shortest document to close it on the last token): the document is whole, not cut, so
    // "stop" (OpenAI clients treat "length" as truncated output: the SDK's parse() refuses it).
    finish =
        state.grammar && GrammarEnded(*state.grammar) ? FinishReason::kStop : FinishReason::kLength;
  }
  state.finished = finish.has_value();
  return finish;
}

absl::Status RequestSampler::AdvanceGrammar(Choice& state, int32_t token) {
  if (!state.grammar) return absl::OkStatus();
  const bool ends =
      std::find(end_token_ids_.begin(), end_token_ids_.end(), token) != end_token_ids_.end();
  if ((ends && state.grammar->Complete()) || constraint_->Accept(*state.grammar, token)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("token id ", token,
                   " does not continue the constrained output (response_format or "
                   "tool_choice)"));
}

absl::StatusOr<RequestSampler::DrawInputs> RequestSampler::PrepareDraw(int32_t choice,
                                                                       int64_t vocab) {
  PDSERVE_ASSIGN_OR_RETURN(Choice * state, OpenChoice(choice));
  DrawInputs inputs;
  inputs.params = &params_;
  inputs.end_token_ids = end_token_ids_;
  inputs.history = &state->history;
  inputs.key = {seed_, static_cast<uint32_t>(choice),
                static_cast<uint32_t>(state->history.position())};
  if (state->grammar) {
    const int64_t remaining = params_.max_tokens - state->history.generated_length();
    PDSERVE_RETURN_IF_ERROR(
        constraint_->FillMask(*state->grammar, remaining, end_token_ids_, vocab, &state->mask));
    inputs.allowed = state->mask;
  }
  return inputs;
}

absl::StatusOr<SampleStep> RequestSampler::CommitDraw(int32_t choice, SampledToken sampled) {
  PDSERVE_ASSIGN_OR_RETURN(Choice * state, OpenChoice(choice));
  SampleStep step;
  step.sampled = std::move(sampled);
  PDSERVE_RETURN_IF_ERROR(AdvanceGrammar(*state, step.sampled.token));
  step.finish = Append(*state, step.sampled.token);
  return step;
}

absl::StatusOr<SampleStep> RequestSampler::Next(int32_t choice, std::span<const float> logits) {
  PDSERVE_ASSIGN_OR_RETURN(DrawInputs in, PrepareDraw(choice, static_cast<int64_t>(logits.size())));
  PDSERVE_ASSIGN_OR_RETURN(SampledToken sampled, SampleToken(logits, *in.params, in.end_token_ids,
                                                             *in.history, in.key, in.allowed));
  return CommitDraw(choice, std::move(sampled));
}

absl::StatusOr<std::optional<FinishReason>> RequestSampler::Record(int32_t choice, int32_t token) {
  PDSERVE_ASSIGN_OR_RETURN(Choice * state, OpenChoice(choice));
  if (token < 0 || token >= vocab_size_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "recorded token id ", token, " is outside the vocabulary [0, ", vocab_size_, ")"));
  }
  PDSERVE_RETURN_IF_ERROR(AdvanceGrammar(*state, token));
  return Append(*state, token);
}

}  // namespace pdserve::serving
