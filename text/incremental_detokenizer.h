// Streaming detokenization: token ids in, text pieces out, UTF-8 safe and stop-string aware.
//
// Guarantees (tests/text/incremental_detokenizer_test.cc checks them at every split point):
//  - a piece never ends inside a UTF-8 sequence, so no U+FFFD appears where an emoji or CJK
//    character spans tokens; bytes that can still complete a character are held back;
//  - without stop strings, the concatenation of all pieces (Add... then Finish) equals
//    Tokenizer::Decode(all ids) exactly, including U+FFFD for bytes that are truly invalid;
//  - with stop strings, text that could still be the start of a stop string is held back; the
//    concatenation equals Decode(all ids) cut before the earliest occurrence of any stop string
//    (TruncateAtStop), and no part of a matched stop string is ever emitted. With min_tokens,
//    occurrences that end before the min_tokens-th token's text are not matches.
//
// Thread-safety: not thread-safe; one instance per request stream. The Tokenizer must outlive it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "text/tokenizer.h"

namespace pdserve::text {

struct DetokenizeOptions {
  bool skip_special_tokens = true;
  std::vector<std::string> stop_strings;  // empty strings are ignored
  // vLLM's min_tokens for stop strings: one counts only when it ends in the text of the
  // min_tokens-th token or a later one; earlier occurrences are plain text (0 and 1: any).
  int64_t min_tokens = 0;
};

// Text released by one step. After `stopped` is true the stream is over: further ids are ignored.
struct DetokenizeStep {
  std::string text;
  bool stopped = false;
  std::string stop_string;  // the stop string that matched, when stopped
};

class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, DetokenizeOptions options);

  // Consumes one generated id and returns the text that became final.
  // Errors: OutOfRange for an id outside the vocabulary (the stream state is unchanged).
  absl::StatusOr<DetokenizeStep> Add(int32_t id);

  // Ends the stream: releases held-back text (an unfinished UTF-8 tail becomes U+FFFD, as in
  // Decode; partial stop-string prefixes are released since they can no longer complete).
  DetokenizeStep Finish();
  // Ends a stream that was cut short (max_tokens, a guard): as Finish, except that an unfinished
  // UTF-8 tail (bytes a later token could still have completed into one character) is dropped
  // instead of becoming U+FFFD: the cut fell inside that character. Bytes that are invalid
  // whatever follows still become U+FFFD.
  DetokenizeStep FinishCut();

  bool stopped() const { return stopped_; }

 private:
  // Finish / FinishCut: `drop_tail` drops the unfinished UTF-8 tail.
  DetokenizeStep End(bool drop_tail);
  // Moves final text from pending_ to the step, stopping at a complete stop string.
  void Release(bool at_end, DetokenizeStep* step);

  const Tokenizer& tokenizer_;
  DetokenizeOptions options_;
  std::string bytes_;      // raw bytes not yet decoded (an unfinished UTF-8 tail)
  std::string pending_;    // decoded text held back for stop-string matching
  int64_t added_ = 0;      // ids consumed
  size_t stop_floor_ = 0;  // a stop string in pending_ must end after this many bytes
  bool stopped_ = false;
};

// The non-streaming reference: `text` cut before the earliest occurrence of any non-empty stop
// string. Sets `*matched` (if given) to the stop string found, or clears it.
std::string TruncateAtStop(std::string_view text, const std::vector<std::string>& stop_strings,
                           std::string* matched = nullptr);

}  // namespace pdserve::text
