#include "serving/token_history.h"

#include <utility>

namespace pdserve::serving {

TokenHistory::TokenHistory(std::span<const int32_t> prompt)
    : TokenHistory(
          std::make_shared<const absl::flat_hash_set<int32_t>>(prompt.begin(), prompt.end()),
          static_cast<int64_t>(prompt.size())) {}

TokenHistory::TokenHistory(std::shared_ptr<const absl::flat_hash_set<int32_t>> prompt_tokens,
                           int64_t prompt_length)
    : prompt_tokens_(std::move(prompt_tokens)), prompt_length_(prompt_length) {}

TokenHistory TokenHistory::SamePrompt(const TokenHistory& other) {
  return TokenHistory(other.prompt_tokens_, other.prompt_length_);
}

void TokenHistory::Append(int32_t token) {
  generated_.push_back(token);
  ++generated_counts_[token];
}

}  // namespace pdserve::serving
