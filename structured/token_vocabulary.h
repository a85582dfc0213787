// The model's tokens as byte strings, in a trie laid out for one pass per decode step: the
// token mask of structured/json_constraint.h walks it with the JSON automaton, pruning a subtree
// at its first refused byte.
//
// Thread-safety: immutable after Create; share freely.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "text/tokenizer.h"

namespace pdserve::structured {

class TokenVocabulary {
 public:
  // token_bytes[id]: the bytes token `id` adds to the output; nullopt or empty: never allowed
  // under a constraint (special tokens; the end-of-sequence ids are allowed separately).
  static std::shared_ptr<const TokenVocabulary> Create(
      const std::vector<std::optional<std::string>>& token_bytes);
  // Every token of `tokenizer` but the special ones, by its decoded bytes
  // (Tokenizer::AppendTokenBytes). Errors: the tokenizer's.
  static absl::StatusOr<std::shared_ptr<const TokenVocabulary>> FromTokenizer(
      const text::Tokenizer& tokenizer);

  int32_t size() const { return size_; }  // one more than the largest id
  // The bytes of token `id` (empty: never allowed). REQUIRES: 0 <= id < size().
  const std::string& bytes(int32_t id) const { return bytes_[id]; }
  // The trie in preorder. Node 0 is the root (the empty string); node i >= 1 adds byte(i) at
  // depth(i) >= 1, its subtree is [i, skip(i)), and the tokens spelled by the path to it are
  // tokens()[token_begin(i), token_begin(i + 1)).
  int32_t num_nodes() const { return static_cast<int32_t>(byte_.size()); }
  uint8_t byte(int32_t i) const { return byte_[i]; }
  uint16_t depth(int32_t i) const { return depth_[i]; }
  int32_t skip(int32_t i) const { return skip_[i]; }
  int32_t token_begin(int32_t i) const { return token_begin_[i]; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int32_t max_depth() const { return max_depth_; }
  // The id of a token that is exactly `byte`, or -1.
  int32_t SingleByteToken(uint8_t byte) const { return single_byte_[byte]; }

 private:
  TokenVocabulary() = default;

  int32_t size_ = 0;
  std::vector<std::string> bytes_;
  std::vector<uint8_t> byte_;
  std::vector<uint16_t> depth_;
  std::vector<int32_t> skip_;
  std::vector<int32_t> token_begin_;  // num_nodes + 1 entries
  std::vector<int32_t> tokens_;
  int32_t max_depth_ = 0;
  int32_t single_byte_[256];
};

}  // namespace pdserve::structured
