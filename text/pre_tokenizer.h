// The pre-tokenizer of a byte-level BPE tokenizer.json: Split stages, then ByteLevel.
//
// Mirrors `tokenizers` (pre_tokenizers/{sequence,split,byte_level}.rs semantics): each Split stage
// runs its regex on every piece the previous stage produced (lookarounds see only that piece) and
// keeps matches and the gaps between them as separate pieces ("Isolated") or drops the matches
// ("Removed"). The ByteLevel stage must come last with add_prefix_space=false and
// use_regex=false, as in DeepSeek-V3/V3.2/V4; it maps bytes to vocabulary characters, which
// BpeModel folds into its byte table, so here it leaves the pieces unchanged.
//
// Thread-safety: immutable after FromJson(); Split may run concurrently.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "text/regex.h"

namespace pdserve::text {

class PreTokenizer {
 public:
  using Piece = Regex::Match;

  // Parses the "pre_tokenizer" object. Errors: InvalidArgument for malformed JSON, Unimplemented
  // for pre-tokenizer types or options outside the byte-level family described above.
  static absl::StatusOr<PreTokenizer> FromJson(const nlohmann::json& spec);

  // Replaces `*pieces` with the byte ranges of `text` in order. `scratch` is reused storage.
  // REQUIRES: `text` is valid UTF-8. Errors: as Regex::FindAll.
  absl::Status Split(std::string_view text, std::vector<Piece>* pieces,
                     std::vector<Piece>* scratch) const;

 private:
  struct Stage {
    Regex regex;
    bool remove_matches;
  };
  explicit PreTokenizer(std::vector<Stage> stages) : stages_(std::move(stages)) {}

  std::vector<Stage> stages_;
};

}  // namespace pdserve::text
