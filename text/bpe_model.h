// Byte-level BPE model of a tokenizer.json ("model": {"type": "BPE", ...}).
//
// Encoding follows `tokenizers` models/bpe (Word::merge_all): the piece's bytes start as one
// symbol each (the vocabulary id of the byte's ByteLevel character); then the adjacent pair with
// the lowest merge rank is merged, leftmost first among equal ranks, until no pair has a merge.
// Merges are read in both forms tokenizer.json uses: "a b" strings and ["a", "b"] arrays.
// Encoded pieces of up to kMaxCachedPieceBytes are memoised.
//
// Thread-safety: Encode may run concurrently (the memo is mutex-guarded); everything else is
// immutable after FromJson().
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"

namespace pdserve::text {

class BpeModel {
 public:
  static constexpr size_t kMaxCachedPieceBytes = 64;
  static constexpr size_t kMaxCacheEntries = 1 << 17;

  // Parses the "model" object. Errors: InvalidArgument for malformed vocab/merges, a merge whose
  // parts or result are not in the vocabulary, or a byte without a vocabulary entry;
  // Unimplemented for dropout, unk_token, subword prefixes/suffixes or byte_fallback.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& model);

  // Appends the ids of one pre-tokenized piece given as raw bytes. REQUIRES: !piece.empty().
  void Encode(std::string_view piece, std::vector<int32_t>* ids) const;

  // The vocabulary string of `id` (ByteLevel characters), or nullopt when `id` is not in it.
  std::optional<std::string_view> IdToToken(int32_t id) const;
  std::optional<int32_t> TokenToId(std::string_view token) const;

  // One more than the largest id of the vocabulary.
  int32_t id_limit() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct MergeRule {
    int32_t rank;
    int32_t result;
  };
  BpeModel() = default;
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  void MergePiece(std::string_view piece, std::vector<int32_t>* ids) const;

  absl::flat_hash_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> id_present_;
  absl::flat_hash_map<uint64_t, MergeRule> merges_;
  int32_t byte_ids_[256] = {};
  bool ignore_merges_ = false;

  mutable absl::Mutex cache_mutex_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_
      ABSL_GUARDED_BY(cache_mutex_);
};

}  // namespace pdserve::text
