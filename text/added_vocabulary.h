// The "added_tokens" of a tokenizer.json: tokens matched verbatim in the input before BPE.
//
// Matching mirrors `tokenizers` AddedVocabulary: tokens with normalized=false are found first,
// leftmost-longest; then tokens with normalized=true in the gaps. When the caller does not allow
// special tokens, matches of special tokens are dropped after matching (their text is then
// encoded as ordinary text), which is what `tokenizers` does with encode_special_tokens=true.
//
// Thread-safety: immutable after FromJson().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::text {

struct AddedToken {
  int32_t id;
  std::string content;
  bool special;
  bool normalized;
};

class AddedVocabulary {
 public:
  // A byte range of the input; `id` >= 0 when it is an added token, -1 for ordinary text.
  struct Segment {
    size_t begin;
    size_t end;
    int32_t id;
  };

  // Parses the "added_tokens" array (null or absent: empty). Errors: InvalidArgument for
  // malformed entries; Unimplemented for lstrip/rstrip/single_word = true.
  static absl::StatusOr<AddedVocabulary> FromJson(const nlohmann::json& added_tokens);

  // Replaces `*segments` with `text` cut at added-token matches, in order, covering all of it.
  void Split(std::string_view text, bool allow_special, std::vector<Segment>* segments) const;

  const AddedToken* Find(int32_t id) const;
  std::optional<int32_t> TokenToId(std::string_view content) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  // A byte trie over token contents; `token` is the index into tokens_ ending at a node, or -1.
  struct Trie {
    struct Node {
      absl::flat_hash_map<uint8_t, int32_t> children;
      int32_t token = -1;
    };
    std::vector<Node> nodes{Node{}};
    bool first_byte[256] = {};

    void Insert(std::string_view content, int32_t token);
    // Longest token starting at text[pos], or -1.
    int32_t LongestAt(std::string_view text, size_t pos, size_t* length) const;
  };

  void SplitWith(const Trie& trie, std::string_view text, size_t begin, size_t end,
                 bool allow_special, std::vector<Segment>* out) const;

  std::vector<AddedToken> tokens_;
  absl::flat_hash_map<int32_t, size_t> by_id_;
  absl::flat_hash_map<std::string, int32_t> by_content_;
  Trie raw_trie_;         // normalized = false
  Trie normalized_trie_;  // normalized = true
};

}  // namespace pdserve::text
