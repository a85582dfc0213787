// The tokens one choice has seen, in the form the sampler's penalties need.
//
// Repetition penalty reads the set of prompt and generated tokens; presence and frequency
// penalties read per-token counts of generated tokens (OpenAI: "how many times the token has
// appeared in the text so far", the generated text). The prompt set is shared between the n
// choices of a request, so n choices over a long prompt hold one copy of it.
// Not thread-safe: one choice is advanced by one thread at a time; const methods may be called
// concurrently with each other.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace pdserve::serving {

class TokenHistory {
 public:
  // `prompt`: the prompt's token ids; the position of the first generated token is prompt.size().
  explicit TokenHistory(std::span<const int32_t> prompt);
  // A new choice over the same prompt as `other` (sharing its prompt set), with nothing generated.
  static TokenHistory SamePrompt(const TokenHistory& other);

  // Records a generated token.
  void Append(int32_t token);

  int64_t prompt_length() const { return prompt_length_; }
  int64_t generated_length() const { return static_cast<int64_t>(generated_.size()); }
  // Absolute position of the next token to generate.
  int64_t position() const { return prompt_length_ + generated_length(); }
  std::span<const int32_t> generated() const { return generated_; }

  // Distinct prompt tokens.
  const absl::flat_hash_set<int32_t>& prompt_tokens() const { return *prompt_tokens_; }
  // Generated token id -> number of times generated.
  const absl::flat_hash_map<int32_t, int32_t>& generated_counts() const {
    return generated_counts_;
  }

 private:
  TokenHistory(std::shared_ptr<const absl::flat_hash_set<int32_t>> prompt_tokens,
               int64_t prompt_length);

  std::shared_ptr<const absl::flat_hash_set<int32_t>> prompt_tokens_;
  int64_t prompt_length_;
  std::vector<int32_t> generated_;
  absl::flat_hash_map<int32_t, int32_t> generated_counts_;
};

}  // namespace pdserve::serving
