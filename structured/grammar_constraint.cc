#include "structured/grammar_constraint.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "common/status.h"
#include "structured/json_matcher.h"
#include "structured/tool_call_grammar.h"

namespace pdserve::structured {
namespace {

// Tokens held by one request's cache at most (about 8 bytes each), then it starts over.
constexpr int64_t kMaxCachedTokens = int64_t{1} << 22;

void SetBit(std::vector<uint64_t>& bits, int32_t token) {
  bits[static_cast<size_t>(token) / 64] |= uint64_t{1} << (token % 64);
}

}  // namespace

absl::StatusOr<std::shared_ptr<GrammarConstraint>> GrammarConstraint::ForJsonSchema(
    std::string_view schema_text, std::shared_ptr<const TokenVocabulary> vocabulary) {
  PDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<const JsonGrammar> grammar,
                           JsonGrammar::Parse(schema_text));
  return std::make_shared<GrammarConstraint>(std::move(grammar), std::move(vocabulary));
}

absl::StatusOr<std::shared_ptr<GrammarConstraint>> GrammarConstraint::ForToolCalls(
    std::string_view spec_text, std::shared_ptr<const TokenVocabulary> vocabulary) {
  PDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<const ToolCallGrammar> grammar,
                           ToolCallGrammar::Parse(spec_text));
  return std::make_shared<GrammarConstraint>(std::move(grammar), std::move(vocabulary));
}

std::shared_ptr<const GrammarConstraint::Accepted> GrammarConstraint::Walk(
    const MatcherState& state) const {
  const TokenVocabulary& v = *vocabulary_;
  std::vector<MatcherState> levels(static_cast<size_t>(v.max_depth()) + 1);
  levels[0] = state;
  std::vector<std::pair<int64_t, int32_t>> found;  // (shortest completion after, token)
  const std::vector<int32_t>& tokens = v.tokens();
  for (int32_t i = 1; i < v.num_nodes();) {
    const uint16_t d = v.depth(i);
    if (!grammar_->Step(levels[d - 1], v.byte(i), &levels[d])) {
      i = v.skip(i);
      continue;
    }
    if (v.token_begin(i) < v.token_begin(i + 1)) {
      const int64_t after = grammar_->MinCompletionBytes(levels[d]);
      for (int32_t k = v.token_begin(i); k < v.token_begin(i + 1); ++k) {
        found.emplace_back(after, tokens[k]);
      }
    }
    ++i;
  }
  std::sort(found.begin(), found.end());
  auto accepted = std::make_shared<Accepted>();
  accepted->bits.assign((static_cast<size_t>(v.size()) + 63) / 64, 0);
  for (const auto& [after, token] : found) {
    accepted->tokens.push_back(token);
    accepted->min_after.push_back(after);
    SetBit(accepted->bits, token);
  }
  return accepted;
}

std::shared_ptr<const GrammarConstraint::Accepted> GrammarConstraint::Lookup(
    const MatcherState& state) {
  std::string key = state.Key();
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
  }
  std::shared_ptr<const Accepted> accepted = Walk(state);
  absl::MutexLock lock(&mu_);
  cached_tokens_ += static_cast<int64_t>(accepted->tokens.size()) + 1;
  if (cached_tokens_ > kMaxCachedTokens) {
    cache_.clear();
    cached_tokens_ = static_cast<int64_t>(accepted->tokens.size()) + 1;
  }
  cache_.emplace(std::move(key), accepted);
  return accepted;
}

absl::Status GrammarConstraint::FillMask(const GrammarMatcher& matcher, int64_t remaining,
                                         std::span<const int32_t> end_ids, int64_t vocab_size,
                                         std::vector<uint64_t>* allowed) {
  std::shared_ptr<const Accepted> accepted = Lookup(matcher.state());
  const int64_t now = matcher.MinCompletionBytes();
  const int64_t budget = remaining - 1;  // tokens left after this one
  allowed->assign((static_cast<size_t>(vocab_size) + 63) / 64, 0);
  const std::vector<int64_t>& after = accepted->min_after;
  // The tokens after which the document still fits; when none does and the document is not
  // complete (max_tokens below the shortest completion from the start), the ones that shorten
  // it; when none does, any. A complete document with no room left may only end.
  size_t keep = std::upper_bound(after.begin(), after.end(), budget) - after.begin();
  if (keep == 0 && now > 0) {
    keep = std::lower_bound(after.begin(), after.end(), now) - after.begin();
    if (keep == 0) keep = after.size();
  }
  if (keep == after.size() && vocab_size >= vocabulary_->size()) {
    std::copy(accepted->bits.begin(), accepted->bits.end(), allowed->begin());
  } else {
    for (size_t k = 0; k < keep; ++k) {
      if (accepted->tokens[k] < vocab_size) SetBit(*allowed, accepted->tokens[k]);
    }
  }
  if (now == 0) {
    for (int32_t id : end_ids) {
      if (id >= 0 && id < vocab_size) SetBit(*allowed, id);
    }
  }
  if (std::all_of(allowed->begin(), allowed->end(), [](uint64_t w) { return w == 0; })) {
    return absl::FailedPreconditionError(
        "no token of the vocabulary continues the constrained output (response_format or "
        "tool_choice)");
  }
  return absl::OkStatus();
}

bool GrammarConstraint::Accept(GrammarMatcher& matcher, int32_t token) const {
  if (token < 0 || token >= vocabulary_->size()) return false;
  const std::string& bytes = vocabulary_->bytes(token);
  return !bytes.empty() && matcher.Advance(bytes);
}

}  // namespace pdserve::structured
